"""AttnLRP on language models (`derive.lrp.composite=attnlrp`): the relevance per input token
of hookrun's hooks equals LXT 2.1's efficient AttnLRP (its monkey patches, run in
.venv-lxt by lxt_script.py) on a GPT-2, a Llama and a Qwen2 with random weights, to float32
rounding; the model leaves the run bit for bit as it came; a family the rules do not cover, a vision
composite on a language model and rules beside attnlrp are refused before any work; on the
shipped tiny_lm the relevance is stored like integrated gradients' and drawn; each batch is
forwarded once, the stored output the model's own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import run_config
from lm_models import save_lm, tokenizer, write_jsonl

import hookrun
from hookrun.errors import HookrunError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_venvs import lxt_python  # noqa: E402

SCRIPT = Path(__file__).with_name("lxt_script.py")
ROWS = [
    {"prompt": "The cat sat on the", "answer": " mat"},
    {"prompt": "A quick brown fox jumps over", "answer": " the"},
    {"prompt": "def add(a, b):", "answer": " return"},
]
EMBEDDINGS = {
    "gpt2": "transformer.wte",
    "llama": "model.embed_tokens",
    "qwen2": "model.embed_tokens",
    "gemma3_text": "model.embed_tokens",
}


def _save(folder: Path, family: str):
    """lm_models' model of the family; Qwen2 and Gemma 3 as its Llama's sizes in their config
    (Gemma's norm weights, zeros as built, set at random: its norms scale by 1 + weight)."""
    if family == "qwen2":
        return save_lm(folder, "llama", model_type="qwen2")
    if family == "gemma3_text":
        model, kind = save_lm(folder, "llama", model_type="gemma3_text", head_dim=16)
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
        model.save_pretrained(folder)
        return model, kind
    return save_lm(folder, family)


def _args(folder: Path, data: Path) -> list[str]:
    return [
        "experiment=lrp",
        "model=hf",
        f"model.path={folder}",
        "dataset=prompts",
        f"dataset.path={data}",
        "target.kind=answer",
        "batch_size=2",
        "render=false",
        "derive.lrp.composite=attnlrp",
    ]


def _lxt(tmp_path: Path, family: str, folder: Path) -> list[dict]:
    tok = tokenizer()
    rows = [
        {"ids": tok(r["prompt"])["input_ids"], "answer": tok(r["answer"])["input_ids"][0]}
        for r in ROWS
    ]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    out = tmp_path / "lxt.json"
    args = [str(lxt_python()), str(SCRIPT), family, str(folder), str(tmp_path / "rows.json")]
    done = subprocess.run([*args, str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def _gradient_times_input(model, family: str, row: dict) -> np.ndarray:
    """Plain gradient × input per token: what LXT's patches must change."""
    tok = tokenizer()
    embed = dict(model.named_modules())[EMBEDDINGS[family]]
    x = embed(torch.tensor([tok(row["prompt"])["input_ids"]])).detach().requires_grad_(True)
    model(inputs_embeds=x, use_cache=False).logits[
        0, -1, tok(row["answer"])["input_ids"][0]
    ].backward()
    return (x * x.grad).sum(-1)[0].detach().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "gemma3_text"])
def test_the_relevance_per_token_equals_lxt(tmp_path, family):
    model, _ = _save(tmp_path / "lm", family)
    data = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    with h5py.File(run_config(tmp_path / "run", _args(tmp_path / "lm", data)).path) as f:
        relevance = f["derived/lrp/input"][:]
        gap = f["derived/lrp/input.completeness_gap"][:]
        mask = f["samples/mask"][:]
    assert relevance.shape[:2] == mask.shape and relevance.shape[2] == 32
    for r, (row, want) in enumerate(
        zip(ROWS, _lxt(tmp_path, family, tmp_path / "lm"), strict=True)
    ):
        got = relevance[r][mask[r]].sum(-1)
        lxt = np.array(want["relevance"])
        scale = np.abs(lxt).max()
        np.testing.assert_allclose(got, lxt, rtol=0, atol=1e-5 * scale)
        # LXT's patches took: its relevance is not plain gradient × input.
        assert np.abs(_gradient_times_input(model, family, row) - lxt).max() > 1e-2 * scale
        np.testing.assert_allclose(gap[r], lxt.sum() - want["logit"], rtol=0, atol=1e-5 * scale)
        assert np.abs(relevance[r][~mask[r]]).max(initial=0) == 0


def _snapshot(model) -> dict:
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()},
        "attention": model.config._attn_implementation,
        "hooks": [
            (
                n,
                len(m._forward_hooks),
                len(m._forward_pre_hooks),
                len(m._backward_hooks),
                "forward" in vars(m),
            )
            for n, m in model.named_modules()
        ],
        "training": [m.training for m in model.modules()],
    }


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "gemma3_text"])
def test_the_model_leaves_the_run_bit_for_bit(tmp_path, family):
    from transformers import AutoTokenizer

    from hookrun.models.language import LanguageModel

    model, kind = _save(tmp_path / "lm", family)
    before = _snapshot(model)
    wrapped = LanguageModel(model, AutoTokenizer.from_pretrained(tmp_path / "lm"), kind)
    data = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    run = hookrun.run(
        [*_args(tmp_path / "lm", data), "progress=false"], model=wrapped, run_dir=tmp_path / "run"
    )
    with h5py.File(run.path) as f:
        assert np.isfinite(f["derived/lrp/input"][:]).all()
    after = _snapshot(model)
    assert after["tensors"].keys() == before["tensors"].keys()
    for key, value in before["tensors"].items():
        assert torch.equal(after["tensors"][key], value), key
    assert after["attention"] == before["attention"]
    assert after["hooks"] == before["hooks"] and after["training"] == before["training"]
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_a_family_the_rules_do_not_cover_is_refused_in_one_line(tmp_path):
    save_lm(tmp_path / "lm", "gpt_neox")
    data = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", _args(tmp_path / "lm", data))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        "derive.lrp.composite: 'attnlrp' does not cover model family 'gpt_neox'"
    )
    assert "valid: a Hugging Face gpt2, llama, qwen2, gemma3_text model" in message
    assert not (tmp_path / "run" / "captures.h5").exists()


