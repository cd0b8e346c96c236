"""Hook mechanics: in-place modules, modules called twice, residual branches, cleanup."""

from __future__ import annotations

import h5py
import models_for_tests as m
import numpy as np
import pytest
import torch
from conftest import hook

TWICE = [
    "model=custom",
    "model._target_=models_for_tests.TwiceNet",
    "dataset=constant",
    "dataset.shape=[4]",
    "dataset.size=3",
    "target.kind=index",
    "target.index=1",
]


def _inputs(data: dict) -> torch.Tensor:
    return torch.from_numpy(data["captures/input/output"])


def test_module_called_twice_gets_one_gradient_per_call(run_hookrun):
    overrides = [
        *TWICE,
        "dataset.value=0.5",
        "batch_size=2",
        *hook("x", "input", "output", "capture"),
        *hook("g", "fc", "grad_output", "capture"),
        *hook("r", "relu", "output", "capture"),
    ]
    _, data = run_hookrun(overrides)
    net = m.BUILT[-1]
    x = _inputs(data)
    # Reference: the same computation written out, out-of-place, with retain_grad.
    h1 = net.fc(x)
    h1.retain_grad()
    r1 = torch.relu(h1)
    h2 = net.fc(r1)
    h2.retain_grad()
    r2 = torch.relu(h2)
    net.head(r2)[:, 1].sum().backward()
    np.testing.assert_allclose(data["captures/fc/grad_output"], h1.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(data["captures/fc/grad_output.call1"], h2.grad.numpy(), rtol=1e-6)
    # The in-place ReLU's first output was later overwritten by nothing: captures are copies.
    np.testing.assert_allclose(data["captures/relu/output"], r1.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(data["captures/relu/output.call1"], r2.detach().numpy(), rtol=1e-6)


def test_capture_survives_later_inplace_op(run_hookrun):
    # fc's output is modified in place by the ReLU that follows; the capture must not be.
    overrides = [
        *TWICE,
        "dataset.value=-1.5",
        *hook("o", "fc", "output", "capture"),
        *hook("x", "input", "output", "capture"),
    ]
    _, data = run_hookrun(overrides)
    net = m.BUILT[-1]
    expected = net.fc(_inputs(data)).detach().numpy()
    assert (expected < 0).any(), "the test needs negative pre-activations"
    np.testing.assert_allclose(data["captures/fc/output"], expected, rtol=1e-6)


def test_grad_input_sees_only_this_modules_share(run_hookrun):
    overrides = [
        "model=custom",
        "model._target_=models_for_tests.ResidualNet",
        "dataset=constant",
        "dataset.shape=[4]",
        "dataset.size=2",
        "target.kind=index",
        "target.index=0",
        *hook("gin", "relu", "grad_input", "capture"),
        *hook("gout", "relu", "grad_output", "capture"),
        *hook("pre", "pre", "grad_output", "capture"),
    ]
    _, data = run_hookrun(overrides)
    net = m.BUILT[-1]
    x = torch.ones(2, 4)
    h = net.pre(x)
    h.retain_grad()
    net.head(torch.relu(h) + h)[:, 0].sum().backward()
    g_out = data["captures/relu/grad_output"]
    through_relu = g_out * (h.detach().numpy() > 0)
    np.testing.assert_allclose(data["captures/relu/grad_input"], through_relu, rtol=1e-6)
    # pre's output gradient is the total: through the ReLU plus the skip connection.
    np.testing.assert_allclose(data["captures/pre/grad_output"], h.grad.numpy(), rtol=1e-6)
    assert not np.allclose(data["captures/pre/grad_output"], through_relu)


def _hook_counts(net: torch.nn.Module) -> list[int]:
    return [
        len(mod._forward_hooks)
        + len(mod._forward_pre_hooks)
        + len(mod._backward_hooks)
        + len(mod._backward_pre_hooks)
        for mod in net.modules()
    ]


def test_run_that_raises_leaves_model_as_it_came_and_file_not_complete(tmp_path):
    from conftest import run_config

    overrides = [
        "model=custom",
        "model._target_=models_for_tests.ExplodingNet",
        "dataset=constant",
        "dataset.shape=[4]",
        "dataset.size=4",
        "batch_size=2",
        *hook("g", '"*"', "grad_input", "clamp", min=0),
        *hook("o", '"*"', "output", "capture"),
        *hook("x", "input", "grad_output", "capture"),
    ]
    with pytest.raises(RuntimeError, match="boom in batch 2"):
        run_config(tmp_path, overrides)
    net = m.BUILT[-1]
    assert isinstance(net, m.ExplodingNet) and net.calls == 2  # forward passes with grad
    assert _hook_counts(net) == [0] * len(list(net.modules()))
    assert net.training  # run_mode switched to eval for the run and back afterwards
    assert all(p.requires_grad for p in net.parameters())
    assert net.relu.inplace is True
    with h5py.File(tmp_path / "captures.h5") as f:
        assert f.attrs["status"] == "failed"
        assert f.attrs["completed"] == 2  # the first batch is kept
        assert "boom" in f.attrs["error"]
