"""The engine: selectors, actions, the plan, the hooks, and the run's three stages
(prepare → stream → finish)."""
