"""experiment=features against brute force: every number of a unit's dashboard computed here
again from a dense capture of the same rows (numpy over every token), on the shipped tiny_lm
with its SAE, on its MLP neurons, and on a conv net's channels over images (the receptive
field's box from the conv arithmetic); the logit effects by hand from the weights files; a
kill -9 then resume=true, and torchrun's two ranks, give the file one process gives; bad
input stops in one line before any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import hookrun
from hookrun.errors import HookrunError
from hookrun.stages.features.state import token_hash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import torchrun  # noqa: E402  (tests/ is no package: the worker's sys.path)

pytestmark = pytest.mark.slow  # every test here runs the model over rows

ROOT = Path(hookrun.__file__).parent
LM = ROOT / "models" / "checkpoints" / "tiny_lm"
SAE = ROOT / "models" / "checkpoints" / "tiny_lm_sae"
SITE = "features/transformer.h.1/output"
SMALL = ["limit=48", "batch_size=16", "render=false", "progress=false"]
FEAT = ["features.k=6", "features.window=[3,2]", "features.bins=16", "features.per_group=3"]


def _features(tmp: Path, extra: list[str], name: str = "feat") -> Path:
    result = hookrun.run(["experiment=features", *SMALL, *FEAT, *extra], run_dir=tmp / name)
    return result.path


def _capture(tmp: Path, module: str, extra: list[str] | None = None) -> dict[str, np.ndarray]:
    """A dense float32 capture of `module`'s output over the same rows and batches."""
    overrides = [
        "experiment=lm_cache",
        *SMALL,
        "sink.dtype=float32",
        "hooks.resid.select.regex=null",
    ]
    overrides += [f"+hooks.resid.select.name={module}", *(extra or [])]
    result = hookrun.run(overrides, run_dir=tmp / f"cap-{module}")
    with h5py.File(result.path, "r") as f:
        return {
            "x": f[f"captures/{module}/output"][()].astype(np.float32),
            "tokens": f["samples/tokens"][()],
            "mask": f["samples/mask"][()].astype(bool) if "samples/mask" in f else None,
        }


