"""The engine: selectors, actions, the plan, the hooks, and the run's three stages
(prepare → stream → finish)."""

# Actions in modules of their own register when the engine is imported.
from hookrun.engine import patch  # noqa: E402,F401  (registers patch)
