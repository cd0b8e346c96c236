"""`action: sae` and `action: transcoder` on the shipped tiny_lm (GPT-2, width 128), each run
compared with a hand splice: the SAE's formulas (tests/sae_folders.py) in a
forward hook of plain transformers code on the tokens the run stored.

- with the error term and no edit the model's outputs are the unspliced model's (to float
  rounding), and the stored latents, reconstruction and error are the formulas';
- without it the site is the reconstruction; an edit changes the latents before decoding,
  with the error term held fixed;
- a transcoder reads the MLP's input and writes in place of its output;
- gradients flow through the splice (the error term held fixed, as SAELens's use_error_term);
- dictionaries with hook names place themselves; a latent's decoder row steers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_config
from sae_folders import decode, encode, write_sae

import hookrun
from hookrun.errors import HookrunError

CHECKPOINTS = Path(__file__).resolve().parents[2] / "hookrun" / "models" / "checkpoints"
WIDTH, LATENTS = 128, 96
BLOCK = "transformer.h.1"


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "tiny_lm").eval()


def _run(tmp_path: Path, name: str, hook: dict, *extra: str) -> Path:
    """A run of tiny_lm on its patching prompts with one hook `name` given as a mapping."""
    overrides = [
        "model=tiny_lm",
        "dataset=prompts",
        f"dataset.path={CHECKPOINTS / 'patching_prompts.jsonl'}",
        "limit=6",
        "batch_size=4",
        "target.kind=none",
        "render=false",
        f"hydra.run.dir={tmp_path / 'run'}",
        *extra,
    ]
    for key, value in hook.items():
        overrides.append(f"++hooks.{name}.{key}={_yaml(value)}")
    run_config(tmp_path / "run", overrides)
    return tmp_path / "run" / "captures.h5"


def _yaml(value) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _hand(model, path: Path, layer: str, change=None, grad: bool = False):
    """The plain model on the run's tokens, `change(output, input)` at `layer`'s output: the
    logits at each row's last real token, and what `layer` gave and read."""
    with hookrun.open(path) as f:
        tokens = torch.as_tensor(f["samples/tokens"][:]).long()
        mask = torch.as_tensor(f["samples/mask"][:]) if "samples/mask" in f else None
    mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.bool()
    seen = {}

    def hook(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        seen["in"], seen["out"] = args[0], first
        if change is not None:
            first = change(first, args[0])
        seen["changed"] = first
        return (first, *output[1:]) if isinstance(output, tuple) else first

    handle = dict(model.named_modules())[layer].register_forward_hook(hook)
    try:
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=tokens, attention_mask=mask.long()).logits
    finally:
        handle.remove()
    last = mask.sum(1) - 1
    return logits[torch.arange(len(tokens)), last], seen, mask


def test_with_the_error_term_the_outputs_stay_and_the_records_are_the_formulas(tiny, tmp_path):
    sae = write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=1)
    hook = {
        "select": {"name": BLOCK},
        "at": "output",
        "action": "sae",
        "args": {"path": tmp_path / "sae", "record": ["latents", "reconstruction", "error"]},
    }
    path = _run(tmp_path, "sae", hook)
    logits, seen, mask = _hand(tiny, path, BLOCK)
    x = seen["out"]
    z = encode(sae, x)
    with hookrun.open(path) as f:
        stored = f[f"sae/{BLOCK}/output/latents"][:]
        rebuilt = f[f"sae/{BLOCK}/output/reconstruction"][:]
        error = f[f"sae/{BLOCK}/output/error"][:]
        output = f["model/output"][:]
    real = mask.numpy()
    assert stored.shape == (6, x.shape[1], LATENTS)
    np.testing.assert_allclose(stored[real], z[mask].numpy(), atol=2e-5)
    assert (stored[real] > 0).mean() > 0.05  # latents fire: the comparison is not of zeros
    np.testing.assert_allclose(rebuilt[real], decode(sae, z)[mask].numpy(), atol=2e-5)
    np.testing.assert_allclose(error[real], (x - decode(sae, z))[mask].numpy(), atol=2e-5)
    np.testing.assert_allclose(output, logits.numpy(), atol=2e-4)  # the model unchanged


