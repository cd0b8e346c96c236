"""Gradients on language models: token ids have no gradient, so a gradient site's graph starts
at the input embeddings' output (the hint token data's refusals give). A `grad_output`
capture there equals hand-written autograd of the target's score on the same Hugging Face
model, for target.kind answer and logit_diff (logit(answer) − logit(counterfactual_answer)),
GPT-2 and Llama; the model leaves the run as it came."""

from __future__ import annotations

import re

import h5py
import numpy as np
import pytest
import torch
from conftest import run_config
from lm_models import save_lm, tokenizer, write_jsonl

import hookrun
from hookrun.errors import HookrunError

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

ROWS = [
    {
        "prompt": "The cat sat on the",
        "answer": " mat",
        "counterfactual": "The dog sat on the",
        "counterfactual_answer": " cat",
    },
    {"prompt": "A quick brown fox jumps over", "answer": " the", "counterfactual_answer": " a"},
    {"prompt": "def add(a, b):", "answer": " return", "counterfactual_answer": " pass"},
]
EMBEDDINGS = {"gpt2": "transformer.wte", "llama": "model.embed_tokens"}


def _args(folder, data, kind: str, family: str) -> list[str]:
    return [
        "model=hf",
        f"model.path={folder}",
        "dataset=prompts",
        f"dataset.path={data}",
        f"target.kind={kind}",
        "batch_size=2",
        "render=false",
        f"++hooks.g.select.name={EMBEDDINGS[family]}",
        "++hooks.g.at=grad_output",
        "++hooks.g.action=capture",
    ]


def _hand_gradient(model, family: str, row: dict, kind: str) -> np.ndarray:
    """∂ score / ∂ (the embeddings' output) of one prompt run alone: score = the answer's
    logit at the last token, minus the counterfactual answer's for logit_diff."""
    tok = tokenizer()
    ids = torch.tensor([tok(row["prompt"])["input_ids"]])
    embed = dict(model.named_modules())[EMBEDDINGS[family]]
    leaf = embed(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=leaf, use_cache=False).logits[0, -1]
    answer = tok(row["answer"])["input_ids"][0]
    score = logits[answer]
    if kind == "logit_diff":
        score = score - logits[tok(row["counterfactual_answer"])["input_ids"][0]]
    score.backward()
    return leaf.grad[0].numpy()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("kind", ["answer", "logit_diff"])
def test_an_embedding_gradient_equals_hand_autograd(tmp_path, family, kind):
    model, _ = save_lm(tmp_path / "lm", family)
    data = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    with h5py.File(
        run_config(tmp_path / "run", _args(tmp_path / "lm", data, kind, family)).path
    ) as f:
        grads = f[f"captures/{EMBEDDINGS[family]}/grad_output"][:]
        mask, target = f["samples/mask"][:], f["samples/target"][:]
        against = f["samples/counterfactual_target"][:] if kind == "logit_diff" else None
    tok = tokenizer()
    for r, row in enumerate(ROWS):
        assert target[r] == tok(row["answer"])["input_ids"][0]
        if against is not None:
            assert against[r] == tok(row["counterfactual_answer"])["input_ids"][0]
        want = _hand_gradient(model, family, row, kind)
        got = grads[r][mask[r]]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        assert np.abs(want).max() > 1e-4  # a gradient that says something


def test_a_callers_model_in_train_mode_leaves_the_gradient_run_as_it_came(tmp_path):
    from transformers import AutoTokenizer

    from hookrun.models.language import LanguageModel

    model, _ = save_lm(tmp_path / "lm", "gpt2")
    data = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    lm = LanguageModel(model, AutoTokenizer.from_pretrained(tmp_path / "lm")).train()
    flags = {n: p.requires_grad for n, p in lm.named_parameters()}
    hookrun.run(
        _args(tmp_path / "lm", data, "logit_diff", "gpt2"), model=lm, run_dir=tmp_path / "r"
    )
    assert {n: p.requires_grad for n, p in lm.named_parameters()} == flags
    # In train mode as it came: the wrapper, the wrapped root (not one of its modules) and
    # every module.
    assert lm.training and model.training and all(m.training for m in lm.modules())
    for name, module in lm.named_modules():
        assert not module._forward_hooks and not module._forward_pre_hooks, name
    assert not model.transformer.wte._forward_hooks


def test_logit_diff_is_refused_without_a_counterfactual_answer_or_on_text(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    rows = [ROWS[0], {"prompt": "A quick brown fox", "answer": " jumps"}]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "a", _args(tmp_path / "lm", data, "logit_diff", "gpt2"))
    said = str(err.value)
    assert said.startswith("target.kind: logit_diff") and "prompts.jsonl:2" in said, said
    assert "'counterfactual_answer'" in said and "\n" not in said
    # A bad row past dataset.limit is not the run's: the run goes ahead.
    run_config(
        tmp_path / "limited", [*_args(tmp_path / "lm", data, "logit_diff", "gpt2"), "limit=1"]
    )
    text = tmp_path / "corpus.txt"
    text.write_text("one line of text\nanother line of text\n", encoding="utf-8")
    args = [*_args(tmp_path / "lm", text, "logit_diff", "gpt2")]
    args[2] = "dataset=text"
    args.append("dataset.context=8")
    with pytest.raises(HookrunError, match=r"^target.kind: logit_diff reads .* dataset=prompts"):
        run_config(tmp_path / "b", args)
    assert not (tmp_path / "a" / "captures.h5").exists()
    assert not (tmp_path / "b" / "captures.h5").exists()


