"""Circuits (experiment=circuit): edge attribution patching between a language model's
attention heads, MLPs, embeddings and logits."""

from hookrun.stages.circuit import stage as stage
