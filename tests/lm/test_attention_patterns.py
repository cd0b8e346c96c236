"""`at: pattern`: attention probabilities per head equal the model's own
`output_attentions=True` ones (eager) for GPT-2, Llama, GPT-NeoX and BERT, padded rows on their
real tokens; zeroing one head's pattern equals a hand-written ablation of that head, and
patching one head from another model's stored run a hand replacement; a fused (sdpa) model is
switched to eager, the plan says so and the caller's model comes back as it was; a module that
is not an attention module, positions, heads on a capture and a second capture are refused."""

from __future__ import annotations

import h5py
import pytest
import torch
import transformers
from conftest import run_config
from lm_models import FAMILIES, prompt_run, save_lm, tokenizer, write_jsonl

from hookrun.errors import HookrunError

ATTENTION = {
    "gpt2": "transformer.h.{}.attn",
    "llama": "model.layers.{}.self_attn",
    "gpt_neox": "gpt_neox.layers.{}.attention",
    "bert": "bert.encoder.layer.{}.attention.self",
}
PROMPTS = [
    {"prompt": "The cat sat on the", "answer": " mat"},
    {"prompt": "A quick brown fox", "answer": " jumps"},
    {"prompt": "Hooks", "answer": " capture"},
    {"prompt": "def add(a, b): return a +", "answer": " b"},
]


def _overrides(folder, kind: str, data, select: str, action: str = "capture") -> list[str]:
    return [
        *prompt_run(folder, kind, data),
        f"++hooks.attn.select.name={select}",
        "++hooks.attn.at=pattern",
        f"++hooks.attn.action={action}",
    ]


def _rows(f: h5py.File) -> list[list[int]]:
    tokens, mask = f["samples/tokens"][:], f["samples/mask"][:]
    return [row[m].tolist() for row, m in zip(tokens, mask, strict=True)]


def _hf_attentions(model, ids: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    return out.attentions


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patterns_equal_output_attentions(tmp_path, family):
    model, kind = save_lm(tmp_path / "lm", family)
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    select = ATTENTION[family].format("*")
    result = run_config(tmp_path / "run", _overrides(tmp_path / "lm", kind, data, select))
    with h5py.File(result.path) as f:
        rows = _rows(f)
        stored = [f[f"captures/{ATTENTION[family].format(i)}/pattern"][:] for i in range(2)]
        scales = f[f"captures/{ATTENTION[family].format(0)}/pattern"].dims
        dims = [d[0].name.rsplit("/", 1)[1].split(" ")[-1] if len(d) else None for d in scales]
    assert len({len(r) for r in rows}) > 1  # padded rows
    assert stored[0].shape == (4, 2, max(map(len, rows)), max(map(len, rows)))
    assert all(stored[0].dtype == s.dtype for s in stored)
    for n, ids in enumerate(rows):
        expected = _hf_attentions(model, ids)
        length = len(ids)
        for layer in range(2):
            got = torch.from_numpy(stored[layer][n, :, :length, :length])
            torch.testing.assert_close(got, expected[layer][0], atol=1e-6, rtol=0)
    assert dims[0] == "sample" and [d.split("_")[0] for d in dims[1:]] == ["head", "query", "key"]


def test_zero_one_head_equals_a_hand_ablation(tmp_path):
    model, kind = save_lm(tmp_path / "lm", "gpt2")
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    overrides = _overrides(tmp_path / "lm", kind, data, "transformer.h.1.attn", "zero")
    result = run_config(tmp_path / "run", [*overrides, "++hooks.attn.args.heads=[1]"])
    with h5py.File(result.path) as f:
        rows, output = _rows(f), f["model/output"][:]
    attn = model.transformer.h[1].attn
    head_dim = attn.head_dim

    def ablate(module, args):  # c_proj's input: heads concatenated; head 1's values × 0 = 0
        x = args[0].clone()
        x[..., head_dim : 2 * head_dim] = 0
        return (x,)

    handle = attn.c_proj.register_forward_pre_hook(ablate)
    try:
        for n, ids in enumerate(rows):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(torch.from_numpy(output[n]), logits, atol=1e-5, rtol=0)
    finally:
        handle.remove()
    with torch.no_grad():  # and the ablation changed the output
        plain = model(input_ids=torch.tensor([rows[0]])).logits[0, -1]
    assert (torch.from_numpy(output[0]) - plain).abs().max() > 1e-4


def test_scale_every_head_by_one_changes_nothing_and_heads_are_checked(tmp_path):
    model, kind = save_lm(tmp_path / "lm", "llama")
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    base = _overrides(tmp_path / "lm", kind, data, "model.layers.*.self_attn", "scale")
    result = run_config(tmp_path / "run", [*base, "++hooks.attn.args.factor=1.0"])
    with h5py.File(result.path) as f:
        rows, output = _rows(f), f["model/output"][:]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([rows[2]])).logits[0, -1]
    torch.testing.assert_close(torch.from_numpy(output[2]), logits, atol=1e-5, rtol=0)
    with pytest.raises(HookrunError, match=r"^hooks\.attn\.args\.heads: 2 is past the 2 heads"):
        run_config(tmp_path / "r2", [*base, "++hooks.attn.args.heads=[2]"])


