"""Tensors whose rows are not one per sample: a table with no batch axis is stored once per
batch (never cut into sample rows), windows folded into the batch axis sample by sample are
stored (N, k, ...) after the probe checked the order on real values, and everything else is
refused in one line. References: the modules' own tensors and the window partition written
out here, never hookrun's output."""

from __future__ import annotations

import signal

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from any_models import images
from conftest import read
from models_for_tests import WindowNet
from torch import nn

import hookrun
from hookrun.errors import HookrunError, Interrupted
from hookrun.io import layout
from hookrun.verify import verify


def _hook(hook: str, at: str, action: str = "capture", **select: str) -> list[str]:
    out = [f"++hooks.{hook}.at={at}", f"++hooks.{hook}.action={action}"]
    return out + [f"++hooks.{hook}.select.{k}={v}" for k, v in select.items()]


def _run(model: nn.Module, xs, run_dir, *extra: str) -> hookrun.api.Result:
    overrides = ["experiment=saliency", "render=false", "batch_size=2", "progress=false", *extra]
    return hookrun.run(overrides, model=model, dataset=xs, run_dir=run_dir)


def _windows(x: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) → (N, 4, H/2 * W/2, C): each sample's 2x2 windows, row-major."""
    n, c, h, w = x.shape
    parts = [
        x[:, :, i * h // 2 : (i + 1) * h // 2, j * w // 2 : (j + 1) * w // 2]
        for i in (0, 1)
        for j in (0, 1)
    ]
    return torch.stack([p.flatten(2).transpose(1, 2) for p in parts], dim=1)


def test_a_table_without_batch_axis_is_stored_once_per_batch(tmp_path):
    model = WindowNet()
    xs = images(8, n=5)  # batches of 2, 2 and 1
    result = _run(model, xs, tmp_path, *_hook("t", "output", name="bias"))
    table = (model.bias.table * 2.0).detach().numpy()  # the module's own tensor, directly
    with result.open() as res:
        ds = res["captures/bias/output"]
        assert ds.shape == (3, 3, 5)  # one row per batch, not five sample rows
        assert layout.per_batch(ds) == 2
        np.testing.assert_array_equal(ds[:], np.stack([table] * 3))
        assert "(one row per batch of 2 samples (no batch axis))" in repr(res)
        assert res["samples/index"].shape == (5,)
    ok, lines = verify(result.path)
    assert ok, lines
    assert "/captures/bias/output" in result.plan_text and "/batch" in result.plan_text


def test_windows_folded_sample_by_sample_are_stored_per_sample(tmp_path):
    model = WindowNet()
    xs = images(8, n=3)
    hooks = [*_hook("p", "output", name="proj"), *_hook("pg", "grad_output", name="proj")]
    data = read(_run(model, xs, tmp_path, *hooks).path)
    x = torch.stack(xs)
    tokens = _windows(model.conv(x)).detach().requires_grad_(True)  # (3, 4, 16, 4)
    proj = tokens @ model.proj.weight.T + model.proj.bias
    proj.retain_grad()
    pooled = torch.relu(proj).mean(dim=2).mean(dim=1)
    out = model.head(pooled) + model.bias()[0, :3]
    out.gather(1, out.argmax(dim=1)[:, None]).sum().backward()
    assert data["captures/proj/output"].shape == (3, 4, 16, 6)
    np.testing.assert_allclose(data["captures/proj/output"], proj.detach(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(data["captures/proj/grad_output"], proj.grad, rtol=1e-5, atol=1e-8)
    assert np.abs(proj.grad.numpy()).max() > 0


def test_windows_folded_window_by_window_are_refused_naming_why(tmp_path):
    with pytest.raises(
        HookrunError,
        match=r"hooks.p: /captures/proj/output cannot be stored row by row \(its rows are "
        r"not grouped sample by sample; shape \[4, 16, 6\]",
    ):
        _run(
            WindowNet(window_major=True),
            images(8, n=2),
            tmp_path,
            *_hook("p", "output", name="proj"),
        )
    # Matched by type, it is left out and listed; the rest is stored.
    result = _run(
        WindowNet(window_major=True),
        images(8, n=2),
        tmp_path / "glob",
        *_hook("l", "output", type="Linear"),
    )
    assert "proj (not stored: its rows are not grouped sample by sample)" in result.summary
    with result.open() as res:
        assert "proj" not in res.layers and res.layers["head"]["output"] == (2, 3)


def test_patch_refuses_a_site_without_one_row_per_sample(tmp_path):
    source = _run(WindowNet(), images(8, n=2), tmp_path / "src", *_hook("p", "output", name="proj"))
    patch = [*_hook("x", "output", "patch", name="proj"), f"++hooks.x.args.file={source.path}"]
    with pytest.raises(
        HookrunError,
        match=r"hooks.x: /captures/proj/output holds 4 rows per sample folded into the "
        r"batch axis, and patch",
    ):
        _run(WindowNet(), images(8, n=2), tmp_path / "dst", *patch)


def test_per_batch_rows_resume_to_the_uninterrupted_bytes(tmp_path):
    class SignalsItself(torch.utils.data.Dataset):
        def __init__(self, signum: int | None) -> None:
            self.signum = signum

        def __len__(self) -> int:
            return 7  # batches of 2: the last one is short

        def __getitem__(self, index: int) -> torch.Tensor:
            if index == 3 and self.signum is not None:
                signal.raise_signal(self.signum)  # a real SIGTERM, handled by the run
                self.signum = None
            return torch.linspace(-1, 1, 3 * 8 * 8).view(3, 8, 8) * (index + 1)

    hooks = [*_hook("t", "output", name="bias"), *_hook("p", "output", name="proj")]
    with pytest.raises(Interrupted):
        _run(WindowNet(), SignalsItself(signal.SIGTERM), tmp_path / "cut", *hooks)
    with layout.open_readonly(tmp_path / "cut" / "captures.h5") as f:
        # Row 3 was being read for batch [2, 3]: it stops there; batch [0, 1] is written.
        assert layout.read_state(f).completed == 2 and f["captures/bias/output"].shape[0] == 1
    resumed = _run(WindowNet(), SignalsItself(None), tmp_path / "cut", *hooks, "resume=true")
    clean = _run(WindowNet(), SignalsItself(None), tmp_path / "clean", *hooks)
    got, want = read(resumed.path), read(clean.path)
    assert got.keys() == want.keys() and want["captures/bias/output"].shape == (4, 3, 5)
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key


def test_swin_v2_position_bias_mlp_is_stored_once_per_batch(tmp_path):
    # swin_v2's cpb_mlp maps the (1, 15, 15, 2) coordinate table to the bias table: a
    # module output with no batch axis of its own.
    torch.manual_seed(0)
    model = torchvision.models.swin_v2_t().eval()
    attn = model.features[1][0].attn
    hooks = _hook("t", "output", name="features.1.0.attn.cpb_mlp")
    result = _run(model, images(32, n=3), tmp_path, *hooks)
    with torch.no_grad():
        table = attn.cpb_mlp(attn.relative_coords_table).numpy()  # (1, 15, 15, 3)
    with result.open() as res:
        ds = res["captures/features.1.0.attn.cpb_mlp/output"]
        assert ds.shape == (2, *table.shape) and layout.per_batch(ds) == 2
        np.testing.assert_allclose(ds[:], np.stack([table] * 2), rtol=1e-5, atol=1e-7)


class Attention(nn.Module):
    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.view(x.shape[0], 4, 8)
        if not self.attn.batch_first:  # (L, N, E) in and out
            out = self.attn(*[tokens.transpose(0, 1)] * 3, need_weights=False)[0].transpose(0, 1)
        else:
            out = self.attn(tokens, tokens, tokens, need_weights=False)[0]
        return self.head(out.mean(1))


def _heads(model: Attention, x: torch.Tensor) -> torch.Tensor:
    """The two heads' outputs, concatenated, written out from the attention's definition."""
    q, k, v = F.linear(x, model.attn.in_proj_weight, model.attn.in_proj_bias).chunk(3, -1)
    heads = [
        torch.softmax(q[..., h * 4 : h * 4 + 4] @ k[..., h * 4 : h * 4 + 4].transpose(1, 2) / 2, -1)
        @ v[..., h * 4 : h * 4 + 4]
        for h in range(2)
    ]
    return torch.cat(heads, -1)


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_out_proj_is_captured_at_its_call(tmp_path, batch_first):
    """nn.MultiheadAttention applies out_proj inside the fused F.multi_head_attention_forward;
    selected, it is a site of its own: its input the heads' concatenated output, its output
    out_proj of that (references written out by hand), its gradient autograd's, and the
    model's output the same as without the selection."""
    xs = [torch.randn(32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    hooks = [
        *_hook("i", "input", name="attn.out_proj"),
        *_hook("o", "output", name="attn.out_proj"),
        *_hook("g", "grad_output", name="attn.out_proj"),
    ]
    data = read(_run(Attention(batch_first), xs, tmp_path / "hooked", *hooks).path)
    plain = read(_run(Attention(batch_first), xs, tmp_path / "plain").path)
    model, x = Attention(batch_first).eval(), torch.stack(xs).view(2, 4, 8)
    heads = _heads(model, x).detach().requires_grad_(True)
    out = model.attn.out_proj(heads)
    logits = model.head(out.mean(1))
    (grad,) = torch.autograd.grad(logits.gather(1, logits.argmax(1)[:, None]).sum(), out)
    np.testing.assert_allclose(
        data["captures/attn.out_proj/input"], heads.detach(), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        data["captures/attn.out_proj/output"], out.detach(), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        data["captures/attn.out_proj/grad_output"], grad, rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(data["model/output"], plain["model/output"], rtol=1e-6, atol=1e-7)
    # Matched by type it is stored like any Linear, not listed as never run.
    result = _run(
        Attention(batch_first), xs, tmp_path / "glob", *_hook("l", "output", type="Linear")
    )
    assert "never ran" not in result.summary
    assert read(result.path)["captures/attn.out_proj/output"].shape == (2, 4, 8)


KILLED_MID_RUN = """
import os, signal, sys
import numpy as np
from pathlib import Path
from hookrun.io.appender import CapturesFile, FileOptions
options = FileOptions(folds={"t": 0, "w": 3}, batch_size=2)
kept = CapturesFile.create(Path(sys.argv[1]), {"config": "x"}, options)
for b in range(3):
    kept.append({"s": np.full((2, 4), b, "f4"), "t": np.full((1, 5), b, "f4"),
                 "w": np.full((2, 3, 2), b, "f4")})
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_killed_file_keeps_its_per_batch_rows_and_continues_them(tmp_path):
    import subprocess
    import sys

    from hookrun.io.appender import FileOptions
    from hookrun.io.stored import reopen

    path = tmp_path / "captures.h5"
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_RUN, str(path)])
    assert proc.returncode == -signal.SIGKILL
    with pytest.raises(OSError):  # still marked open by the killed writer
        h5py.File(path, "r").close()
    resumed = reopen(path, FileOptions())  # copies the rows into a fresh file
    resumed.append(
        {
            "s": np.full((1, 4), 3, "f4"),
            "t": np.full((1, 5), 3, "f4"),
            "w": np.full((1, 3, 2), 3, "f4"),
        }
    )  # a short last batch
    resumed.close()
    data = read(path)
    np.testing.assert_array_equal(data["t"][:, 0], [0, 1, 2, 3])  # one row per batch
    np.testing.assert_array_equal(data["s"][:, 0], [0, 0, 1, 1, 2, 2, 3])
    assert data["w"].shape == (7, 3, 2)
    with layout.open_readonly(path) as f:
        assert layout.per_batch(f["t"]) == 2
        assert layout.rows_note(f["w"]).startswith("axis 1: the 3 rows per sample")
    ok, lines = verify(path)
    damage = [line for line in lines if line.startswith("  damaged:")]
    # Made by hand, not by a run: verify misses only what makes a file hookrun's, every row
    # reads back.
    assert not ok and damage, lines
    assert all("every hookrun file has it" in d or "hookrun wrote" in d for d in damage), lines


def test_patch_refuses_a_source_record_stored_once_per_batch(tmp_path):
    source = _run(WindowNet(), images(8, n=4), tmp_path / "src", *_hook("t", "output", name="bias"))
    patch = [
        *_hook("p", "output", "patch", name="head"),
        f"++hooks.p.args.file={source.path}",
        "++hooks.p.args.record=captures/bias/output",
    ]
    with pytest.raises(HookrunError, match="is not stored one row per sample \\(one row per batch"):
        _run(WindowNet(), images(8, n=4), tmp_path / "patched", *patch)
