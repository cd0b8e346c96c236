"""The hook runtime: what a config's hooks become on a model and how one batch runs through
them — selectors, sites, actions (a registry; patch.py reads stored tensors), function and
attention-pattern sites, positions, the compiled plan, attaching and removing every hook,
the shape probe, targets, device transfer and the per-batch step. It knows no stage: the
stages (hookrun/stages/) use it from above."""

# Actions in modules of their own register when the runtime is imported.
from hookrun.runtime import (
    patch,  # noqa: E402,F401  (registers patch)
    splice,  # noqa: E402,F401  (registers sae, transcoder)
)