@pytest.mark.slow
def test_a_vision_composite_on_a_language_model_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    args = [*_args(tmp_path, data)[:2], "model=tiny_lm", *_args(tmp_path, data)[3:-1]]
    with pytest.raises(
        HookrunError,
        match=r"^derive\.lrp\.composite: 'epsilon_plus_flat' is a vision composite "
        r".* valid here: attnlrp$",
    ):
        run_config(tmp_path / "run", [*args, "derive.lrp.composite=epsilon_plus_flat"])


def test_rules_beside_attnlrp_are_refused():
    with pytest.raises(HookrunError, match=r"^derive\.lrp\.rules: \['r'\] with composite attnlrp"):
        hookrun.compose(
            [
                "experiment=lrp",
                "derive.lrp.composite=attnlrp",
                "+derive.lrp.rules.r={select: {type: [Linear]}, rule: epsilon}",
            ]
        )


@pytest.mark.slow
def test_lrp_on_the_shipped_token_model_is_stored_like_integrated_gradients_and_drawn(tmp_path):
    args = [
        "experiment=lrp",
        "model=tiny_lm",
        "dataset=prompts",
        "dataset.path=${pkg_dir:hookrun}/models/checkpoints/lens_prompts.jsonl",
        "derive.lrp.composite=attnlrp",
        "render=true",
    ]
    result = run_config(tmp_path, args)
    with h5py.File(result.path) as f:
        ds = f["derived/lrp/input"]
        dims = [d[0].name.rsplit("/", 1)[1].split("_")[0] if len(d) else None for d in ds.dims]
        assert dims == ["sample", "token", "feature"]
        assert ds.shape[:2] == f["samples/mask"].shape
        assert np.isfinite(f["derived/lrp/input.completeness_gap"][:]).all()
    assert list(result.images.rglob("token_attributions.png"))


@pytest.mark.slow
def test_each_batch_is_forwarded_once_and_the_stored_output_is_the_models_own(tmp_path):
    """AttnLRP's pass forwards the batch as the model does: where no hook of the run acts,
    the run takes the batch's output and predicted target from it, one forward a batch (and
    the probe's one); a capture hook brings the run's own forward back, with the same
    results."""
    from transformers import AutoTokenizer

    from hookrun.models.language import LanguageModel

    model, kind = _save(tmp_path / "lm", "gpt2")
    tok = AutoTokenizer.from_pretrained(tmp_path / "lm")
    data = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    calls = []
    handle = model.transformer.register_forward_pre_hook(lambda m, a: calls.append(1))
    base = [a for a in _args(tmp_path / "lm", data) if a != "target.kind=answer"]
    files = {}
    capture = "+hooks.h0={select: {name: transformer.h.0}, at: output, action: capture}"
    try:
        for name, extra in [("alone", []), ("captured", [capture])]:
            calls.clear()
            run = hookrun.run(
                [*base, "progress=false", *extra],
                model=LanguageModel(model, tok, kind),
                run_dir=tmp_path / name,
            )
            files[name] = (run.path, len(calls))
    finally:
        handle.remove()
    batches = 2  # 3 rows in batches of 2
    assert files["alone"][1] == 1 + batches  # the probe, then one pass a batch
    assert files["captured"][1] == 2 + 2 * batches  # the probe's two; the run's forward too
    with h5py.File(files["alone"][0]) as f, h5py.File(files["captured"][0]) as g:
        assert "captures/transformer.h.0/output" in g and "captures" not in f
        output, target = f["model/output"][:], f["samples/target"][:]
        for key in ("model/output", "samples/target", "derived/lrp/input"):
            np.testing.assert_array_equal(f[key][:], g[key][:])
    for r, row in enumerate(ROWS):  # the model's own logits at the prompt's last token
        with torch.no_grad():
            want = model(torch.tensor([tok(row["prompt"])["input_ids"]])).logits[0, -1]
        np.testing.assert_allclose(output[r], want.numpy(), rtol=0, atol=1e-5)
        assert target[r] == int(want.argmax())
