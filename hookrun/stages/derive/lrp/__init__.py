"""Layer-wise relevance propagation as hook rules (derive.lrp): the rules (rules.py), the
composites that assign them by selector (composites.py), the canonizers (canonize.py), the
hooks that make the gradient the relevance (attach.py) and the method (method.py)."""

from hookrun.stages.derive.lrp import method  # noqa: F401  (registers lrp)
