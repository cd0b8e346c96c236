"""Derived methods: results computed per batch from captured tensors (the stage: stage.py).
The registry is in registry.py; each module below registers its methods when imported here."""

from hookrun.stages.derive import (
    cam,  # noqa: F401  (registers grad_cam, cam, guided_grad_cam)
    cam_plus,  # noqa: F401  (registers grad_cam_pp, layer_cam)
    cam_scores,  # noqa: F401  (registers score_cam, ablation_cam)
    integrated,  # noqa: F401  (registers integrated_gradients)
    lrp,  # noqa: F401  (registers lrp)
    perturb,  # noqa: F401  (registers occlusion)
    rise,  # noqa: F401  (registers rise)
    rollout,  # noqa: F401  (registers attention_rollout)
    segments,  # noqa: F401  (registers feature_ablation, kernel_shap)
    smoothgrad,  # noqa: F401  (registers smoothgrad)
    stage,  # noqa: F401  (registers the derive stage)
)
