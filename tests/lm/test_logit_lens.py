"""experiment=logit_lens: at the last block the lens is the model's own output distribution
(softmax of the Hugging Face model's logits, called directly) for GPT-2, Llama, GPT-NeoX and
BERT (its masked-LM head); at block 0 the target probability equals the family's norm and
unembedding applied by hand to a hand-hooked block output; an architecture the lens does not
know, bad k and modules that are not the model's head are refused in one line, before any
file is made, and naming the norm and unembedding makes an unknown architecture work."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from conftest import run_config
from lm_models import FAMILIES, save_lm, tokenizer, write_jsonl

from hookrun.errors import HookrunError
from hookrun.io.dimensions import read_names

PROMPTS = [
    {"prompt": "The cat sat on the", "answer": " mat"},
    {"prompt": "A quick brown fox", "answer": " jumps"},
    {"prompt": "Hooks", "answer": " capture"},
    {"prompt": "def add(a, b): return a +", "answer": " b"},
    {"prompt": "The lazy dog sat", "answer": " on"},
]
K = 4
# Each family's final norm and unembedding, by hand (BERT: no final norm, its MLM head;
# GPT-NeoX's unembedding is embed_out before transformers 5, lm_head since).
HEADS = {
    "gpt2": lambda m, h: m.lm_head(m.transformer.ln_f(h)),
    "llama": lambda m, h: m.lm_head(m.model.norm(h)),
    "gpt_neox": lambda m, h: m.get_output_embeddings()(m.gpt_neox.final_layer_norm(h)),
    "bert": lambda m, h: m.cls.predictions(h),
}
LENS_FILES = ("top_ids", "top_probs", "target_prob")


def _args(folder, kind: str, data, *more: str) -> list[str]:
    return [
        "experiment=logit_lens",
        "model=hf",
        f"model.path={folder}",
        f"model.class={kind}",
        f"dataset.path={data}",
        "batch_size=2",
        f"derive.logit_lens.k={K}",
        *more,
    ]


def _read(path) -> dict[str, np.ndarray]:
    with h5py.File(path) as f:
        out = {n: f[f"derived/logit_lens/{n}"][:] for n in LENS_FILES}
        for name in ("tokens", "mask", "target"):
            out[name] = f[f"samples/{name}"][:]
    return out


def _block_output(model, ids: list[int], block: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`block`'s output (T, D) and the logits (T, V) for one unpadded row, by hand."""
    seen = []
    handle = dict(model.named_modules())[block].register_forward_hook(
        lambda m, a, o: seen.append((o[0] if isinstance(o, tuple) else o)[0].detach())
    )
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
    finally:
        handle.remove()
    return seen[0], logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_last_block_is_the_models_output_and_block_0_the_hand_lens(tmp_path, family):
    model, kind = save_lm(tmp_path / "lm", family)
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    result = run_config(tmp_path / "run", _args(tmp_path / "lm", kind, data, "render=false"))
    got = _read(result.path)
    n, t = got["tokens"].shape
    assert got["top_ids"].shape == (n, 2, t, K) and got["target_prob"].shape == (n, 2)
    assert got["top_ids"].dtype == np.int32
    # The whole padded batch as hookrun ran it (the mask stored beside): every position.
    ids = torch.from_numpy(got["tokens"].astype(np.int64))
    mask = torch.from_numpy(got["mask"].astype(np.int64))
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask).logits.softmax(-1)
    top = own.topk(K, dim=-1)
    np.testing.assert_array_equal(got["top_ids"][:, -1], top.indices.numpy())
    np.testing.assert_allclose(got["top_probs"][:, -1], top.values.numpy(), atol=1e-5)
    block = FAMILIES[family][2].format(0)
    for row in range(n):
        real = got["tokens"][row][got["mask"][row]].tolist()
        hidden, logits = _block_output(model, real, block)
        with torch.no_grad():
            hand = HEADS[family](model, hidden).softmax(-1)  # (T, V) after block 0
        last, answer = len(real) - 1, int(got["target"][row])
        assert got["target_prob"][row, 0] == pytest.approx(float(hand[last, answer]), abs=1e-5)
        want = float(logits.softmax(-1)[last, answer])
        assert got["target_prob"][row, 1] == pytest.approx(want, abs=1e-5)
        hand_top = hand.topk(K, dim=-1)
        np.testing.assert_array_equal(got["top_ids"][row, 0, : len(real)], hand_top.indices)
        np.testing.assert_allclose(
            got["top_probs"][row, 0, : len(real)], hand_top.values.numpy(), atol=1e-5
        )


