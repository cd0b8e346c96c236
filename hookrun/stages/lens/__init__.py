"""The logit lens: a derived method (derive.logit_lens, lens.py) that projects each block's
output through the model's final norm and unembedding; its tables are drawn by stage.py."""

from hookrun.stages.lens import (
    lens,  # noqa: F401  (registers the logit_lens method)
    stage,  # noqa: F401  (registers the logit_lens stage: its tables' axes and pictures)
)
