"""The features job (experiment=features): each unit's dashboard over a corpus."""

from hookrun.stages.features import stage  # noqa: F401  (registers the stage)
