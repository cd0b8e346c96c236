"""Feature dashboards against SAEDashboard 0.8.0 (dev-only reference, issue 44): SAEDashboard's
own runner (saedashboard_script.py, in the venv tests/reference_venvs.py builds) on the
shipped tiny_lm SAE over the tiny_lm held-out corpus, packed into rows of 128 tokens as
dataset=text packs it (one eos between documents, no padding, no BOS).

- `test_saedashboard_is_the_brute_force`: what SAEDashboard computes, checked against numpy
  from the SAE's safetensors on HF's residual stream (its conventions, so that hookrun's
  can be matched: every position a candidate, ties unordered, intervals of [0, max] with
  both ends in, the histogram of the firing tokens over [min, max], logit effects through
  ln_final's gain and centring and the unembedding).
- `test_features_equal_saedashboard`: hookrun's `experiment=features` file equals
  SAEDashboard's where its format allows: the top-k (values to 1e-4 relative, the same
  (row, token) sets, hookrun's ties by (row, token)), max, density, the logit effects.
  SAEDashboard's interval samples are random and its histogram spans [min, max] of the
  firing values where hookrun's spans [0, 2^e]: neither is compared.
- `test_the_comparison_catches_a_difference`: the comparison itself, on a file written in
  the features layout from the brute force, passes and fails on one changed value.

TransformerLens's residual is HF's to ~2e-5 (float32, another op order), so a position whose
activation is within that of the k-th one may be swapped in or out: `_same_top` accepts that
and nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_venvs import saedashboard_python  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("saedashboard_script.py")
CHECKPOINTS = ROOT / "hookrun" / "models" / "checkpoints"
TINY_LM, SAE = CHECKPOINTS / "tiny_lm", CHECKPOINTS / "tiny_lm_sae"
MODULE, SITE = "transformer.h.1", "output"
CONTEXT, K, GROUPS, PER_GROUP, LOGITS, BINS = 128, 20, 5, 5, 10, 50
LATENTS = list(range(0, 512, 8))  # 64 latents, in two feature minibatches of 32
REL = 1e-4
NEAR = 1e-4  # activations this close (relative) to the k-th may swap in or out of the top


def packed_rows(context: int = CONTEXT, repeat: int = 1) -> np.ndarray:
    """The held-out corpus (`repeat` times over) as dataset=text pack=true makes it: the
    documents tokenized alone, an eos before every one but the first, cut into full rows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_LM)
    docs = [json.loads(line)["text"] for line in (TINY_LM / "heldout.jsonl").open()] * repeat
    ids: list[int] = []
    for i, doc in enumerate(docs):
        if i:
            ids.append(tokenizer.eos_token_id)
        ids += tokenizer(doc)["input_ids"]
    n = len(ids) // context
    return np.array(ids[: n * context], dtype=np.int64).reshape(n, context)


def run_saedashboard(rows: np.ndarray, tmp: Path, latents, *extra: str) -> dict:
    """SAEDashboard's runner on `rows` for `latents` (its script's JSON)."""
    np.save(tmp / "tokens.npy", rows)
    out = tmp / "saedashboard.json"
    names = "all" if latents == "all" else ",".join(map(str, latents))
    args = [TINY_LM, SAE, tmp / "tokens.npy", out, names]
    done = subprocess.run(
        [str(saedashboard_python()), str(SCRIPT), *map(str, args), *extra],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    return packed_rows()


@pytest.fixture(scope="module")
def dashboard(rows, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("saedashboard")
    flags = ["--minibatch-tokens", "64", "--minibatch-features", "32", "--k", str(K)]
    flags += ["--groups", str(GROUPS), "--per-group", str(PER_GROUP)]
    flags += ["--logits", str(LOGITS), "--bins", str(BINS)]
    return run_saedashboard(rows, tmp, LATENTS, *flags)


@pytest.fixture(scope="module")
def brute(rows) -> dict[str, np.ndarray]:
    """Every latent's activation at every position, and every latent's logit effect, from
    the safetensors alone: HF's block-1 output through SAELens's TopK encode in numpy."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(TINY_LM).eval()
    seen = {}

    def keep(module, inputs, output) -> None:
        seen["x"] = output[0] if isinstance(output, tuple) else output

    handle = hf.transformer.h[1].register_forward_hook(keep)
    try:
        with torch.no_grad():
            hf(input_ids=torch.from_numpy(rows))
    finally:
        handle.remove()
    x = seen["x"].numpy()
    w = load_file(str(SAE / "sae_weights.safetensors"))
    k = json.loads((SAE / "cfg.json").read_text())["k"]
    pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]  # apply_b_dec_to_input
    # TopK: the k largest pre-activations of each token, through a ReLU; the rest 0
    keep_at = np.argpartition(-pre, k - 1, axis=-1)[..., :k]
    acts = np.zeros_like(pre)
    np.put_along_axis(acts, keep_at, np.maximum(np.take_along_axis(pre, keep_at, -1), 0), -1)
    lm = load_file(str(TINY_LM / "model.safetensors"))
    gain = lm[next(n for n in lm if n.endswith("ln_f.weight"))]
    unembed = lm[next(n for n in lm if n.endswith("wte.weight"))]  # tied
    decoder = w["W_dec"] - w["W_dec"].mean(-1, keepdims=True)  # ln_f's centring
    return {"acts": acts, "logits": (decoder * gain) @ unembed.T}


def _top(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest positive entries of a (rows, tokens) array, ties by (row, token):
    their values and (row, token)s."""
    flat = values.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))[:k]
    order = order[flat[order] > 0]
    return flat[order], np.stack(np.unravel_index(order, values.shape), -1)