def test_the_picture_and_no_target_gives_nan(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    args = _args(tmp_path / "lm", "causal_lm", data, "target.kind=predicted")
    result = run_config(tmp_path / "run", args, "logit_lens")
    assert (tmp_path / "run" / "images" / "logit_lens" / "logit_lens.png").stat().st_size > 0
    got = _read(result.path)
    with h5py.File(result.path) as f:
        names = read_names(f)
    assert names["derived/logit_lens/top_ids"] == ("sample", "layer", "position", "k")
    assert names["derived/logit_lens/target_prob"] == ("sample", "layer")
    assert not np.isnan(got["target_prob"]).any()
    # target.kind=predicted: after the last block the target is the likeliest token there.
    last = got["mask"].sum(1) - 1
    top = got["top_probs"][np.arange(len(last)), 1, last, 0]
    np.testing.assert_allclose(got["target_prob"][:, 1], top, atol=1e-6)
    none = _read(run_config(tmp_path / "none", [*args, "target.kind=none"]).path)
    assert np.isnan(none["target_prob"]).all()
    np.testing.assert_array_equal(none["top_ids"], got["top_ids"])


def _save_opt(folder) -> None:
    """A tiny OPT (model.decoder.layers, model.decoder.final_layer_norm, lm_head): an
    architecture the lens does not know by name."""
    import transformers

    tok = tokenizer()
    cfg = transformers.AutoConfig.for_model(
        "opt",
        num_hidden_layers=2,
        hidden_size=32,
        ffn_dim=64,
        num_attention_heads=2,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        vocab_size=len(tok) + 4,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)


OPT_BLOCKS = r"++hooks.resid.select.regex='model\.decoder\.layers\.\d+'"


def test_an_unknown_architecture_is_refused_then_runs_once_its_head_is_named(tmp_path):
    _save_opt(tmp_path / "opt")
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    args = _args(tmp_path / "opt", "causal_lm", data, "render=false", OPT_BLOCKS)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "refused", args)
    said = str(err.value)
    assert said.startswith("derive.logit_lens: no known final norm and unembedding for OPT")
    assert "derive.logit_lens.norm=" in said and "derive.logit_lens.unembed=" in said
    assert "\n" not in said and not (tmp_path / "refused" / "captures.h5").exists()
    named = [
        *args,
        "++derive.logit_lens.norm=model.decoder.final_layer_norm",
        "++derive.logit_lens.unembed=lm_head",
    ]
    got = _read(run_config(tmp_path / "named", named).path)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "opt").eval()
    ids = torch.from_numpy(got["tokens"].astype(np.int64))
    mask = torch.from_numpy(got["mask"].astype(np.int64))
    with torch.no_grad():
        top = model(input_ids=ids, attention_mask=mask).logits.softmax(-1).topk(K, dim=-1)
    np.testing.assert_array_equal(got["top_ids"][:, -1], top.indices.numpy())
    np.testing.assert_allclose(got["top_probs"][:, -1], top.values.numpy(), atol=1e-5)


@pytest.mark.parametrize(
    ("more", "said"),
    [
        (
            # The lens and the embedding-gradient methods pass on token data, a CAM not.
            ["++derive.guided_grad_cam={layer: transformer.h.0}"],
            "derive: guided_grad_cam: a language model's input is token ids",
        ),
        (
            ["model.class=base", "++hooks.resid.select.regex='h\\.\\d+'"],
            "derive.logit_lens: no known final norm and unembedding for GPT2Model",
        ),
        (["derive.logit_lens.k=0"], "derive.logit_lens.k: 0; valid: 1 or more"),
        (["derive.logit_lens.k=100000"], "derive.logit_lens.k: 100000; valid: 1.."),
        (
            ["++derive.logit_lens.norm=none"],  # GPT-2 has one: ln_f
            "derive.logit_lens.norm, derive.logit_lens.unembed: none then "
            "lm_head on the last block's output (transformer.h.1) do not give the model's output",
        ),
        (["++derive.logit_lens.unembed=nope"], "derive.logit_lens.unembed: 'nope' is not a module"),
        (
            ["++hooks.resid.select.regex='transformer\\.h\\.0'"],
            "derive.logit_lens: needs the captures /captures/transformer.h.1/output",
        ),
        (
            ["hooks.resid.args.positions=last"],  # (D,) per row: no position to read
            "derive.logit_lens: /captures/transformer.h.0/output holds [32] per row, not the "
            "block's output at every position",
        ),
        (
            ["hooks.resid.args.positions=[0,1]"],
            "derive.logit_lens: /captures/transformer.h.0/output holds [2, 32] per row",
        ),
        (
            ["++hooks.resid.args.pool=avg"],  # pooled over the width: an internal error before
            "derive.logit_lens: /captures/transformer.h.0/output holds [",
        ),
    ],
)
def test_bad_keys_are_refused_in_one_line_before_any_file(tmp_path, more, said):
    save_lm(tmp_path / "lm", "gpt2")
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "refused", _args(tmp_path / "lm", "causal_lm", data, *more))
    assert said in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "refused" / "captures.h5").exists()