def _pattern_run(tmp_path, module: str) -> list[str]:
    """The overrides of a run of two prompts capturing `module`'s attention pattern."""
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:2])
    return [
        "dataset=prompts",
        f"dataset.path={data}",
        "render=false",
        "progress=false",
        f"++hooks.attn.select.name={module}",
        "++hooks.attn.at=pattern",
        "++hooks.attn.action=capture",
    ]


def test_a_fused_attention_model_is_switched_to_eager_and_the_plan_says_so(tmp_path):
    import hookrun

    tok = tokenizer()
    cfg = transformers.AutoConfig.for_model(**FAMILIES["gpt2"][1], vocab_size=len(tok) + 4)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    assert hf.config._attn_implementation == "sdpa"
    from hookrun.models.language import LanguageModel

    overrides = _pattern_run(tmp_path, "transformer.h.0.attn")
    lm = LanguageModel(hf, tok)
    plan = hookrun.run(overrides=[*overrides, "dry_run=true"], model=lm, run_dir=tmp_path / "d")
    assert "switched to eager attention" in plan.plan_text
    assert "/captures/transformer.h.0.attn/pattern" in plan.plan_text
    result = hookrun.run(overrides=overrides, model=lm, run_dir=tmp_path / "run")
    assert hf.config._attn_implementation == "sdpa"  # the caller's model as it came
    with h5py.File(result.path) as f:
        rows, stored = _rows(f), f["captures/transformer.h.0.attn/pattern"][:]
    hf.set_attn_implementation("eager")
    for n, ids in enumerate(rows):
        expected = _hf_attentions(hf, ids)[0][0]
        got = torch.from_numpy(stored[n, :, : len(ids), : len(ids)])
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_model_attention_sdpa_with_a_pattern_site_runs_eager_and_says_so(tmp_path):
    """model=hf model.attention=sdpa (as experiment=lm_cache loads): a pattern site switches
    the run to eager, the plan says so, and the patterns are the model's own."""
    model, _ = save_lm(tmp_path / "lm", "gpt2")
    model_args = ["model=hf", f"model.path={tmp_path / 'lm'}", "model.attention=sdpa"]
    overrides = [*model_args, *_pattern_run(tmp_path, "transformer.h.1.attn")]
    result = run_config(tmp_path / "run", overrides)
    assert "switched to eager attention" in result.plan_text
    with h5py.File(result.path) as f:
        rows, stored = _rows(f), f["captures/transformer.h.1.attn/pattern"][:]
    for n, ids in enumerate(rows):
        expected = _hf_attentions(model, ids)[1][0]
        got = torch.from_numpy(stored[n, :, : len(ids), : len(ids)])
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("select", "extra", "match"),
    [
        (
            "transformer.h.0.mlp",
            [],
            r"^hooks\.attn\.at: pattern on 'transformer\.h\.0\.mlp', which is not an attention "
            r"module .*; valid: transformer\.h\.0\.attn, transformer\.h\.1\.attn$",
        ),
        (
            "transformer.h.0.attn",
            ["++hooks.attn.args.positions=last"],
            r"^hooks\.attn\.args\.positions: last at pattern",
        ),
        (
            "transformer.h.0.attn",
            ["++hooks.attn.args.heads=[0]"],
            r"^hooks\.attn\.args\.heads: \[0\] with capture at pattern",
        ),
        (
            "transformer.h.0.attn",
            [
                "++hooks.again.select.name=transformer.h.*.attn",
                "++hooks.again.at=pattern",
                "++hooks.again.action=capture",
            ],
            r"^hooks\.again: captures transformer\.h\.0\.attn/pattern, which hooks\.attn",
        ),
        (
            "transformer.h.0.attn",
            ["++hooks.attn.select.function=softmax"],
            r"^hooks\.attn\.select\.function: 'softmax' with at: pattern",
        ),
    ],
)
def test_refusals(tmp_path, select, extra, match):
    _, kind = save_lm(tmp_path / "lm", "gpt2")
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    overrides = _overrides(tmp_path / "lm", kind, data, select)
    with pytest.raises(HookrunError, match=match) as err:
        run_config(tmp_path / "run", [*overrides, *extra])
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "captures.h5").exists()


