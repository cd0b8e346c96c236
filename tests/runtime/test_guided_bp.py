"""experiment=guided_bp against an independent Guided Backprop: a custom autograd ReLU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from torch import nn


class _GuidedReLUFunction(torch.autograd.Function):
    """ReLU whose backward passes (f_in > 0) * (R > 0) * R (tests/seeds/000, eq. 3)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * (x > 0) * (grad > 0)


class _GuidedReLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GuidedReLUFunction.apply(x)


def _guided_reference(model: nn.Module, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Input gradient of each sample's predicted logit, every nn.ReLU swapped for the reference."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.ReLU):
                setattr(parent, name, _GuidedReLU())
    model.eval()
    x = x.clone().requires_grad_(True)
    out = model(x)
    target = out.argmax(dim=1)
    out.gather(1, target[:, None]).sum().backward()
    return x.grad.numpy(), target.numpy()


@pytest.mark.parametrize("arch,size", [("alexnet", 64), ("resnet18", 48)])
def test_guided_bp_equals_reference(run_hookrun, tmp_path, arch, size):
    torch.manual_seed(11)
    reference_model = torchvision.models.get_model(arch, weights=None)
    weights = tmp_path / f"{arch}.pt"
    torch.save(reference_model.state_dict(), weights)
    overrides = [
        "experiment=guided_bp",
        f"model={arch}",
        f"model.weights={weights}",
        "dataset=fake",
        "dataset.size=3",
        f"dataset.image_size={size}",
        "batch_size=2",
    ]
    _, data = run_hookrun(overrides)
    x = torch.from_numpy(data["captures/input/output"])
    expected, target = _guided_reference(reference_model, x)
    got = data["captures/input/grad_output"]
    np.testing.assert_array_equal(data["samples/target"], target)
    scale = np.abs(expected).max()
    assert scale > 0
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale)
    # Guided Backprop really differs from the plain gradient here (the clamp did something).
    plain = torchvision.models.get_model(arch, weights=None)
    plain.load_state_dict(torch.load(weights))
    plain.eval()
    xg = x.clone().requires_grad_(True)
    out = plain(xg)
    out.gather(1, torch.from_numpy(target)[:, None]).sum().backward()
    assert not np.allclose(got, xg.grad.numpy(), atol=1e-3 * scale)
