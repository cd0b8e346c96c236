"""The logit lens: a derived method (derive.logit_lens) that projects each block's output
through the model's final norm and unembedding."""

from hookrun.stages.lens import lens  # noqa: F401  (registers logit_lens)
