"""Steering vectors as data (runtime/vectors.py): `add` with `args.vector` from a tensor file
or from stored runs (the contrastive difference of two prompt sets' mean last-token
activations), and `ablate_direction`. Each is checked against the same arithmetic by hand
with numpy on the activations a plain run captured at the same site."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import run_config

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lm"))
from lm_models import save_lm, write_jsonl  # noqa: E402

from hookrun.errors import HookrunError  # noqa: E402

SITE = "transformer.h.0"
RECORD = f"captures/{SITE}/output"
HAPPY = [{"prompt": "The cat sat on the mat."}, {"prompt": "A quick brown fox jumps"}]
SAD = [{"prompt": "def add(a, b): return a + b"}, {"prompt": "Hooks capture"}]
TARGETS = [{"prompt": "The lazy dog"}, {"prompt": "Hooks capture activations of every block."}]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vectors")
    save_lm(root / "lm", "gpt2")
    for name, rows in (("happy", HAPPY), ("sad", SAD), ("targets", TARGETS)):
        write_jsonl(root / f"{name}.jsonl", rows)
    return root


def _run(lm: Path, out: Path, data: str, *hooks: str) -> Path:
    args = [
        "model=hf",
        f"model.path={lm / 'lm'}",
        "model.class=causal_lm",
        "dataset=prompts",
        f"dataset.path={lm / data}.jsonl",
        "target.kind=predicted",
        "batch_size=2",
        "render=false",
        *hooks,
    ]
    return run_config(out, args).path


def _hook(name: str, action: str, **args) -> list[str]:
    out = [f"++hooks.{name}.select.name={SITE}", f"++hooks.{name}.at=output"]
    out.append(f"++hooks.{name}.action={action}")
    for key, value in args.items():
        out.append(f"++hooks.{name}.args.{key}={_hydra(value)}")
    return out


def _hydra(value: object) -> str:
    """A value as Hydra's override grammar spells it (strings quoted, dicts unquoted keys)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_hydra(v)}" for k, v in value.items()) + "}"
    return f"'{value}'" if isinstance(value, str) and value != "true" else str(value)


