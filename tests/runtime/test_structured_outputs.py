"""Modules (and models) whose outputs are dicts, namedtuples, lists or ModelOutput-style
dict subclasses: every floating-point leaf is a site (`output.<key>`), actions change the
leaf they act on, and a tensor with no batch axis is never cut into sample rows."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import numpy as np
import torch
from conftest import read
from torch import nn

import hookrun

Pair = namedtuple("Pair", ["low", "high"])
TOL = {"rtol": 1e-5, "atol": 1e-6}  # batches of 2 + 1 here, of 3 in the reference


class ModelOutput(OrderedDict):
    """Like transformers' ModelOutput: a dict subclass with attribute access."""

    def __getattr__(self, name):
        return self[name]


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return {"features": y, "mask": (y > 0).long(), "pooled": y.mean(dim=(2, 3))}


class Split(nn.Module):
    def forward(self, x):
        return Pair(low=torch.relu(-x), high=torch.relu(x))


class BiasTable(nn.Module):
    """Returns the same (3, 5) table whatever the batch (as Swin's relative-position bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(3, 5))

    def forward(self):
        return self.table * 1.0


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.encoder = Encoder()
        self.split = Split()
        self.table = BiasTable()
        self.head = nn.Linear(8 + 5, 3)

    def forward(self, x):
        enc = self.encoder(x)
        pair = self.split(enc["pooled"])
        bias = self.table().mean(dim=0)
        z = torch.cat([pair.low, pair.high, bias.expand(x.shape[0], -1)], dim=1)
        return ModelOutput(logits=self.head(z), hidden=[enc["features"], enc["pooled"]])


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(3, 6, 6, generator=g) for _ in range(3)]


def _run(tmp_path, *overrides: str, experiment: str = "saliency") -> dict:
    cfg = [f"experiment={experiment}", "render=false", "batch_size=2", *overrides]
    return read(hookrun.run(cfg, model=Structured(), dataset=_inputs(), run_dir=tmp_path).path)


def _hook(name: str, select: str, at: str, action: str = "capture") -> list[str]:
    return [
        f"++hooks.{name}.select.name={select}",
        f"++hooks.{name}.at={at}",
        f"++hooks.{name}.action={action}",
    ]


def _reference():
    """Plain autograd on the same model: leaves and their gradients for the predicted class."""
    model = Structured().eval()
    seen = {}
    model.encoder.register_forward_hook(lambda m, i, o: seen.update(enc=o))
    model.split.register_forward_hook(lambda m, i, o: seen.update(pair=o))
    x = torch.stack(_inputs())
    out = model(x)
    for t in (seen["enc"]["features"], seen["pair"].high):
        t.retain_grad()
    target = out.logits.argmax(dim=1)
    out.logits.gather(1, target[:, None]).sum().backward()
    return seen, out, target


def test_dict_namedtuple_and_model_output_leaves_are_captured(tmp_path):
    hooks = [
        *_hook("enc", "encoder", "output"),
        *_hook("pair", "split", "output"),
        *_hook("pair_grad", "split", "grad_output"),
        *_hook("enc_grad", "encoder", "grad_output"),
    ]
    data = _run(tmp_path, *hooks)
    seen, out, target = _reference()
    np.testing.assert_array_equal(data["samples/target"], target.numpy())
    np.testing.assert_allclose(data["model/output"], out.logits.detach().numpy(), rtol=1e-5)
    enc = seen["enc"]
    np.testing.assert_allclose(
        data["captures/encoder/output.features"], enc["features"].detach(), **TOL
    )
    np.testing.assert_allclose(
        data["captures/encoder/output.pooled"], enc["pooled"].detach(), **TOL
    )
    assert "captures/encoder/output.mask" not in data  # integer leaves are not float sites
    np.testing.assert_allclose(data["captures/split/output.low"], seen["pair"].low.detach(), **TOL)
    np.testing.assert_allclose(
        data["captures/split/output.high"], seen["pair"].high.detach(), **TOL
    )
    np.testing.assert_allclose(
        data["captures/split/grad_output.high"], seen["pair"].high.grad, rtol=1e-5, atol=1e-7
    )
    grad = data["captures/encoder/grad_output.features"]
    np.testing.assert_allclose(grad, enc["features"].grad, rtol=1e-5, atol=1e-7)
    assert np.abs(grad).max() > 0


def test_an_action_on_one_leaf_changes_that_leaf_only(tmp_path):
    hooks = [*_hook("cut", "split", "output", "zero"), *_hook("after", "head", "input")]
    data = _run(tmp_path, *hooks, experiment="capture")  # forward only: nothing left to derive
    head_input = data["captures/head/input"]
    assert np.all(head_input[:, :8] == 0)  # low and high, both leaves zeroed
    assert np.all(head_input[:, 8:] != 0)  # the bias part is untouched


def test_a_tensor_without_batch_axis_is_stored_per_batch_not_cut_into_rows(tmp_path):
    data = _run(tmp_path, *_hook("bias", "table", "output"))
    table = Structured().table.table.detach().numpy()  # the module's own tensor, directly
    assert data["captures/table/output"].shape == (2, 3, 5)  # batches [0, 1] and [2]
    np.testing.assert_allclose(data["captures/table/output"], np.stack([table] * 2), rtol=1e-6)


def test_a_glob_match_that_never_runs_is_listed(tmp_path):
    class WithSpare(Structured):
        def __init__(self) -> None:
            super().__init__()
            self.spare = nn.Linear(2, 2)  # registered, never called

    cfg = [
        "experiment=saliency",
        "render=false",
        *_hook("lin", "*", "output"),
        "++hooks.lin.select.type=Linear",
    ]
    result = hookrun.run(cfg, model=WithSpare(), dataset=_inputs(), run_dir=tmp_path)
    assert "selected but never ran (nothing stored there): lin: spare" in result.summary
    with result.open() as res:
        assert "captures/head/output" in res
        assert not any(k.startswith("captures/spare") for k in res.layers)
