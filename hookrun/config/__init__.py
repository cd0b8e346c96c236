"""The run's config: the schema Hydra composes into (schema.py) and the typed, frozen RunSpec
with every check that needs no model or data (build.py)."""
