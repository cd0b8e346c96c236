"""The dictionary scores stage (`sae_scores:`): how well each spliced SAE or transcoder
stands in for its site, over the run's tokens."""

from hookrun.stages.sae import stage  # noqa: F401  (registers the stage)
