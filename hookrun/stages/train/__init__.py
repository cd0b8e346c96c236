"""Training sparse dictionaries (experiment=train_sae): the `sae:` node, its job (a loop of
steps, not a batch of rows: hookrun/training/), the scores of what it trained, the summary,
the pictures and a sweep's columns."""

from hookrun.stages.train import stage as stage  # noqa: F401  (registers the stage)