def _same_top(values, at, truth: np.ndarray, k: int, what: str) -> None:
    """`values` at `at` (row, token) are `truth`'s top k: each value `truth`'s there and the
    sorted values its k largest, to REL; the positions the same set but for swaps among
    activations within NEAR of the k-th."""
    values, at = np.asarray(values, dtype=np.float64), np.asarray(at, dtype=np.int64)
    want, want_at = _top(truth, k)
    assert len(values) == len(want), f"{what}: {len(values)} positive, want {len(want)}"
    if not len(want):
        return
    np.testing.assert_allclose(values, truth[at[:, 0], at[:, 1]], rtol=REL, err_msg=what)
    np.testing.assert_allclose(np.sort(values)[::-1], want, rtol=REL, err_msg=what)
    ours, theirs = set(map(tuple, at.tolist())), set(map(tuple, want_at.tolist()))
    for r, t in ours ^ theirs:
        assert abs(truth[r, t] - want[-1]) <= NEAR * want[-1], f"{what}: ({r}, {t}) differs"


def _positive(entries: list) -> tuple[np.ndarray, np.ndarray]:
    fired = [e for e in entries if e[0] > 0]  # SAEDashboard fills a short top with zeros
    return np.array([e[0] for e in fired]), np.array([e[1:] for e in fired]).reshape(-1, 2)


def test_transformer_lens_reads_hf_residual(dashboard):
    assert dashboard["resid_max_diff"] < 1e-4


