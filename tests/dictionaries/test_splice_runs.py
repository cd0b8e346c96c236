"""The splice (`action: sae`) as a user and an adversary run it, end to end: a real process
killed and resumed, two torchrun ranks joined, the dry run, generation with an edit at every
decoding step, metrics=lm, the storage floats, reading the latents back, refusals before any
work, and a caller's model left as it came. Each number is compared with the SAE's formulas
(tests/sae_folders.py) in a forward hook of plain transformers code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import TESTS, hookrun_cli, killed_after, read, run_config, torchrun
from sae_folders import decode, encode, write_sae

import hookrun
from hookrun.errors import HookrunError
from hookrun.io.activations import TokenBatches
from hookrun.io.layout import open_readonly

CHECKPOINTS = Path(__file__).resolve().parents[2] / "hookrun" / "models" / "checkpoints"
CORPUS = CHECKPOINTS / "tiny_lm" / "heldout.jsonl"
PROMPTS = CHECKPOINTS / "patching_prompts.jsonl"
WIDTH, LATENTS = 128, 96
BLOCK = "transformer.h.1"
LATENTS_KEY = f"sae/{BLOCK}/output/latents"


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "tiny_lm").eval()


def _yaml(value) -> str:
    """A value as a Hydra override writes it (flow style, no quotes)."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _hook(name: str, hook: dict) -> list[str]:
    return [f"++hooks.{name}.{key}={_yaml(value)}" for key, value in hook.items()]


def _sae_hook(path: Path, **args) -> dict:
    return {
        "select": {"name": BLOCK},
        "at": "output",
        "action": "sae",
        "args": {"path": path, **args},
    }


def _prompts(*extra: str) -> list[str]:
    """tiny_lm on its patching prompts (6 rows of several lengths, padded)."""
    return [
        "model=tiny_lm",
        "dataset=prompts",
        f"dataset.path={PROMPTS}",
        "limit=6",
        "batch_size=4",
        "target.kind=none",
        "render=false",
        *extra,
    ]


def _text(*extra: str) -> list[str]:
    """tiny_lm on its held-out corpus, one row per document (padded: masks matter)."""
    return [
        "model=tiny_lm",
        "dataset=text",
        f"dataset.path={CORPUS}",
        "dataset.pack=false",
        "dataset.context=24",
        "target.kind=none",
        "render=false",
        "progress=false",
        *extra,
    ]


