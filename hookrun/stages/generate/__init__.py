"""Generation with the run's hooks at every decoding step (`generate:`, experiment=generate)."""

from hookrun.stages.generate import stage as stage  # registers the stage