def _captured(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(path) as f:
        values = f[RECORD][()].astype(np.float64)
        mask = f["samples/mask"][()] if "samples/mask" in f else np.ones(values.shape[:2], bool)
    return values, mask


def _last_mean(path: Path) -> np.ndarray:
    values, mask = _captured(path)
    return values[np.arange(len(values)), mask.sum(1) - 1].mean(0)


def test_a_contrastive_vector_from_two_stored_runs_is_added_at_every_token(lm, tmp_path):
    capture = _hook("c", "capture")
    happy = _run(lm, tmp_path / "happy", "happy", *capture)
    sad = _run(lm, tmp_path / "sad", "sad", *capture)
    plain, mask = _captured(_run(lm, tmp_path / "plain", "targets", *capture))
    vector = {
        "plus": {"file": str(happy), "record": RECORD, "positions": "last"},
        "minus": {"file": str(sad), "record": RECORD},
    }
    steered_path = _run(
        lm, tmp_path / "steered", "targets", *_hook("s", "add", vector=vector, scale=2.0), *capture
    )
    steered, _ = _captured(steered_path)
    want = plain + 2.0 * (_last_mean(happy) - _last_mean(sad))
    np.testing.assert_allclose(steered[mask], want[mask], atol=1e-5, rtol=0)
    with h5py.File(steered_path) as f:
        read = json.loads(f.attrs["patch_sources"])["hooks.s"]
    assert read["file"] == f"{happy.resolve()}, {sad.resolve()}" and len(read["sha256"]) == 130


@pytest.mark.parametrize("kind", ["npy", "pt", "safetensors"])
def test_a_vector_file_normalized_and_scaled(lm, tmp_path, kind):
    width = 32
    v = np.random.default_rng(0).standard_normal(width).astype(np.float32)
    path = tmp_path / f"v.{kind}"
    spec: object = str(path)
    if kind == "npy":
        np.save(path, v)
    elif kind == "pt":
        torch.save(torch.from_numpy(v)[None], path)  # (1, D) counts as one vector
    else:
        from safetensors.torch import save_file

        save_file({"layer0": torch.from_numpy(v), "other": torch.zeros(3)}, str(path))
        spec = {"file": str(path), "key": "layer0"}
    capture = _hook("c", "capture")
    plain, mask = _captured(_run(lm, tmp_path / "plain", "targets", *capture))
    steer = _hook("s", "add", vector=spec, scale=3.0, normalize="true")
    steered, _ = _captured(_run(lm, tmp_path / "steered", "targets", *steer, *capture))
    unit = v.astype(np.float64) / np.linalg.norm(v.astype(np.float64))
    np.testing.assert_allclose(steered[mask], (plain + 3.0 * unit)[mask], atol=1e-5, rtol=0)


def test_ablate_direction_removes_the_component_along_it(lm, tmp_path):
    d = np.random.default_rng(1).standard_normal(32)
    np.save(tmp_path / "d.npy", d)
    capture = _hook("c", "capture")
    plain, mask = _captured(_run(lm, tmp_path / "plain", "targets", *capture))
    ablate = _hook("a", "ablate_direction", vector=str(tmp_path / "d.npy"))
    after, _ = _captured(_run(lm, tmp_path / "ablated", "targets", *ablate, *capture))
    unit = d / np.linalg.norm(d)
    want = plain - (plain @ unit)[..., None] * unit
    np.testing.assert_allclose(after[mask], want[mask], atol=1e-5, rtol=0)
    assert np.abs(after[mask] @ unit).max() < 1e-5
    assert np.abs(plain[mask] @ unit).max() > 1e-2  # there was a component to remove


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            {"vector": "WIDE"},
            "gives a vector of shape [33]; /captures/transformer.h.0/output has width 32",
        ),
        ({"vector": {"file": "RUN", "record": "samples/tokens"}}, "holds int32 values; valid: a"),
        ({"vector": "nowhere.npy"}, "hooks.s.args.vector.file: 'nowhere.npy' does not exist"),
        ({"vector": "V", "value": 1.0}, "hooks.s.args.value: 1.0 with args.vector; valid: one"),
        ({"scale": 2.0}, "hooks.s.args.scale: applies to args.vector, which is not given"),
        ({"vector": {"plus": "V"}}, "hooks.s.args.vector: ['plus']; valid: exactly plus and minus"),
        ({"vector": "ZERO", "normalize": "true"}, "a zero vector cannot be normalized"),
        (
            {"vector": {"file": "RUN", "record": "captures/nope/output"}},
            "'/captures/nope/output' is not in",
        ),
        ({"vector": {"file": "RUN", "record": RECORD, "positions": "first"}}, "positions: 'first'"),
    ],
)
def test_bad_vectors_are_refused_before_any_work(lm, tmp_path, args, said):
    np.save(tmp_path / "wide.npy", np.ones(33))
    np.save(tmp_path / "v.npy", np.ones(32))
    np.save(tmp_path / "zero.npy", np.zeros(32))
    run = _run(lm, tmp_path / "source", "happy", *_hook("c", "capture"))
    names = {"WIDE": "wide.npy", "V": "v.npy", "ZERO": "zero.npy"}
    text = json.dumps(args)
    for token, name in names.items():
        text = text.replace(f'"{token}"', json.dumps(str(tmp_path / name)))
    text = text.replace('"RUN"', json.dumps(str(run)))
    given = json.loads(text)
    with pytest.raises(HookrunError) as err:
        _run(lm, tmp_path / "refused", "targets", *_hook("s", "add", **given))
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "refused" / "captures.h5").exists()


def test_ablate_direction_needs_a_vector(lm, tmp_path):
    with pytest.raises(HookrunError, match="hooks.a.args.vector: null; valid: the direction"):
        _run(lm, tmp_path / "refused", "targets", *_hook("a", "ablate_direction"))