def _sae_latents(x: np.ndarray, batch: int = 16) -> np.ndarray:
    """The shipped SAE (topk, k 16, b_dec subtracted) on x, in torch per model batch as
    SAELens's TopK SAE computes it."""
    w = {k: torch.from_numpy(v) for k, v in load_file(str(SAE / "sae_weights.safetensors")).items()}
    out = []
    for start in range(0, len(x), batch):
        xb = torch.from_numpy(x[start : start + batch])
        pre = (xb - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
        values, index = pre.topk(16, dim=-1, sorted=False)
        out.append(torch.zeros_like(pre).scatter(-1, index, values.relu()).numpy())
    return np.concatenate(out)


def _reference(acts: np.ndarray, mask: np.ndarray, tokens: np.ndarray | None, k: int, w: tuple):
    """Brute force over every (row, token, unit): top k by (value desc, row, token)."""
    n, t, u = acts.shape
    real = mask[..., None] & (acts > 0)
    out = {
        "max": np.where(mask[..., None], acts, -np.inf).max((0, 1)),
        "density": real.sum((0, 1)) / mask.sum(),
        "top": [],
    }
    for unit in range(u):
        rows, toks = np.nonzero(real[..., unit])
        vals = acts[rows, toks, unit]
        order = np.lexsort((toks, rows, -vals))[:k]
        entries = []
        for i in order:
            r, p = int(rows[i]), int(toks[i])
            ctx = []
            cv = []
            for q in range(p - w[0], p + w[1] + 1):
                inside = 0 <= q < t and mask[r, q]
                ctx.append(int(tokens[r, q]) if inside and tokens is not None else -1)
                cv.append(float(acts[r, q, unit]) if inside else 0.0)
            entries.append((float(vals[i]), r, p, ctx, cv))
        out["top"].append(entries)
    return out


def _check_against(
    path: Path, acts: np.ndarray, mask: np.ndarray, tokens, site: str, k=6, w=(3, 2)
):
    ref = _reference(acts, mask, tokens, k, w)
    bins = 16
    with h5py.File(path, "r") as f:
        g = f[site]
        np.testing.assert_allclose(g["max"][()], ref["max"], rtol=1e-6)
        np.testing.assert_array_equal(g["density"][()], ref["density"])
        for unit, entries in enumerate(ref["top"]):
            got_rows = g["top/row"][unit]
            assert list(got_rows[: len(entries)]) == [e[1] for e in entries], unit
            assert list(g["top/token"][unit][: len(entries)]) == [e[2] for e in entries], unit
            np.testing.assert_allclose(
                g["top/value"][unit][: len(entries)], [e[0] for e in entries], rtol=1e-6
            )
            assert np.isnan(g["top/value"][unit][len(entries) :]).all()
            assert (got_rows[len(entries) :] == -1).all()
            if tokens is not None and entries:
                assert g["top/context"][unit][: len(entries)].tolist() == [e[3] for e in entries]
                np.testing.assert_allclose(
                    g["top/context_value"][unit][: len(entries)], [e[4] for e in entries], rtol=1e-6
                )
        # The histogram of firing values on [0, 2^e], 2^e the smallest power of two >= max.
        counts = g["histogram/counts"][()]
        edges = g["histogram/edges"][()]
        for unit in range(acts.shape[2]):
            fired = acts[..., unit][mask & (acts[..., unit] > 0)].astype(np.float64)
            if not len(fired):
                assert counts[unit].sum() == 0
                continue
            top = 2.0 ** np.ceil(np.log2(fired.max()))
            assert edges[unit, -1] == np.float32(top)
            b = np.minimum(np.floor(fired / top * bins), bins - 1).astype(int)
            np.testing.assert_array_equal(counts[unit], np.bincount(b, minlength=bins))
    return ref


def _check_samples(path: Path, acts: np.ndarray, mask: np.ndarray, site: str, groups=5, per=3):
    """Each group's samples: of its firing tokens, those of the smallest hash of (row, token,
    unit); the groups SAEDashboard's intervals of [0, max], snapped to the 16 bins."""
    bins = 16
    with h5py.File(path, "r") as f:
        g = f[site]
        for unit in range(0, acts.shape[2], 7):
            rows, toks = np.nonzero(mask & (acts[..., unit] > 0))
            if not len(rows):
                continue
            vals = acts[rows, toks, unit].astype(np.float64)
            top = 2.0 ** np.ceil(np.log2(vals.max()))
            b = np.minimum(np.floor(vals / top * bins), bins - 1).astype(int)
            lower = b * top / bins
            bounds = vals.max() * np.arange(1, groups) / groups
            group = np.searchsorted(bounds, lower, side="right")
            h = token_hash(
                torch.tensor(rows), torch.tensor(toks), torch.full((len(rows),), unit)
            ).numpy()
            for grp in range(groups):
                sel = np.nonzero(group == grp)[0]
                order = sel[np.lexsort((toks[sel], rows[sel], h[sel]))][:per]
                got = g["quantiles/row"][unit, grp]
                assert list(got[: len(order)]) == list(rows[order]), (unit, grp)
                assert list(g["quantiles/token"][unit, grp][: len(order)]) == list(toks[order])
                assert (got[len(order) :] == -1).all()


def test_sae_latents_equal_brute_force_and_read_as_text(tmp_path):
    path = _features(tmp_path, [])
    cap = _capture(tmp_path, "transformer.h.1")
    acts = _sae_latents(cap["x"])
    mask = cap["mask"] if cap["mask"] is not None else np.ones(acts.shape[:2], bool)
    ref = _check_against(path, acts, mask, cap["tokens"], SITE)
    _check_samples(path, acts, mask, SITE)
    with hookrun.open(path) as res:
        assert res.features() == [("transformer.h.1", "output")]
        unit = next(u for u, e in enumerate(ref["top"]) if e)
        contexts = res.feature("transformer.h.1", "output", unit)
        vocab = res.file["features/vocab"]
        value, row, token, ids, _ = ref["top"][unit][0]
        assert (contexts[0].value, contexts[0].row, contexts[0].token) == pytest.approx(
            (value, row, token)
        )
        peak = bytes(vocab[int(cap["tokens"][row, token])]).decode("utf-8", "replace")
        assert f"[[{peak}]]" in contexts[0].text
        with pytest.raises(KeyError, match="valid: 0 to 511"):
            res.feature("transformer.h.1", "output", 512)
    from hookrun.verify import verify

    intact, lines = verify(path)
    assert intact, lines


def test_logit_effects_equal_a_hand_computation(tmp_path):
    path = _features(tmp_path, ["limit=16", "features.logits=7"], "logits")
    sae = load_file(str(SAE / "sae_weights.safetensors"))
    lm = load_file(str(LM / "model.safetensors"))
    ln = lm["transformer.ln_f.weight"].astype(np.float64)
    w_u = lm.get("lm_head.weight", lm["transformer.wte.weight"]).astype(np.float64)  # tied
    rows = sae["W_dec"].astype(np.float64)
    rows = rows - rows.mean(axis=1, keepdims=True)  # ln_f subtracts the mean
    effects = rows @ np.diag(ln) @ w_u.T
    with h5py.File(path, "r") as f:
        g = f[SITE]
        for unit in (0, 100, 511):
            order = np.argsort(-effects[unit])[:7]
            assert list(g["logits/top_token"][unit]) == list(order)
            np.testing.assert_allclose(g["logits/top_value"][unit], effects[unit, order], rtol=1e-5)
            low = np.argsort(effects[unit])[:7]
            assert list(g["logits/bottom_token"][unit]) == list(low)
            np.testing.assert_allclose(
                g["logits/bottom_value"][unit], effects[unit, low], rtol=1e-5
            )


def test_mlp_neurons_equal_brute_force(tmp_path):
    module = "transformer.h.0.mlp.act"
    hooks = [
        "~hooks.sae",
        f"+hooks.mlp={{select: {{name: {module}}}, at: output, action: capture}}",
    ]
    path = _features(tmp_path, hooks, "mlp")
    cap = _capture(tmp_path, module)
    mask = cap["mask"] if cap["mask"] is not None else np.ones(cap["x"].shape[:2], bool)
    _check_against(path, cap["x"], mask, cap["tokens"], f"features/{module}/output")
    with h5py.File(path, "r") as f:
        assert f[f"features/{module}/output"].attrs["kind"] == "units"
        assert "logits" not in f[f"features/{module}/output"]


def test_conv_channels_equal_brute_force_and_boxes_are_receptive_fields(tmp_path):
    common = ["model=digits_cnn", "dataset=digits", "limit=24", "batch_size=8", "render=false"]
    common += ["progress=false", "target.kind=none"]
    hook = "+hooks.conv={select: {name: features.0}, at: output, action: capture}"
    result = hookrun.run(
        [
            "experiment=features",
            *common,
            "model.attention=eager",
            "~dataset.path",
            "~hooks.sae",
            hook,
            "features.k=4",
            "features.bins=16",
            "features.per_group=3",
            "features.patch=8",
        ],
        run_dir=tmp_path / "conv",
    )
    cap = hookrun.run(
        [*common, hook.replace("conv=", "c="), "sink.dtype=float32"], run_dir=tmp_path / "convcap"
    )
    with h5py.File(cap.path, "r") as f:
        x = f["captures/features.0/output"][()]
    n, c, h, w = x.shape
    acts = x.transpose(0, 2, 3, 1).reshape(n, h * w, c)
    site = "features/features.0/output"
    _check_against(result.path, acts, np.ones((n, h * w), bool), None, site, k=4)
    with h5py.File(result.path, "r") as f:
        g = f[site]
        assert g.attrs["modality"] == "image"
        rows, tokens, boxes = g["top/row"][()], g["top/token"][()], g["top/box"][()]
        assert g["top/patch"].shape == (c, 4, 3, 8, 8) and g["top/patch"].dtype == np.uint8
        for unit in range(c):
            for slot in range(4):
                if rows[unit, slot] < 0:
                    continue
                y, xx = divmod(int(tokens[unit, slot]), w)
                # A 3x3 conv, padding 1, on the image itself: the window around (y, x).
                want = [max(0, y - 1), max(0, xx - 1), min(h, y + 2), min(w, xx + 2)]
                assert boxes[unit, slot].tolist() == want


def _datasets(path: Path) -> dict[str, bytes]:
    out = {}
    with h5py.File(path, "r") as f:

        def keep(name, obj):
            if isinstance(obj, h5py.Dataset) and not obj.is_scale:
                out[name] = obj[()].tobytes()
            elif isinstance(obj, h5py.Group):
                out[name + "@"] = json.dumps(
                    {k: str(v) for k, v in obj.attrs.items()}, sort_keys=True
                ).encode()

        f.visititems(keep)
        assert f.attrs["status"] == "complete"
    return out


def _cli(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "hookrun", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


KILL = ["experiment=features", "limit=64", "batch_size=4", "render=false", "progress=false"]
KILL += ["features.checkpoint_rows=4", *FEAT]


def test_kill_9_then_resume_gives_the_uninterrupted_file(tmp_path):
    clean = tmp_path / "clean"
    done = _cli([*KILL, f"hydra.run.dir={clean}"], tmp_path)
    assert done.wait(600) == 0, done.stdout.read()
    killed = tmp_path / "killed"
    proc = _cli([*KILL, f"hydra.run.dir={killed}"], tmp_path)
    state = killed / "checkpoints" / "features_state.pt"
    deadline = time.time() + 300
    while not state.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert state.exists(), "the job ended before its first checkpoint"
    with h5py.File(killed / "captures.h5", "r") as f:
        assert f.attrs["status"] == "running"  # killed mid-way
    again = _cli([*KILL, f"hydra.run.dir={killed}", "resume=true"], tmp_path)
    assert again.wait(600) == 0, again.stdout.read()
    assert not state.exists()
    assert _datasets(killed / "captures.h5") == _datasets(clean / "captures.h5")


def test_torchrun_two_ranks_give_one_process_s_file(tmp_path):
    args = ["experiment=features", *SMALL, *FEAT]
    one = _cli([*args, f"hydra.run.dir={tmp_path / 'one'}"], tmp_path)
    assert one.wait(600) == 0, one.stdout.read()
    two = torchrun([*args, f"hydra.run.dir={tmp_path / 'two'}"], tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert _datasets(tmp_path / "two" / "captures.h5") == _datasets(
        tmp_path / "one" / "captures.h5"
    )
    assert not list((tmp_path / "two" / "checkpoints").glob("*.pt"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("features.k=0", "features.k: 0; valid: an integer >= 1"),
        ("features.window=[-1,2]", "features.window: [-1, 2] has a negative size"),
        ("features.groups=0", "features.groups: 0; valid: an integer >= 1"),
        ("features.per_group=0", "features.per_group: 0; valid: an integer >= 1"),
        ("features.bins=48", "features.bins: 48; valid: a power of two"),
        ("hooks.sae.select.name=transformer.h.9", "matches no module of the model"),
        ("hooks.sae.action=scale", "valid: a hook with action sae, transcoder or capture"),
    ],
)
def test_refusals_in_one_line_before_any_work(tmp_path, override, message):
    extra = [override]
    if override.startswith("hooks.sae.action"):
        extra = [
            "~hooks.sae",
            "+hooks.s={select: {name: transformer.h.1}, at: output, action: scale}",
        ]
    with pytest.raises(HookrunError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        hookrun.run(["experiment=features", *SMALL, *extra], run_dir=tmp_path / "r")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "r" / "captures.h5").exists()