def test_without_the_error_term_the_site_is_the_reconstruction(tiny, tmp_path):
    sae = write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=2)
    hook = {
        "select": {"name": BLOCK},
        "at": "output",
        "action": "sae",
        "args": {"path": tmp_path / "sae", "error_term": False, "record": []},
    }
    path = _run(tmp_path, "sae", hook)
    logits, _, _ = _hand(tiny, path, BLOCK, lambda out, _: decode(sae, encode(sae, out)))
    plain, _, _ = _hand(tiny, path, BLOCK)
    with hookrun.open(path) as f:
        output = f["model/output"][:]
        stored = f.keys()
        assert not [k for k in stored if k.startswith("sae/")]  # record: [] stores nothing
    np.testing.assert_allclose(output, logits.numpy(), atol=2e-4)
    assert np.abs(output - plain.numpy()).max() > 1e-2  # the splice changed the model


@pytest.mark.parametrize(
    ("op", "value"), [("zero", None), ("scale", 3.0), ("clamp", 0.05), ("set", 2.5)]
)
def test_an_edit_changes_the_latents_before_decoding(tiny, tmp_path, op, value):
    sae = write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=3)
    chosen = [0, 7, 40]
    edit = {"latents": chosen, "op": op, **({"value": value} if value is not None else {})}
    hook = {
        "select": {"name": BLOCK},
        "at": "output",
        "action": "sae",
        "args": {"path": tmp_path / "sae", "edit": edit},
    }

    def spliced(out, _):
        z = encode(sae, out)
        edited = z.clone()
        part = z[..., chosen]
        edited[..., chosen] = {
            "zero": lambda: torch.zeros_like(part),
            "scale": lambda: part * 3.0,
            "clamp": lambda: part.clamp(max=0.05),
            "set": lambda: torch.full_like(part, 2.5),
        }[op]()
        return decode(sae, edited) + (out - decode(sae, z))

    path = _run(tmp_path, "sae", hook)
    logits, seen, mask = _hand(tiny, path, BLOCK, spliced)
    plain, _, _ = _hand(tiny, path, BLOCK)
    with hookrun.open(path) as f:
        output = f["model/output"][:]
        stored = f[f"sae/{BLOCK}/output/latents"][:]
    np.testing.assert_allclose(output, logits.numpy(), atol=2e-4)
    assert np.abs(output - plain.numpy()).max() > 1e-3  # the edit moved the logits
    # The latents stored are the dictionary's own, before the edit.
    real = mask.numpy()
    np.testing.assert_allclose(stored[real], encode(sae, seen["out"])[mask].numpy(), atol=2e-5)


def test_a_transcoder_reads_the_mlps_input_and_writes_its_output(tiny, tmp_path):
    mlp = "transformer.h.0.mlp"
    sae = write_sae(tmp_path / "tc", WIDTH, LATENTS, seed=4, transcoder=True)
    hook = {
        "select": {"name": mlp},
        "at": "output",
        "action": "transcoder",
        "args": {"path": tmp_path / "tc", "error_term": False, "record": ["latents"]},
    }
    path = _run(tmp_path, "tc", hook)

    def replaced(out, given):
        return decode(sae, encode(sae, given, transcoder=True))

    logits, seen, mask = _hand(tiny, path, mlp, replaced)
    with hookrun.open(path) as f:
        output = f["model/output"][:]
        stored = f[f"sae/{mlp}/output/latents"][:]
    np.testing.assert_allclose(output, logits.numpy(), atol=2e-4)
    want = encode(sae, seen["in"], transcoder=True)[mask].numpy()
    np.testing.assert_allclose(stored[mask.numpy()], want, atol=2e-5)


