"""Derived methods: results computed per batch from captured tensors (the stage: stage.py).
The registry is in registry.py; each module below registers its methods when imported here."""

from hookrun.stages.derive import (
    cam,  # noqa: F401  (registers grad_cam, cam, guided_grad_cam)
    cam_plus,  # noqa: F401  (registers grad_cam_pp, layer_cam)
    integrated,  # noqa: F401  (registers integrated_gradients)
    smoothgrad,  # noqa: F401  (registers smoothgrad)
    stage,  # noqa: F401  (registers the derive stage)
)
