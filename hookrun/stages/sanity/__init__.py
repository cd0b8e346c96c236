"""The sanity check by model randomisation (experiment=sanity_check; the stage: stage.py)."""

from hookrun.stages.sanity import stage  # noqa: F401  (registers the sanity stage)