def _tokens(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    with h5py.File(path) as f:
        tokens = torch.as_tensor(f["samples/tokens"][()]).long()
        mask = f["samples/mask"][()] if "samples/mask" in f else np.ones(tokens.shape, bool)
    return tokens, torch.as_tensor(mask).bool()


def _block_output(model, tokens: torch.Tensor, mask: torch.Tensor, change=None):
    """The plain model on `tokens`: BLOCK's output (before `change`) and the logits."""
    seen = {}

    def hook(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        seen["out"] = first
        if change is not None:
            first = change(first)
        return (first, *output[1:]) if isinstance(output, tuple) else first

    handle = dict(model.named_modules())[BLOCK].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(input_ids=tokens, attention_mask=mask.long()).logits
    finally:
        handle.remove()
    return seen["out"], logits


# --- 3. the dry run ---------------------------------------------------------------------


def test_the_dry_run_prints_the_splices_records_and_writes_nothing(tmp_path):
    write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=1)
    hook = _sae_hook(tmp_path / "sae", record=["latents", "reconstruction", "error"])
    run_dir = tmp_path / "run"
    done = hookrun_cli(
        [*_prompts("dry_run=true"), *_hook("sae", hook), f"hydra.run.dir={run_dir}"], tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    for name, width in (("latents", LATENTS), ("reconstruction", WIDTH), ("error", WIDTH)):
        line = next(x for x in said.splitlines() if x.rstrip().endswith(f"/output/{name}"))
        assert f"/sae/{BLOCK}/output/{name}" in line
        assert f", {width}]" in line, line  # (tokens, width) per sample
    latents = next(x for x in said.splitlines() if x.rstrip().endswith("/output/latents"))
    # sized by the probe sample's non-zeros (test_splice.py checks the figure), not d_sae
    assert "(sparse)/sample" in latents, latents
    assert "Stored per sample" in said and "estimated file size" in said
    assert not list(tmp_path.rglob("captures.h5"))


# --- 8. bad input: one line, before any work --------------------------------------------


def _refused(tmp_path: Path, hooks: dict, *extra: str) -> str:
    overrides = _prompts(f"hydra.run.dir={tmp_path / 'run'}", *extra)
    for name, hook in hooks.items():
        overrides += _hook(name, hook)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", overrides)
    message = str(err.value)
    assert "\n" not in message, message
    assert not (tmp_path / "run" / "captures.h5").exists()  # before any work
    return message


def test_bad_input_is_refused_in_one_line_naming_key_value_and_choices(tmp_path):
    sae = tmp_path / "sae"
    write_sae(sae, WIDTH, LATENTS, seed=1)
    write_sae(tmp_path / "narrow", 64, LATENTS)
    write_sae(tmp_path / "named", WIDTH, LATENTS, hook_name="blocks.1.hook_resid_post")
    cases = [
        ({"bad": _sae_hook(tmp_path / "nowhere")}, ["hooks.bad.args.path", "nowhere"]),
        (
            {"bad": _sae_hook(sae, record=["latents", "codes"])},
            ["hooks.bad.args.record", "codes", "latents", "reconstruction", "error"],
        ),
        ({"bad": _sae_hook(tmp_path / "narrow")}, ["hooks.bad.args.path", "d_in 64", "width 128"]),
        (
            {"bad": {**_sae_hook(sae), "at": "grad_output"}},
            ["hooks.bad.at", "grad_output", "input", "output"],
            "target.kind=predicted",  # a gradient site needs a target: past that refusal
        ),
        (
            {"bad": {**_sae_hook(sae), "select": {"function": "gelu"}}},
            ["hooks.bad.select", "function", "name, regex or type"],
        ),
        (
            {"bad": {"at": "input", "action": "sae", "args": {"path": tmp_path / "named"}}},
            ["hooks.bad.at", "'input'", "valid: output"],
        ),
        (
            {"one": _sae_hook(sae), "two": _sae_hook(sae)},
            ["hooks.two", "latents", BLOCK],
        ),
        (
            {"bad": _sae_hook(sae, record=["latents", "latents"])},
            ["hooks.bad.args.record", "latents", "once"],
        ),
        (
            {"bad": _sae_hook(sae, dtype="float64")},
            ["hooks.bad.args.dtype", "float64", "float32"],
        ),
        (
            {"bad": _sae_hook(sae, edit={"latents": [1], "op": "set", "value": "nan"})},
            ["hooks.bad.args.edit.value", "nan", "finite"],
        ),
        (
            {"bad": _sae_hook(sae, edit={"latents": [1], "op": "zero"}, positions=[0, 500])},
            ["hooks.bad.args.positions", "500"],
        ),
    ]
    failures = []
    for hooks, words, *extra in cases:
        said = _refused(tmp_path, hooks, *extra)
        missing = [w for w in words if w not in said]
        if missing:
            failures.append((said, missing))
    assert not failures, "\n".join(f"{said!r} lacks {missing}" for said, missing in failures)


# --- 6. storage floats ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "args", "stored"),
    [
        (["sink.dtype=bfloat16"], {}, torch.bfloat16),
        (["sink.dtype=float16"], {}, torch.float16),
        (["sink.dtype=float16"], {"dtype": "float32"}, torch.float32),
    ],
)
def test_latents_are_stored_in_the_sinks_float_or_args_dtype(tiny, tmp_path, extra, args, stored):
    """The formula's latents rounded once to the float the file keeps them in."""
    sae = write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=7)
    hook = _sae_hook(tmp_path / "sae", record=["latents"], **args)
    run_dir = tmp_path / "run"
    path = run_config(run_dir, [*_prompts(*extra), *_hook("sae", hook)]).path
    tokens, mask = _tokens(path)
    x, _ = _block_output(tiny, tokens, mask)
    want = encode(sae, x).to(stored).float()[mask].numpy()
    with hookrun.open(path) as f:
        got = f[LATENTS_KEY][0:6]
    with h5py.File(path) as f:
        values = f[LATENTS_KEY]["values"]
        width = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}[stored]
        assert values.dtype.itemsize == width, values.dtype
    assert got.dtype == np.float32
    # Rounded to the storage float: equal to a rounding's step, not to float32's.
    step = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-6}[stored]
    np.testing.assert_allclose(got[mask.numpy()], want, atol=2e-5, rtol=step)
    assert (want > 0).mean() > 0.05


