"""Evaluation of a run's attributions (the stage: stage.py): faithfulness metrics (a
registry, registry.py; each module below registers its metrics when imported here), and a
sweep's ranking by them (ranking.py)."""

from hookrun.stages.evaluate import (
    curves,  # noqa: F401  (registers deletion, insertion)
    road,  # noqa: F401  (registers road)
    stage,  # noqa: F401  (registers the evaluate stage)
)