def test_saedashboard_is_the_brute_force(dashboard, brute, rows):
    acts, tokens = brute["acts"], rows.size
    assert sorted(map(int, dashboard["features"])) == LATENTS
    fired_somewhere = 0
    for name, got in dashboard["features"].items():
        latent = int(name)
        truth = acts[..., latent]
        what = f"latent {latent}"
        # every position of every row a candidate: position 0 included (buffer=None)
        _same_top(*_positive(got["top"]), truth, K, what)
        # its own (rounded) display of the same positions, 0 at position 0 left out
        for (v, r, t), (shown, r2, t2) in zip(got["top"], got["top_displayed"], strict=True):
            assert (r, t) == (r2, t2) and (shown is None) == (t == 0), what
            assert shown is None or abs(shown - v) <= 5e-5 + 1e-6, what
        fired = truth[truth > 0]
        assert got["density"] == pytest.approx(fired.size / tokens, abs=2 / tokens), what
        if not fired.size:
            continue
        fired_somewhere += 1
        assert got["max"] == pytest.approx(fired.max(), rel=REL), what
        # intervals: [0, max] in equal widths, both ends in (the lowest holds the zeros)
        edges = np.linspace(0, got["max"], GROUPS + 1)
        bounds = zip(edges[:-1], edges[1:], strict=True)
        for group, (lo, hi) in zip(got["intervals"], bounds, strict=True):
            # how many lie inside, give or take the positions within REL of an edge
            least = int(((truth >= lo + REL * hi) & (truth <= hi * (1 - REL))).sum())
            most = int(((truth >= lo - REL * hi) & (truth <= hi * (1 + REL))).sum())
            assert min(PER_GROUP, least) <= len(group) <= min(PER_GROUP, most), what
            for v, r, t in group:
                assert lo - REL * hi <= v <= hi * (1 + REL), what
                assert v == pytest.approx(truth[r, t], rel=REL, abs=1e-6), what
        # the histogram: the firing tokens only, BINS equal bins over their [min, max]
        counts, bin_edges = np.histogram(fired, BINS, range=(fired.min(), fired.max()))
        assert sum(got["histogram_counts"]) == pytest.approx(fired.size, abs=2), what
        assert np.abs(np.array(got["histogram_counts"]) - counts).sum() <= 4, what
        centres = (bin_edges[:-1] + bin_edges[1:]) / 2
        if fired.min() == fired.max():
            # one firing value (a latent firing once): torch.histc's range is that value alone
            # and every centre sits on it, where numpy widens the range by 0.5 each side
            centres = np.full(BINS, fired.max())
        np.testing.assert_allclose(got["histogram_centres"], centres, rtol=1e-3, atol=1e-4)
        # logit effects: the decoder row centred, times ln_f's gain, through the unembedding
        logits = brute["logits"][latent]
        top, bottom = np.argsort(-logits)[:LOGITS], np.argsort(logits)[:LOGITS]
        assert got["logits_top_token"] == top.tolist(), what
        assert got["logits_bottom_token"] == bottom.tolist(), what
        np.testing.assert_allclose(got["logits_top_value"], logits[top], rtol=REL, atol=1e-6)
        np.testing.assert_allclose(got["logits_bottom_value"], logits[bottom], rtol=REL)
    # most latents compared in full (the shipped SAE has 30 of 512 that never fire on
    # the held-out corpus)
    assert fired_somewhere >= 0.8 * len(LATENTS)


def compare_features_file(path: Path, dashboard: dict, rows: np.ndarray) -> None:
    """hookrun's features file (docs: the features layout) equals SAEDashboard's JSON for
    every latent it holds: the top-k values (REL) and (row, token) sets, the token the
    file's context holds at each maximum (the same corpus), max, density and the logit
    effects' token ids (equal) and values (REL)."""
    with h5py.File(path, "r") as f:
        group = f[f"features/{MODULE}/{SITE}"]
        value, row, token = (group[f"top/{n}"][()] for n in ("value", "row", "token"))
        context = group["top/context"][()]
        high, density = group["max"][()], group["density"][()]
        logits = {n: group[f"logits/{n}"][()] for n in group["logits"]}
    before = (context.shape[-1] - 1) - _after(path)
    for name, got in dashboard["features"].items():
        u = int(name)
        what = f"latent {u}"
        kept = row[u] >= 0
        ours_v, ours_at = value[u][kept], np.stack([row[u][kept], token[u][kept]], -1)
        # descending, ties by (row, token)
        order = np.lexsort((ours_at[:, 1], ours_at[:, 0], -ours_v))
        assert (order == np.arange(len(order))).all(), f"{what}: top not in order"
        theirs_v, theirs_at = _positive(got["top"])
        n = min(len(ours_v), len(theirs_v))
        assert len(ours_v) == min(value.shape[1], len(theirs_v)), what
        np.testing.assert_allclose(ours_v[:n], np.sort(theirs_v)[::-1][:n], rtol=REL)
        assert set(map(tuple, ours_at.tolist())) <= set(map(tuple, theirs_at.tolist())) or (
            _swaps_only(ours_v, ours_at, theirs_v, theirs_at)
        ), f"{what}: other positions"
        assert (context[u][kept][:, before] == rows[ours_at[:, 0], ours_at[:, 1]]).all(), what
        assert high[u] == pytest.approx(got["max"], rel=REL), what
        assert density[u] == pytest.approx(got["density"], abs=2 / rows.size), what
        m = min(logits["top_token"].shape[1], LOGITS)
        for side in ("top", "bottom"):
            assert logits[f"{side}_token"][u][:m].tolist() == got[f"logits_{side}_token"][:m]
            np.testing.assert_allclose(
                logits[f"{side}_value"][u][:m], got[f"logits_{side}_value"][:m], rtol=REL
            )