def test_patch_puts_another_models_pattern_in_one_head(tmp_path):
    """Model B run with head 0 of layer 0's pattern patched from model A's stored run equals
    B by hand with that head's probabilities replaced by A's own output_attentions."""
    model_a, kind = save_lm(tmp_path / "a", "gpt2", seed=0)
    model_b, _ = save_lm(tmp_path / "b", "gpt2", seed=1)
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    clean = run_config(
        tmp_path / "clean", _overrides(tmp_path / "a", kind, data, "transformer.h.0.attn")
    )
    patched = _overrides(tmp_path / "b", kind, data, "transformer.h.0.attn", "patch")
    result = run_config(
        tmp_path / "patched",
        [*patched, f"++hooks.attn.args.file={clean.path}", "++hooks.attn.args.heads=[0]"],
    )
    with h5py.File(result.path) as f:
        rows, output = _rows(f), f["model/output"][:]
    attn = model_b.transformer.h[0].attn
    seen = {}

    def keep_values(module, args, out):  # c_attn's output: q, k, v concatenated
        seen["v"] = out.split(attn.embed_dim, dim=-1)[2]

    def replace_head(module, args):
        x, v = args[0].clone(), seen["v"]
        heads = v.view(*v.shape[:2], attn.num_heads, attn.head_dim).transpose(1, 2)
        mixed = (seen["p"] @ heads[:, :1]).transpose(1, 2).reshape(*v.shape[:2], -1)
        x[..., : attn.head_dim] = mixed
        return (x,)

    handles = [
        attn.c_attn.register_forward_hook(keep_values),
        attn.c_proj.register_forward_pre_hook(replace_head),
    ]
    try:
        for n, ids in enumerate(rows):
            seen["p"] = _hf_attentions(model_a, ids)[0][:, :1]  # A's head 0, (1, 1, T, T)
            with torch.no_grad():
                logits = model_b(input_ids=torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(torch.from_numpy(output[n]), logits, atol=1e-5, rtol=0)
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():  # and the patch changed B's output
        plain = model_b(input_ids=torch.tensor([rows[0]])).logits[0, -1]
    assert (torch.from_numpy(output[0]) - plain).abs().max() > 1e-4