# --- 7. reading the latents back ----------------------------------------------------------


def test_latents_read_back_as_slices_scipy_and_token_batches(tiny, tmp_path):
    sae = write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=8)
    hook = _sae_hook(tmp_path / "sae", record=["latents"])
    path = run_config(tmp_path / "run", [*_prompts(), *_hook("sae", hook)]).path
    tokens, mask = _tokens(path)
    x, _ = _block_output(tiny, tokens, mask)
    dense = encode(sae, x).numpy()
    real = mask.numpy()
    with hookrun.open(path) as f:
        record = f[LATENTS_KEY]
        assert record.shape == (6, tokens.shape[1], LATENTS)
        whole = record[:]
        # Every position is recorded, as a dense capture records it; the promise is the
        # formula's at the real tokens.
        np.testing.assert_allclose(whole[real], dense[real], atol=2e-5)
        assert (whole[real] > 0).mean() > 0.05
        np.testing.assert_array_equal(record[4], whole[4])
        np.testing.assert_array_equal(record[-1], whole[5])
        np.testing.assert_array_equal(record[[5, 1, 5]], whole[[5, 1, 5]])
        np.testing.assert_array_equal(record[2:4, 0], whole[2:4, 0])
        np.testing.assert_array_equal(record[1:6:2, :, 7], whole[1:6:2, :, 7])
        matrix = record.to_scipy([3, 0])
        assert matrix.shape == (2 * tokens.shape[1], LATENTS)
        picked = real[[3, 0]].reshape(-1)
        np.testing.assert_allclose(
            matrix.toarray()[picked], dense[[3, 0]].reshape(-1, LATENTS)[picked], atol=2e-5
        )
        assert matrix.nnz == np.count_nonzero(whole[[3, 0]])  # only the non-zeros stored
    batches = TokenBatches(path, LATENTS_KEY, batch_size=5, shuffle=False)
    got = torch.cat(list(batches)).numpy()
    np.testing.assert_allclose(got, dense[real], atol=2e-5)  # the real tokens, in order
    shuffled = torch.cat(list(TokenBatches(path, LATENTS_KEY, batch_size=5, seed=3))).numpy()
    assert shuffled.shape == got.shape and not np.array_equal(shuffled, got)
    np.testing.assert_array_equal(shuffled[np.lexsort(shuffled.T)], got[np.lexsort(got.T)])


# --- 5. metrics=lm --------------------------------------------------------------------


def test_metrics_unhooked_are_the_plain_models_and_hooked_the_spliced(tiny, tmp_path):
    """No error term: the site is the reconstruction, and the metrics say so against a hand
    forward of each."""
    sae = write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=9)
    hook = _sae_hook(tmp_path / "sae", error_term=False, record=[])
    args = [*_text("limit=5", "batch_size=2", "metrics=lm"), *_hook("sae", hook)]
    args[args.index("target.kind=none")] = "target.kind=next_token"
    path = run_config(tmp_path / "run", args).path
    tokens, mask = _tokens(path)
    with h5py.File(path) as f:
        metrics = {k: f[f"metrics/{k}"][()] for k in f["metrics"]}
    _, plain = _block_output(tiny, tokens, mask)
    _, spliced = _block_output(tiny, tokens, mask, lambda out: decode(sae, encode(sae, out)))

    def loss(logits):  # mean next-token loss over each row's real tokens
        logp = logits[:, :-1].log_softmax(-1)
        nll = -logp.gather(-1, tokens[:, 1:, None])[..., 0]
        real = (mask[:, 1:] & mask[:, :-1]).float()
        return ((nll * real).sum(1) / real.sum(1)).numpy()

    np.testing.assert_allclose(metrics["loss_unhooked"], loss(plain), atol=1e-4)
    np.testing.assert_allclose(metrics["loss"], loss(spliced), atol=1e-4)
    assert np.abs(metrics["loss"] - metrics["loss_unhooked"]).min() > 1e-3
    assert metrics["kl"].min() > 0  # the splice moved every row's distribution


# --- 9. the caller's model ------------------------------------------------------------------


def _state(model):
    return {
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {
            n: (
                list(m._forward_hooks),
                list(m._forward_pre_hooks),
                list(m._backward_hooks),
                list(getattr(m, "_backward_pre_hooks", {})),
            )
            for n, m in model.named_modules()
        },
    }