class Box:
    """A vector pickled as an object: torch.load(weights_only=True) refuses it."""

    def __init__(self, v: torch.Tensor) -> None:
        self.v = v


def test_a_pt_dict_with_integer_keys_and_a_pickle_only_file(lm, tmp_path):
    v = torch.arange(32, dtype=torch.float32)
    torch.save({0: v, 1: -v}, tmp_path / "ints.pt")
    capture = _hook("c", "capture")
    plain, mask = _captured(_run(lm, tmp_path / "plain", "targets", *capture))
    spec = {"file": str(tmp_path / "ints.pt"), "key": "1"}
    steered, _ = _captured(
        _run(lm, tmp_path / "s", "targets", *_hook("s", "add", vector=spec), *capture)
    )
    np.testing.assert_allclose(steered[mask], (plain - v.double().numpy())[mask], atol=1e-5)

    torch.save(Box(v), tmp_path / "pickled.pt")
    with pytest.raises(HookrunError) as err:
        _run(lm, tmp_path / "r", "targets", *_hook("s", "add", vector=str(tmp_path / "pickled.pt")))
    said = str(err.value)
    assert said.startswith(f"hooks.s.args.vector: {tmp_path / 'pickled.pt'} cannot be read (")
    assert "valid: tensors saved with torch.save" in said and "\n" not in said
    assert "\x1b" not in said


def test_a_vector_at_an_image_site_is_refused(tmp_path):
    """A conv site's last axis is the image's width: a vector along it is no feature."""
    np.save(tmp_path / "v.npy", np.ones(8))
    args = [
        "model=resnet18",
        "model.weights=null",
        "dataset=fake",
        "dataset.image_size=32",
        "dataset.size=2",
        "render=false",
        "target.kind=none",
        "++hooks.s.select.name=layer1",
        "++hooks.s.at=output",
        "++hooks.s.action=add",
        f"++hooks.s.args.vector='{tmp_path / 'v.npy'}'",
    ]
    with pytest.raises(HookrunError, match=r"holds \[64, 8, 8\] per sample; valid: a site of"):
        run_config(tmp_path / "run", args)


def test_noise_draws_anew_at_each_decoding_step_and_the_prompts_pass_as_before():
    from hookrun.runtime.hooks import Recorder

    recorder = Recorder(seed=3, store_dtype=torch.float32)
    recorder.begin(8)
    first = torch.randn(4, generator=recorder.generator("n", "k", torch.device("cpu")))
    recorder.step = 2
    later = torch.randn(4, generator=recorder.generator("n", "k", torch.device("cpu")))
    assert not torch.equal(first, later)
    recorder.step = 0  # the prompt's pass: the seed a run without generate draws from
    import zlib

    want = torch.Generator().manual_seed(3 * 1_000_003 + zlib.crc32(b"n|k|8"))
    assert torch.equal(first, torch.randn(4, generator=want))


def _hand_block_outputs(model, ids: list[int], blocks: list[str], added: dict) -> dict:
    """Each block's output over one row alone (no padding), with `added` (block → vector)
    added to the blocks' outputs as a forward hook would."""
    modules = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}

    def hook_for(name):
        def hook(module, args, output):
            first = output[0] if isinstance(output, tuple) else output
            if name in added:
                first = first + torch.as_tensor(added[name], dtype=first.dtype)
            seen[name] = first[0].double()
            return (first, *output[1:]) if isinstance(output, tuple) else first

        return hook

    handles = [modules[b].register_forward_hook(hook_for(b)) for b in blocks]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("positions", ["last", "all"])