def test_gradients_flow_through_the_splice_with_the_error_held_fixed(tiny, tmp_path):
    """The gradient of the last token's top logit at the block before the splice: through
    the SAE's encoder and decoder, the error term a constant."""
    sae = write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=5)
    before = "transformer.h.0"
    hook = {
        "select": {"name": BLOCK},
        "at": "output",
        "action": "sae",
        "args": {"path": tmp_path / "sae", "record": []},
    }
    grad = [
        f"++hooks.g.select.name={before}",
        "++hooks.g.at=grad_output",
        "++hooks.g.action=capture",
        "target.kind=predicted",
    ]
    path = _run(tmp_path, "sae", hook, *grad)
    with hookrun.open(path) as f:
        stored = f[f"captures/{before}/grad_output"][:]
        tokens = torch.as_tensor(f["samples/tokens"][:]).long()
        targets = torch.as_tensor(f["samples/target"][:]).long()
        mask = torch.as_tensor(f["samples/mask"][:]).bool() if "samples/mask" in f else None
    mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask
    modules = dict(tiny.named_modules())
    kept = {}

    def keep(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        first.retain_grad()
        kept["x"] = first

    def splice(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        rebuilt = decode(sae, encode(sae, first))
        first = rebuilt + (first - rebuilt).detach()
        return (first, *output[1:]) if isinstance(output, tuple) else first

    handles = [
        modules["transformer.wte"].register_forward_hook(_leaf),
        modules[before].register_forward_hook(keep),
        modules[BLOCK].register_forward_hook(splice),
    ]
    try:
        logits = tiny(input_ids=tokens, attention_mask=mask.long()).logits
        last = mask.sum(1) - 1
        logits[torch.arange(len(tokens)), last, targets].sum().backward()
    finally:
        for h in handles:
            h.remove()
    hand = kept["x"].grad
    real = mask.numpy()
    np.testing.assert_allclose(stored[real], hand[mask].numpy(), atol=1e-5)
    # Not the unspliced gradient: the SAE is in the path.
    plain = _plain_gradient(tiny, tokens, mask, targets, before)
    assert np.abs(stored[real] - plain[mask].numpy()).max() > 1e-4


def _leaf(module, args, output):
    """The embeddings as the graph's start (hookrun's too: parameters are frozen)."""
    return output.detach().requires_grad_(True)


def _plain_gradient(model, tokens, mask, targets, layer):
    kept = {}

    def keep(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        first.retain_grad()
        kept["x"] = first

    modules = dict(model.named_modules())
    handles = [
        modules["transformer.wte"].register_forward_hook(_leaf),
        modules[layer].register_forward_hook(keep),
    ]
    try:
        logits = model(input_ids=tokens, attention_mask=mask.long()).logits
        last = mask.sum(1) - 1
        logits[torch.arange(len(tokens)), last, targets].sum().backward()
    finally:
        for h in handles:
            h.remove()
    return kept["x"].grad


def test_dictionaries_with_hook_names_place_themselves(tiny, tmp_path):
    """A folder of two SAEs, one per block output (TransformerLens names), and no select."""
    folder = tmp_path / "saes"
    saes = {
        layer: write_sae(
            folder / f"blocks.{layer}",
            WIDTH,
            LATENTS,
            10 + layer,
            hook_name=f"blocks.{layer}.hook_resid_post",
        )
        for layer in (0, 1)
    }
    hook = {"at": "output", "action": "sae", "args": {"path": folder}}
    path = _run(tmp_path, "saes", hook)
    for layer, sae in saes.items():
        _, seen, mask = _hand(tiny, path, f"transformer.h.{layer}")
        with hookrun.open(path) as f:
            stored = f[f"sae/transformer.h.{layer}/output/latents"][:]
        want = encode(sae, seen["out"])[mask].numpy()
        np.testing.assert_allclose(stored[mask.numpy()], want, atol=2e-5)


def test_a_latents_decoder_row_steers(tiny, tmp_path):
    sae = write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=6)
    hook = {
        "select": {"name": BLOCK},
        "at": "output",
        "action": "add",
        "args": {"vector": {"sae": tmp_path / "sae", "latent": 9}, "scale": 4.0},
    }
    path = _run(tmp_path, "steer", hook)
    logits, _, _ = _hand(tiny, path, BLOCK, lambda out, _: out + 4.0 * sae["W_dec"][9])
    with hookrun.open(path) as f:
        np.testing.assert_allclose(f["model/output"][:], logits.numpy(), atol=2e-4)


def _refusal(tmp_path: Path, hook: dict) -> str:
    with pytest.raises(HookrunError) as err:
        _run(tmp_path, "bad", hook)
    message = str(err.value)
    assert "\n" not in message
    assert not (tmp_path / "run" / "captures.h5").exists()  # before any work
    return message


def test_refusals_before_any_work(tmp_path):
    write_sae(tmp_path / "narrow", 64, LATENTS)
    write_sae(tmp_path / "sae", WIDTH, LATENTS, hook_name="blocks.9.hook_resid_post")
    write_sae(tmp_path / "tc", WIDTH, LATENTS, transcoder=True)
    at_block = {"select": {"name": BLOCK}, "at": "output"}
    said = _refusal(tmp_path, {**at_block, "action": "sae", "args": {"path": tmp_path / "narrow"}})
    assert "hooks.bad.args.path" in said and "d_in 64" in said and "width 128" in said
    edit = {"latents": [LATENTS], "op": "zero"}
    said = _refusal(
        tmp_path, {**at_block, "action": "sae", "args": {"path": tmp_path / "sae", "edit": edit}}
    )
    assert f"hooks.bad.args.edit.latents: {LATENTS}" in said and f"0..{LATENTS - 1}" in said
    said = _refusal(tmp_path, {"at": "output", "action": "sae", "args": {"path": tmp_path / "sae"}})
    assert "blocks.9.hook_resid_post" in said
    said = _refusal(
        tmp_path, {**at_block, "action": "transcoder", "args": {"path": tmp_path / "tc"}}
    )
    assert "hooks.bad" in said and "MLP" in said
    said = _refusal(tmp_path, {**at_block, "action": "sae", "args": {"path": tmp_path / "tc"}})
    assert "hooks.bad.action: sae" in said and "valid: action transcoder" in said
    bad_edit = {"latents": [1], "op": "double"}
    said = _refusal(
        tmp_path,
        {**at_block, "action": "sae", "args": {"path": tmp_path / "sae", "edit": bad_edit}},
    )
    assert "hooks.bad.args.edit.op: 'double'" in said and "zero, scale, clamp, set" in said
    said = _refusal(
        tmp_path,
        {**at_block, "action": "sae", "args": {"path": tmp_path / "sae", "record": ["latent"]}},
    )
    assert "hooks.bad.args.record" in said and "latents" in said


def test_the_dry_run_sizes_the_latents_by_the_probes_l0(tiny, tmp_path):
    """The dry run's bytes of a sparse record: the non-zeros the SAE gives on sample 0 (a
    value and an int32 index each) and an int32 count per token, not d_sae floats."""
    from hookrun.memory import format_bytes

    sae = write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=8)
    hook = {
        "select": {"name": BLOCK},
        "at": "output",
        "action": "sae",
        "args": {"path": tmp_path / "sae"},
    }
    path = _run(tmp_path / "full", "sae", hook)
    _, seen, _ = _hand(tiny, path, BLOCK)
    x = seen["out"][0]  # sample 0, every position of its row (the file stores them all)
    nonzeros = int((encode(sae, x) != 0).sum())
    want = format_bytes(nonzeros * (4 + 4) + 4 * x.shape[0])
    result = hookrun.run(
        [
            "model=tiny_lm",
            "dataset=prompts",
            f"dataset.path={CHECKPOINTS / 'patching_prompts.jsonl'}",
            "limit=6",
            "target.kind=none",
            "dry_run=true",
            f"++hooks.sae.select.name={BLOCK}",
            "++hooks.sae.at=output",
            "++hooks.sae.action=sae",
            f"++hooks.sae.args.path={tmp_path / 'sae'}",
        ],
        run_dir=tmp_path / "dry",
    )
    line = next(x for x in result.plan_text.splitlines() if "/latents" in x)
    assert f"{want} (sparse)/sample" in line, line
    assert not (tmp_path / "dry" / "captures.h5").exists()


def test_the_latents_attribution_is_the_latent_times_the_targets_gradient(tiny, tmp_path):
    """record: [attribution]: z ⊙ ∂(top logit at the last token)/∂z through the splice (the
    error held fixed), by hand with autograd; zero where the latent is."""
    sae = write_sae(tmp_path / "sae", WIDTH, LATENTS, seed=9)
    hook = {
        "select": {"name": BLOCK},
        "at": "output",
        "action": "sae",
        "args": {"path": tmp_path / "sae", "record": ["latents", "attribution"]},
    }
    path = _run(tmp_path, "sae", hook, "target.kind=predicted")
    with hookrun.open(path) as f:
        stored = f[f"sae/{BLOCK}/output/attribution"][:]
        latents = f[f"sae/{BLOCK}/output/latents"][:]
        tokens = torch.as_tensor(f["samples/tokens"][:]).long()
        targets = torch.as_tensor(f["samples/target"][:]).long()
        mask = torch.as_tensor(f["samples/mask"][:]).bool() if "samples/mask" in f else None
    mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask
    kept = {}

    def splice(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        z = encode(sae, first)
        z.retain_grad()
        kept["z"] = z
        rebuilt = decode(sae, z)
        first = rebuilt + (first - decode(sae, z)).detach()
        return (first, *output[1:]) if isinstance(output, tuple) else first

    modules = dict(tiny.named_modules())
    handles = [
        modules["transformer.wte"].register_forward_hook(_leaf),
        modules[BLOCK].register_forward_hook(splice),
    ]
    try:
        logits = tiny(input_ids=tokens, attention_mask=mask.long()).logits
        last = mask.sum(1) - 1
        logits[torch.arange(len(tokens)), last, targets].sum().backward()
    finally:
        for h in handles:
            h.remove()
    hand = (kept["z"] * kept["z"].grad).detach().numpy()
    real = mask.numpy()
    np.testing.assert_allclose(stored[real], hand[real], atol=1e-6)
    assert np.abs(hand[real]).max() > 1e-4  # the target depends on the latents
    assert not stored[real][latents[real] == 0].any()  # only active latents have a part