def _after(path: Path) -> int:
    """The features group's window_after, read through hookrun's layout helpers."""
    from hookrun.io import layout

    with h5py.File(path, "r") as f:
        return int(layout.attr(f[f"features/{MODULE}/{SITE}"], "window_after"))


def _swaps_only(ours_v, ours_at, theirs_v, theirs_at) -> bool:
    """The two tops differ only by positions within NEAR of the smaller k-th value."""
    last = min(ours_v[-1], np.sort(theirs_v)[::-1][len(ours_v) - 1])
    ours = dict(zip(map(tuple, ours_at.tolist()), ours_v, strict=True))
    theirs = dict(zip(map(tuple, theirs_at.tolist()), theirs_v, strict=True))
    differ = [ours.get(p, theirs.get(p)) for p in set(ours) ^ set(theirs)]
    return all(abs(v - last) <= NEAR * last for v in differ)


def test_features_equal_saedashboard(dashboard, rows, tmp_path):
    """Fails until experiment=features exists (issue 44): it runs it as a user would."""
    run_dir = tmp_path / "run"
    overrides = [
        "experiment=features",
        f"hooks.sae.args.path={SAE}",
        f"dataset.context={CONTEXT}",
        f"features.k={K}",
        f"features.logits={LOGITS}",
        "render=false",
        "progress=false",
        f"hydra.run.dir={run_dir}",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "hookrun", *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    compare_features_file(run_dir / "captures.h5", dashboard, rows)


def test_the_comparison_catches_a_difference(dashboard, brute, rows, tmp_path):
    """compare_features_file on a file written in the layout from the brute force: it
    passes, and one changed top value, one other position or one logit id fails it."""
    acts, units = brute["acts"], brute["acts"].shape[-1]
    before, after = 16, 8
    value = np.full((units, K), np.nan, np.float32)
    row, token = np.full((units, K), -1), np.full((units, K), -1)
    context = np.full((units, K, before + 1 + after), -1)
    for u in range(units):
        v, at = _top(acts[..., u], K)
        value[u, : len(v)], row[u, : len(v)], token[u, : len(v)] = v, at[:, 0], at[:, 1]
        for j, (r, t) in enumerate(at):
            lo, hi = max(t - before, 0), min(t + after + 1, rows.shape[1])
            context[u, j, lo - t + before : hi - t + before] = rows[r, lo:hi]
    order = np.argsort(-brute["logits"], -1)
    logits = {
        "top_token": order[:, :LOGITS],
        "bottom_token": order[:, ::-1][:, :LOGITS],
    }
    for side in ("top", "bottom"):
        logits[f"{side}_value"] = np.take_along_axis(brute["logits"], logits[f"{side}_token"], -1)
    fired = acts > 0
    path = tmp_path / "captures.h5"

    def write(change=None) -> None:
        from hookrun.io import layout

        with h5py.File(path, "w") as f:
            g = f.create_group(f"features/{MODULE}/{SITE}")
            layout.set_attrs(g, {"window_before": before, "window_after": after})
            data = {
                "top/value": value,
                "top/row": row,
                "top/token": token,
                "top/context": context,
                "max": acts.reshape(-1, units).max(0),
                "density": fired.reshape(-1, units).mean(0),
                **{f"logits/{n}": v for n, v in logits.items()},
            }
            if change:
                data = change(data)
            for name, array in data.items():
                g[name] = array

    write()
    compare_features_file(path, dashboard, rows)
    u = LATENTS[1]

    def bigger(data):
        data["top/value"] = data["top/value"].copy()
        data["top/value"][u, 0] *= 1.01
        return data

    def elsewhere(data):
        data["top/token"] = data["top/token"].copy()
        data["top/token"][u, 0] = (data["top/token"][u, 0] + 1) % CONTEXT
        return data

    def other_token(data):
        data["logits/top_token"] = data["logits/top_token"].copy()
        data["logits/top_token"][u, 0] += 1
        return data

    for change in (bigger, elsewhere, other_token):
        write(change)
        with pytest.raises(AssertionError):
            compare_features_file(path, dashboard, rows)
