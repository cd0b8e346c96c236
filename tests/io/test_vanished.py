"""An attribution that is exactly zero (the target's gradient vanished, as with torchvision
ViT's zero-initialised head on random weights) is named in the run's summary, not passed
over in silence; a model whose gradient flows gets no such line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookrun

DATA = [torch.rand(3, 8, 8) for _ in range(3)]


def small_net(head_zero: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    if head_zero:
        nn.init.zeros_(net[3].weight)  # the logits are the bias alone: no input gradient
    return net.eval()


@pytest.mark.slow
def test_a_vanished_gradient_is_named_in_the_summary(tmp_path):
    args = ["experiment=saliency", "render=false", "progress=false"]
    zero = hookrun.run(args, model=small_net(True), dataset=DATA, run_dir=tmp_path / "zero")
    assert "warning: /captures/input/grad_output is exactly zero in its first 3 rows" in (
        zero.summary
    )
    with zero.open() as res:  # the warning is true: the gradient is zero
        assert not res["captures/input/grad_output"][:].any()
    live = hookrun.run(args, model=small_net(False), dataset=DATA, run_dir=tmp_path / "live")
    assert "exactly zero" not in live.summary
    with live.open() as res:
        assert res["captures/input/grad_output"][:].any()


def test_a_vanished_derived_result_is_named_too(tmp_path):
    args = ["experiment=smoothgrad", "derive.smoothgrad.samples=2", "render=false"]
    zero = hookrun.run(args, model=small_net(True), dataset=DATA, run_dir=tmp_path / "zero")
    assert "warning: /derived/smoothgrad/input is exactly zero" in zero.summary
