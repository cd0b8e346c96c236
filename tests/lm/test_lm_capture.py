"""Captures on language models equal a hand-written `register_forward_hook` loop on the same
Hugging Face model, row by row without padding, at every position kind, for GPT-2, Llama,
GPT-NeoX and BERT; bfloat16 captures read back exactly; what token data cannot do is refused."""

from __future__ import annotations

import re

import h5py
import numpy as np
import pytest
import torch
from conftest import hook, read, run_config
from lm_models import FAMILIES, prompt_run, save_lm, write_jsonl

from hookrun.errors import HookrunError
from hookrun.io.encoding import read_floats

BLOCKS = r"'(transformer\.h|model\.layers|gpt_neox\.layers|bert\.encoder\.layer)\.\d+'"
PROMPTS = [
    {"prompt": "The cat sat on the", "answer": " mat"},
    {"prompt": "A quick brown fox", "answer": " jumps"},
    {"prompt": "Hooks", "answer": " capture"},
    {"prompt": "def add(a, b): return a +", "answer": " b"},
    {"prompt": "The lazy dog sat", "answer": " on"},
]


def _hand_blocks(model, ids: list[int], pattern: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each block's output (T, D) and the logits (T, V) for one unpadded row, by hand."""
    seen: list[torch.Tensor] = []
    modules = dict(model.named_modules())
    handles = [
        modules[pattern.format(i)].register_forward_hook(
            lambda m, a, o: seen.append((o[0] if isinstance(o, tuple) else o)[0].detach())
        )
        for i in range(2)
    ]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    finally:
        for h in handles:
            h.remove()
    return seen, logits


def _overrides(folder, kind: str, data, positions: str) -> list[str]:
    return [
        *prompt_run(folder, kind, data),
        "target.kind=answer",
        f"++hooks.blocks.select.regex={BLOCKS}",
        "++hooks.blocks.at=output",
        "++hooks.blocks.action=capture",
        f"++hooks.blocks.args.positions={positions}",
    ]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_block_captures_equal_a_hand_hook_loop_at_every_position_kind(tmp_path, family):
    model, kind = save_lm(tmp_path / "lm", family)
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    pattern = FAMILIES[family][2]
    for positions in ("all", "last", "[0,-2]"):
        out = tmp_path / positions.strip("[]").replace(",", "_")
        result = run_config(out, _overrides(tmp_path / "lm", kind, data, positions))
        with h5py.File(result.path) as f:
            tokens, mask = f["samples/tokens"][:], f["samples/mask"][:]
            assert tokens.dtype == np.int32 and mask.dtype == bool
            stored = {i: f[f"captures/{pattern.format(i)}/output"][:] for i in range(2)}
            output, target = f["model/output"][:], f["samples/target"][:]
        assert mask.sum(1).tolist() == [len(row) for row in _row_ids(tokens, mask)]
        assert len(set(mask.sum(1).tolist())) > 1  # the rows are padded: lengths differ
        for n, ids in enumerate(_row_ids(tokens, mask)):
            blocks, logits = _hand_blocks(model, ids, pattern)
            length = len(ids)
            picked = {"all": slice(None), "last": length - 1, "[0,-2]": [0, length - 2]}
            want = picked[positions]
            for i in range(2):
                got = stored[i][n][:length] if positions == "all" else stored[i][n]
                np.testing.assert_allclose(got, blocks[i][want].numpy(), atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(output[n], logits[length - 1].numpy(), atol=1e-5)
        answers = [model_tokenizer_first(tmp_path / "lm", r["answer"]) for r in PROMPTS]
        assert target.tolist() == answers


def _row_ids(tokens: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    return [row[m].tolist() for row, m in zip(tokens, mask, strict=True)]


def model_tokenizer_first(folder, answer: str) -> int:
    return tokenizer_of(folder)(answer, add_special_tokens=False)["input_ids"][0]


def test_bfloat16_captures_read_back_exactly(tmp_path):
    model, kind = save_lm(tmp_path / "lm", "gpt2")
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    overrides = [*_overrides(tmp_path / "lm", kind, data, "last"), "sink.dtype=bfloat16"]
    result = run_config(tmp_path / "run", overrides)
    with h5py.File(result.path) as f:
        ds = f["captures/transformer.h.1/output"]
        assert ds.dtype == np.uint16 and ds.attrs["dtype"] == "bfloat16"
        got = read_floats(ds)
        tokens, mask = f["samples/tokens"][:], f["samples/mask"][:]
    for n, ids in enumerate(_row_ids(tokens, mask)):
        blocks, _ = _hand_blocks(model, ids, "transformer.h.{}")
        want = blocks[1][len(ids) - 1].to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(got[n], want)  # exactly the bfloat16 values


def test_a_hooks_args_dtype_stores_its_captures_in_that_float(tmp_path):
    """args.dtype per hook, beside sink.dtype=float32: the blocks in bfloat16 (raw bits,
    marked) and the MLPs in float16, each exactly the hand values rounded to it; the rest
    (the model output) in float32; the dry run sizes each dataset by its own float."""
    model, kind = save_lm(tmp_path / "lm", "gpt2")
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    overrides = [
        *_overrides(tmp_path / "lm", kind, data, "last"),
        "++hooks.blocks.args.dtype=bfloat16",
        "++hooks.mlp.select.name=transformer.h.1.mlp",
        "++hooks.mlp.at=output",
        "++hooks.mlp.action=capture",
        "++hooks.mlp.args.positions=last",
        "++hooks.mlp.args.dtype=float16",
    ]
    dry = run_config(tmp_path / "dry", [*overrides, "dry_run=true"])
    width = model.config.n_embd  # 2 bytes a value, not sink.dtype's 4
    for key in ("transformer.h.1/output", "transformer.h.1.mlp/output"):
        assert re.search(
            rf"\[{width}\]\s+{2 * width} B/sample\s+/captures/{re.escape(key)}", dry.plan_text
        )
    result = run_config(tmp_path / "run", overrides)
    seen: list[torch.Tensor] = []
    handle = model.transformer.h[1].mlp.register_forward_hook(lambda m, a, o: seen.append(o[0]))
    with h5py.File(result.path) as f:
        blocks, mlp = f["captures/transformer.h.1/output"], f["captures/transformer.h.1.mlp/output"]
        assert blocks.dtype == np.uint16 and blocks.attrs["dtype"] == "bfloat16"
        assert mlp.dtype == np.float16 and "dtype" not in mlp.attrs
        assert f["model/output"].dtype == np.float32
        got_blocks, got_mlp = read_floats(blocks), mlp[:]
        tokens, mask = f["samples/tokens"][:], f["samples/mask"][:]
    for n, ids in enumerate(_row_ids(tokens, mask)):
        hand, _ = _hand_blocks(model, ids, "transformer.h.{}")
        want = hand[1][len(ids) - 1].to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(got_blocks[n], want)
        np.testing.assert_array_equal(got_mlp[n], seen[-1][len(ids) - 1].half().numpy())
    handle.remove()
    for value, said in (
        ("int8", "valid: float32, float16, bfloat16"),
        ("float16", r"valid: an action that records \(capture, sae, transcoder\)"),
    ):
        bad = [*overrides, "++hooks.z.select.name=transformer.h.0", "++hooks.z.at=output"]
        bad += ["++hooks.z.action=" + ("capture" if value == "int8" else "zero")]
        bad += [f"++hooks.z.args.dtype={value}"]
        with pytest.raises(HookrunError, match=rf"^hooks\.z\.args\.dtype: .*{said}"):
            run_config(tmp_path / f"bad-{value}", bad)


def test_what_token_data_cannot_do_is_refused_naming_the_key(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    base = _overrides(tmp_path / "lm", "causal_lm", data, "last")
    cases = {
        "hooks.blocks.args.positions: position 9 is past the shortest row": [
            *base,
            "++hooks.blocks.args.positions=[0,9]",
        ],
        "derive: guided_grad_cam": [*base, "++derive.guided_grad_cam={layer: transformer.h.0}"],
        "target.kind: next_token": [*base, "target.kind=next_token"],
        "hooks.blocks.args.positions: 'middle'": [*base, "++hooks.blocks.args.positions=middle"],
    }
    for said, overrides in cases.items():
        with pytest.raises(HookrunError) as err:
            run_config(tmp_path / "refused", overrides)
        assert said in str(err.value), (said, str(err.value))
        assert "\n" not in str(err.value)
    assert not (tmp_path / "refused" / "captures.h5").exists()


def test_positions_on_image_data_are_refused(tmp_path):
    overrides = [
        "model=seed_convnet",
        "dataset=constant",
        "dataset.shape=[1,4,4]",
        "dataset.size=1",
        "render=false",
        *hook("c", "conv1", "output", "capture"),
        "++hooks.c.args.positions=last",
    ]
    with pytest.raises(HookrunError, match=r"hooks\.c\.args\.positions: last, but dataset="):
        run_config(tmp_path, overrides)


def test_a_callers_language_model_gives_the_configs_numbers_and_a_bare_one_is_refused(tmp_path):
    import hookrun
    from hookrun.models.language import LanguageModel

    model, kind = save_lm(tmp_path / "lm", "gpt2")
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    args = [*_overrides(tmp_path / "lm", kind, data, "last"), "progress=false"]
    from_config = read(hookrun.run(args, run_dir=tmp_path / "config").path)
    wrapped = LanguageModel(model, tokenizer_of(tmp_path / "lm"), kind)
    from_caller = read(hookrun.run(args, model=wrapped, run_dir=tmp_path / "caller").path)
    assert from_caller.keys() == from_config.keys()
    for key in from_config:
        np.testing.assert_array_equal(from_caller[key], from_config[key], err_msg=key)
    with pytest.raises(HookrunError, match=r"model: a GPT2LMHeadModel .* needs its tokenizer"):
        hookrun.run(args, model=model, run_dir=tmp_path / "bare")


def tokenizer_of(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
