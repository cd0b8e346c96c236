"""Induction scores (experiment=induction; the stage: stage.py): each head's attention
from a repeated token to the one after its earlier copy."""

from hookrun.stages.induction import stage  # noqa: F401  (registers the induction stage)