def _hand_score(model, family: str, row: dict, kind: str, embeds: torch.Tensor):
    """The target's score for one prompt run alone on `embeds` (1, T, D) in place of its
    token ids."""
    tok = tokenizer()
    logits = model(inputs_embeds=embeds, use_cache=False).logits[0, -1]
    score = logits[tok(row["answer"])["input_ids"][0]]
    if kind == "logit_diff":
        score = score - logits[tok(row["counterfactual_answer"])["input_ids"][0]]
    return score


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("kind", ["answer", "logit_diff"])
def test_integrated_gradients_and_smoothgrad_explain_the_input_embeddings(tmp_path, family, kind):
    """derive.integrated_gradients (16 midpoint steps from zero embeddings) equals the same
    Riemann sum by hand autograd, row by row; derive.smoothgrad with sigma=0 equals the
    embeddings' gradient; both stored (N, T, D), and the token picture drawn."""
    model, _ = save_lm(tmp_path / "lm", family)
    data = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    args = [
        *_args(tmp_path / "lm", data, kind, family)[:-4],
        "render=true",
        "++derive.integrated_gradients={steps: 16, method: riemann_middle}",
        "++derive.smoothgrad={sigma: 0}",
        # A scaling of the embeddings: the methods' own passes must not see it (nor record
        # their embedding call as a second call of the module).
        f"++hooks.e.select.name={EMBEDDINGS[family]}",
        "++hooks.e.at=output",
        "++hooks.e.action=scale",
        "++hooks.e.args.factor=3.0",
    ]
    result = run_config(tmp_path / "run", args)
    with h5py.File(result.path) as f:
        ig = f["derived/integrated_gradients/input"][:]
        gap = f["derived/integrated_gradients/input.completeness_gap"][:]
        smooth = f["derived/smoothgrad/input"][:]
        mask = f["samples/mask"][:]
        scales = f["derived/integrated_gradients/input"].dims
        dims = [d[0].name.rsplit("/", 1)[1].split("_")[0] if len(d) else None for d in scales]
    assert dims == ["sample", "token", "feature"]  # the embeddings' axes, not the ids'
    assert (result.images / "token_attributions.png").is_file()
    embed = dict(model.named_modules())[EMBEDDINGS[family]]
    tok = tokenizer()
    width = embed.weight.shape[1]
    assert ig.shape[1:] == (mask.shape[1], width) == smooth.shape[1:]
    for r, row in enumerate(ROWS):
        x = embed(torch.tensor([tok(row["prompt"])["input_ids"]])).detach()
        total = torch.zeros_like(x)
        for k in range(16):
            point = ((k + 0.5) / 16 * x).requires_grad_(True)
            _hand_score(model, family, row, kind, point).backward()
            total += point.grad / 16
        want = (x * total)[0].numpy()
        np.testing.assert_allclose(ig[r][mask[r]], want, atol=1e-5, rtol=0)
        assert np.abs(ig[r][~mask[r]]).max(initial=0) == 0  # padding: no attribution
        with torch.no_grad():
            change = _hand_score(model, family, row, kind, x) - _hand_score(
                model, family, row, kind, torch.zeros_like(x)
            )
        np.testing.assert_allclose(gap[r], want.sum() - float(change), atol=1e-4)
        np.testing.assert_allclose(
            smooth[r][mask[r]], _hand_gradient(model, family, row, kind), atol=1e-5, rtol=0
        )


def test_the_dry_run_lists_only_what_the_file_holds(tmp_path):
    """experiment=integrated_gradients on token data: its `photo` hook captures the model
    input, which for a language model is token ids (stored at /samples/tokens), no value a
    hook acts on. The dry run listed /captures/input/output, which the file never held."""
    args = [
        "experiment=integrated_gradients",
        "model=tiny_lm",
        "dataset=prompts",
        "dataset.path=${pkg_dir:hookrun}/models/checkpoints/lens_prompts.jsonl",
        "target.kind=answer",
        "limit=2",
        "++derive.integrated_gradients.steps=2",
        "render=false",
    ]
    dry = run_config(tmp_path / "dry", [*args, "dry_run=true"])
    listed = set(re.findall(r"\s(/\S+)$", dry.plan_text, re.M))
    assert "/derived/integrated_gradients/input" in listed
    result = run_config(tmp_path / "run", args)
    with h5py.File(result.path) as f:
        assert all(path.lstrip("/") in f for path in listed), listed
    assert "input                            (no floating-point tensor here" in dry.plan_text