def _same(before, after) -> None:
    assert after["grad"] == before["grad"]
    assert after["training"] == before["training"]
    assert after["hooks"] == before["hooks"]
    assert after["weights"].keys() == before["weights"].keys()
    for k, v in before["weights"].items():
        assert torch.equal(after["weights"][k], v), k


def test_a_callers_model_leaves_a_splice_run_as_it_came_also_when_it_fails(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=10)
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "tiny_lm")
    tok = AutoTokenizer.from_pretrained(CHECKPOINTS / "tiny_lm")
    # A caller's mixed state: some weights frozen, one block in train mode, a hook of its own.
    model.eval()
    model.transformer.h[1].train()
    for p in model.transformer.h[0].parameters():
        p.requires_grad_(False)
    calls = []
    model.transformer.h[1].register_forward_hook(lambda m, a, o: calls.append(1))
    counted = []  # the final norm's calls in a whole run: the probes' passes, then a batch's
    counting = model.transformer.ln_f.register_forward_hook(lambda m, a, o: counted.append(1))
    edit = {"latents": [3], "op": "set", "value": 4.0}
    hook = _sae_hook(tmp_path / "sae", record=["latents", "error"], edit=edit)
    overrides = [*_prompts(), *_hook("sae", hook)][1:]  # the caller's model, not model=
    before = _state(model)
    ok = hookrun.run(overrides, model=model, tokenizer=tok, run_dir=tmp_path / "ok")
    assert calls  # the caller's own hook ran and is still there
    _same(before, _state(model))
    counting.remove()
    batches = -(-ok.rows // 4)  # batches of 4 rows (_prompts)
    probes = len(counted) - batches  # passes before the first batch (the probes')

    failing = []

    def fail(module, args, output):
        failing.append(1)
        if len(failing) == probes + 2:  # past the probes and the first batch: mid-run
            raise RuntimeError("the caller's hook fails mid-run")

    model.transformer.ln_f.register_forward_hook(fail)
    before = _state(model)
    with pytest.raises(RuntimeError, match="mid-run"):
        hookrun.run(overrides, model=model, tokenizer=tok, run_dir=tmp_path / "failed")
    with h5py.File(tmp_path / "failed" / "captures.h5") as f:  # it failed mid-run
        assert f.attrs["status"] != "complete" and f.attrs["completed"] == 4
    _same(before, _state(model))


# --- 1. kill -9 and resume ----------------------------------------------------------------


def test_killed_and_resumed_gives_the_uninterrupted_files_bytes_and_verifies(tmp_path):
    """A real process SIGKILLed mid-run, resumed twice: every dataset, the latents' counts,
    values and latent indices included, byte-equal to the uninterrupted run's."""
    write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=11)
    hook = _sae_hook(tmp_path / "sae", record=["latents", "error"])
    args = [*_text("limit=60", "batch_size=2", "sink.dtype=float16"), *_hook("sae", hook)]
    whole = read(run_config(tmp_path / "whole", args).path)
    assert {f"{LATENTS_KEY}/{part}" for part in ("counts", "values", "latent")} <= whole.keys()
    run_dir = tmp_path / "killed"
    killed_after(args, tmp_path, run_dir, rows=6)
    with open_readonly(run_dir / "captures.h5") as f:  # killed before its end: a resume's work
        assert f.attrs["status"] != "complete" and f.attrs["completed"] < 60
    # Another dictionary in the same folder: the resume refuses to mix the two in one file.
    write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=99)
    done = hookrun_cli([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode != 0 and "resume refused" in done.stderr, done.stderr[-2000:]
    assert "sae_weights.safetensors" in done.stderr
    write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=11)  # the same bytes again
    for _ in range(2):  # the second resume of the complete file changes nothing
        done = hookrun_cli([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        got = read(run_dir / "captures.h5")
        assert got.keys() == whole.keys()
        for key in whole:
            assert got[key].tobytes() == whole[key].tobytes(), key
    verify = subprocess.run(
        [sys.executable, "-m", "hookrun.verify", str(run_dir / "captures.h5")],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "intact" in verify.stdout, verify.stdout


def test_entries_written_past_completed_are_dropped_by_the_resume(tmp_path):
    """The crash window of an append, made by hand: counts of rows past `completed` and
    values and latent indices past their entries (a kill after the data, before the marker).
    The resume rewrites those rows from the entries of the complete rows on."""
    write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=14)
    args = [*_text("limit=10", "batch_size=2"), *_hook("sae", _sae_hook(tmp_path / "sae"))]
    whole = read(run_config(tmp_path / "whole", args).path)
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)
    with h5py.File(cut / "captures.h5", "r+") as f:
        group = f[LATENTS_KEY]
        kept = int(group["counts"][:4].sum())
        for part in ("values", "latent"):  # 7 entries of garbage after row 3's last
            group[part].resize(kept + 7, axis=0)
            group[part][kept:] = 3
        f.attrs["completed"], f.attrs["status"] = 4, "running"
    done = hookrun_cli([*args, f"hydra.run.dir={cut}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    got = read(cut / "captures.h5")
    assert got.keys() == whole.keys()
    for key in whole:
        assert got[key].tobytes() == whole[key].tobytes(), key


# --- 2. the torchrun join -------------------------------------------------------------------


def test_two_torchrun_ranks_join_to_the_single_processs_latents(tmp_path):
    write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=12)
    hook = _sae_hook(tmp_path / "sae", record=["latents"])
    args = [*_text("limit=9", "batch_size=2"), *_hook("sae", hook)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun process: the same bits
    try:
        single = read(run_config(tmp_path / "single", args).path)
    finally:
        torch.set_num_threads(threads)
    run_dir = tmp_path / "joined"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS), env.get("PYTHONPATH", "")] if p)
    done = torchrun([*args, f"hydra.run.dir={run_dir}"], tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    joined = read(run_dir / "captures.h5")
    parts = [f"{LATENTS_KEY}/{part}" for part in ("counts", "values", "latent")]
    assert set(parts) <= joined.keys()
    for key in [*parts, "samples/tokens", "model/output"]:
        assert joined[key].tobytes() == single[key].tobytes(), key
    with (
        hookrun.open(run_dir / "captures.h5") as f,
        hookrun.open(tmp_path / "single" / "captures.h5") as g,
    ):
        np.testing.assert_array_equal(f[LATENTS_KEY][:], g[LATENTS_KEY][:])


# --- 4. generation ----------------------------------------------------------------------------


STEPS = 6


def _greedy(model, ids: list[int], change=None) -> list[int]:
    """Greedy decoding of one row by hand with the key-value cache, `change` at BLOCK's
    output in every pass (the prompt's and each step's one token)."""
    handle = None
    if change is not None:

        def hook(module, args, output):
            first = output[0] if isinstance(output, tuple) else output
            first = change(first)
            return (first, *output[1:]) if isinstance(output, tuple) else first

        handle = dict(model.named_modules())[BLOCK].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
            tokens = []
            for _ in range(STEPS):
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
    finally:
        if handle is not None:
            handle.remove()
    return tokens


def _generate(tmp_path: Path, name: str, hook: dict) -> np.ndarray:
    args = [
        "experiment=generate",
        "limit=4",
        "batch_size=4",
        f"generate.max_new_tokens={STEPS}",
        "generate.stop_at_eos=false",
        "render=false",
        *_hook("sae", hook),
    ]
    with h5py.File(run_config(tmp_path / name, args).path) as f:
        return f["generation/tokens"][()]


def test_generation_edits_at_every_decoding_step_and_an_unedited_splice_changes_nothing(
    tiny, tmp_path
):
    from transformers import AutoTokenizer

    sae = write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=13)
    tok = AutoTokenizer.from_pretrained(CHECKPOINTS / "tiny_lm")
    rows = [json.loads(line) for line in (CHECKPOINTS / "lens_prompts.jsonl").open()][:4]
    prompts = [tok(r["prompt"])["input_ids"] for r in rows]
    chosen = list(range(12))
    edit = {"latents": chosen, "op": "set", "value": 6.0}
    steered = _generate(tmp_path, "steered", _sae_hook(tmp_path / "sae", edit=edit))
    kept = _generate(tmp_path, "kept", _sae_hook(tmp_path / "sae", record=["latents"]))

    def spliced(out):
        z = encode(sae, out)
        edited = z.clone()
        edited[..., chosen] = 6.0
        return decode(sae, edited) + (out - decode(sae, z))

    plain = [_greedy(tiny, ids) for ids in prompts]
    hand = [_greedy(tiny, ids, spliced) for ids in prompts]
    assert steered.tolist() == hand
    assert hand != plain  # the edit changed what was generated
    assert kept.tolist() == plain  # with the error term and no edit: the model's own