def test_a_vector_measured_from_two_prompt_sets_is_each_layers_own(lm, tmp_path, positions):
    """`{plus: {prompts}, minus: {prompts}}` over two blocks: each block gets the difference
    of the two sets' mean output at that block (each prompt read alone by hand, no padding),
    and the steered captures equal a hand forward with both vectors added."""
    from lm_models import tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(lm / "lm", attn_implementation="eager").eval()
    tok = tokenizer()
    blocks = ["transformer.h.0", "transformer.h.1"]

    def mean(rows: list[dict]) -> dict:
        parts: dict[str, list] = {b: [] for b in blocks}
        for row in rows:
            seen = _hand_block_outputs(model, tok(row["prompt"])["input_ids"], blocks, {})
            for b in blocks:
                parts[b].append(seen[b][-1:] if positions == "last" else seen[b])
        return {b: torch.cat(parts[b]).mean(0).numpy() for b in blocks}

    plus, minus = mean(HAPPY), mean(SAD)
    want = {b: 2.0 * (plus[b] - minus[b]) for b in blocks}
    vector = {
        "plus": {"prompts": str(lm / "happy.jsonl"), "positions": positions},
        "minus": {"prompts": str(lm / "sad.jsonl"), "positions": positions},
    }
    steer = [
        "++hooks.s.select.regex='^transformer\\.h\\.[01]$'",
        "++hooks.s.at=output",
        "++hooks.s.action=add",
        f"++hooks.s.args.vector={_hydra(vector)}",
        "++hooks.s.args.scale=2.0",
    ]
    capture = ["++hooks.c.select.name=transformer.h.1", "++hooks.c.at=output"]
    capture.append("++hooks.c.action=capture")
    path = _run(lm, tmp_path / "steered", "targets", *steer, *capture)
    with h5py.File(path) as f:
        got = f["captures/transformer.h.1/output"][()].astype(np.float64)
        mask = f["samples/mask"][()].astype(bool)
        read = json.loads(f.attrs["patch_sources"])["hooks.s"]
    for r, row in enumerate(TARGETS):
        hand = _hand_block_outputs(model, tok(row["prompt"])["input_ids"], blocks, want)
        np.testing.assert_allclose(got[r][mask[r]], hand["transformer.h.1"].numpy(), atol=1e-5)
    assert read["file"] == f"{(lm / 'happy.jsonl').resolve()}, {(lm / 'sad.jsonl').resolve()}"


def test_a_prompts_source_is_refused_where_it_cannot_be_read(lm, tmp_path):
    long = "word " * 80  # past the tests' GPT-2's 64 positions
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": long}) + "\n")
    with pytest.raises(HookrunError) as err:
        _run(
            lm,
            tmp_path / "r",
            "targets",
            *_hook("s", "add", vector={"prompts": str(tmp_path / "long.jsonl")}),
        )
    said = str(err.value)
    assert said.startswith("hooks.s.args.vector.prompts: the prompt at ") and (
        "is longer than the model's 64 positions; valid: prompts of at most 64 tokens" in said
    ), said
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt here"}\n')
    bad = {
        "plus": {"prompts": str(tmp_path / "bad.jsonl")},
        "minus": {"prompts": str(lm / "sad.jsonl")},
    }
    with pytest.raises(HookrunError) as err:
        _run(lm, tmp_path / "r", "targets", *_hook("s", "add", vector=bad))
    said = str(err.value)
    assert said.startswith("hooks.s.args.vector.prompts: ") and "has no 'prompt'" in said, said
    assert not (tmp_path / "r" / "captures.h5").exists()
    with pytest.raises(
        HookrunError, match=r"hooks.s.args.vector.plus.prompts: '.*nope.jsonl' does"
    ):
        _run(
            lm,
            tmp_path / "r",
            "targets",
            *_hook(
                "s",
                "add",
                vector={"plus": {"prompts": "nope.jsonl"}, "minus": {"prompts": "nope.jsonl"}},
            ),
        )
    with pytest.raises(HookrunError, match="hooks.s.args.vector.positions: 'first'"):
        _run(
            lm,
            tmp_path / "r",
            "targets",
            *_hook("s", "add", vector={"prompts": str(lm / "sad.jsonl"), "positions": "first"}),
        )
