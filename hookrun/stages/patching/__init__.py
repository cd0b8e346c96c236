"""Activation patching grids on language models (experiment=lm_patching; the stage:
stage.py): config.py parses `patching:`, grid.py plans the grid and runs it per batch."""

from hookrun.stages.patching import stage  # noqa: F401  (registers the patching stage)
