"""Evaluation of a run's attributions: faithfulness metrics (a registry, registry.py; each
module below registers its metrics when imported here)."""

from hookrun.stages.evaluate import (
    curves,  # noqa: F401  (registers deletion, insertion)
    road,  # noqa: F401  (registers road)
)
