"""Language-model inputs that used to fail late (an internal error, a refusal after every
batch, a message about the wrong thing) stop before any work, typed as a user types them,
with one line naming the key, the bad value and what is valid; no captures.h5 is written
(issue 28, part 3, and the repeated tokens' size from part 2)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import hookrun_cli, run_config
from lm_models import write_jsonl

import hookrun
from hookrun.data.kinds import DATASETS
from hookrun.data.tokens import Tokenizing
from hookrun.errors import HookrunError
from hookrun.models.language import LanguageModel

TINY_LM = Path(hookrun.__file__).parent / "models" / "checkpoints" / "tiny_lm"
GPT2 = "model_type: gpt2, n_layer: 2, n_embd: 64, vocab_size: 257"
EMBEDDINGS_HINT = "select: {name: transformer.wte}, at: grad_output"  # README's promise


def _refused(tmp_path: Path, overrides: list[str]) -> str:
    """The one line `overrides` are refused with, in-process; no captures.h5 left."""
    run_dir = tmp_path / "run"
    with pytest.raises(HookrunError) as err:
        run_config(run_dir, overrides)
    message = str(err.value)
    assert "\n" not in message, message
    assert not (run_dir / "captures.h5").exists(), "refused after the file was made"
    return message


def _cli_refused(tmp_path: Path, args: list[str], timeout: int = 300) -> str:
    """`python -m hookrun ARGS`: exit 2, one `hookrun: error:` line, no traceback, no file."""
    proc = hookrun_cli([*args, "hydra.run.dir=run"], tmp_path, timeout=timeout)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("hookrun:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("hookrun: error: "), lines[0]
    assert not (tmp_path / "run" / "captures.h5").exists()
    return lines[0].removeprefix("hookrun: error: ")


# 1. model.config that transformers cannot build a model from.


@pytest.mark.slow
def test_heads_that_do_not_divide_the_width_are_refused_by_the_cli(tmp_path):
    said = _cli_refused(
        tmp_path, ["model=hf", f"model.config={{{GPT2}, n_head: 3}}", "experiment=lm_cache"]
    )
    assert said.startswith("model.config: ") and "'n_head': 3" in said, said
    assert "must be divisible by num_heads" in said  # transformers' own reason
    assert "valid: " in said and "internal error" not in said


def test_a_misspelt_model_config_key_is_refused_not_ignored(tmp_path):
    """transformers keeps an unknown key as a bare attribute and builds the default model:
    `n_layers` would give gpt2's 12 layers without a word."""
    config = "model.config={model_type: gpt2, n_layers: 1, n_embd: 64, n_head: 2}"
    said = _refused(tmp_path, ["model=hf", config, "experiment=lm_cache"])
    assert said.startswith("model.config.n_layers: unknown key (did you mean 'n_layer'?)"), said
    assert "valid keys: " in said and "n_layer," in said


def test_a_model_config_key_read_under_another_name_is_kept(tmp_path):
    """llama reads `rope_theta` into its rope_parameters: a key that changes the config."""
    config = (
        "model.config={model_type: llama, hidden_size: 32, num_attention_heads: 2, "
        "num_hidden_layers: 1, intermediate_size: 64, vocab_size: 257, rope_theta: 1234.0}"
    )
    result = run_config(tmp_path / "run", ["model=hf", config, "experiment=lm_cache", "limit=2"])
    assert result.path.is_file()


def test_a_negative_width_is_refused_naming_model_config(tmp_path):
    config = "model.config={model_type: gpt2, n_layer: 2, n_embd: -64, n_head: 2}"
    with pytest.raises(HookrunError) as err:  # at spec time: compose builds nothing
        hookrun.compose(["model=hf", config, "experiment=lm_cache"])
    said = _refused(tmp_path, ["model=hf", config, "experiment=lm_cache"])
    assert str(err.value) == said
    assert said.startswith("model.config: ") and "'n_embd': -64" in said, said
    assert "negative dimension -64" in said and "valid: " in said


def test_a_config_value_of_the_wrong_type_is_refused_with_its_reason(tmp_path):
    """Found beside issue 28: transformers' strict config fields raise an error type of
    huggingface_hub's, which was an internal error; its reason is on its second line."""
    config = f"model.config={{{GPT2}, n_head: 2, layer_norm_epsilon: -1}}"
    said = _refused(tmp_path, ["model=hf", config, "experiment=lm_cache"])
    assert said.startswith("model.config: gpt2 {") and "'layer_norm_epsilon': -1" in said, said
    assert "expected float, got int" in said and "valid: " in said


def test_a_model_config_too_large_for_memory_is_refused_before_it_is_built(tmp_path):
    """Found beside issue 28: a vocabulary of 1e11 was an internal error (torch's allocator)
    after the data was read; the parameters are counted on the meta device first."""
    config = "model.config={model_type: gpt2, n_layer: 1, n_embd: 64, n_head: 2}"
    said = _refused(
        tmp_path,
        ["model=hf", config, "+model.config.vocab_size=100000000000", "experiment=lm_cache"],
    )
    # wte alone: 1e11 ids × 64 floats × 4 bytes = 23.3 TiB (more than any test machine)
    assert re.match(
        r"model\.config: \{.*'vocab_size': 100000000000.*\} makes the model's [\d,]+ parameters "
        r"in float32 need 23\.3 TiB at once, more than this machine's .* of memory; valid: ",
        said,
    ), said


# 2. derive.logit_lens.norm / .unembed naming a module that fails on the block outputs.


@pytest.mark.parametrize(
    ("overrides", "key", "value", "valid"),
    [
        (
            ["+derive.logit_lens.norm=transformer.wte"],
            "norm",
            "transformer.wte",
            "transformer.ln_f",
        ),
        (["+derive.logit_lens.unembed=transformer.wte"], "unembed", "transformer.wte", "lm_head"),
        (
            ["+derive.logit_lens.unembed=transformer.h.1.attn", "+derive.logit_lens.norm=none"],
            "unembed",
            "transformer.h.1.attn",
            "lm_head",
        ),
    ],
)
def test_a_lens_module_that_fails_is_refused_naming_its_key(tmp_path, overrides, key, value, valid):
    said = _refused(tmp_path, ["experiment=logit_lens", "render=false", *overrides])
    assert said.startswith(f"derive.logit_lens.{key}: '{value}' "), said
    what = "final norm" if key == "norm" else "unembedding"
    assert f"valid: the model's {what}, {valid} here" in said, said
    if value == "transformer.wte" and key == "unembed":  # GPT-2 ties lm_head to wte
        assert "lm_head shares its weight" in said


# 3. A LanguageModel given something that is not a tokenizer.


def _tiny_gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=257)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_a_language_model_with_a_string_for_a_tokenizer_is_refused(tmp_path):
    with pytest.raises(HookrunError) as err:
        hookrun.run(
            ["experiment=lm_cache", "render=false"],
            model=LanguageModel(_tiny_gpt2(), "not a tokenizer"),
            run_dir=tmp_path / "run",
        )
    said = str(err.value)
    assert said.startswith("model: LanguageModel's tokenizer is a str ('not a tokenizer')"), said
    assert "valid: a transformers tokenizer (PreTrainedTokenizerBase" in said
    assert not (tmp_path / "run" / "captures.h5").exists()


def test_text_data_for_a_language_model_without_a_tokenizer_says_so(tmp_path):
    with pytest.raises(HookrunError) as err:
        hookrun.run(
            ["experiment=lm_cache", "render=false"],
            model=LanguageModel(_tiny_gpt2(), None),
            run_dir=tmp_path / "run",
        )
    assert str(err.value).startswith(
        "dataset.kind: text is text, read with a language model's tokenizer, and this model "
        "has none; valid: model=hf, model=tiny_lm, or from Python LanguageModel(model, tokenizer)"
    )
    assert not (tmp_path / "run" / "captures.h5").exists()


def test_a_raw_tokenizers_tokenizer_is_refused_with_how_to_wrap_it():
    from hookrun.models.hf import byte_tokenizer

    raw = byte_tokenizer().backend_tokenizer  # a tokenizers.Tokenizer
    with pytest.raises(HookrunError) as err:
        LanguageModel(_tiny_gpt2(), raw)
    assert "PreTrainedTokenizerFast(tokenizer_object=" in str(err.value)
    model = LanguageModel(_tiny_gpt2(), byte_tokenizer())
    with pytest.raises(HookrunError, match=r"^model: LanguageModel's tokenizer is a int \(5\)"):
        model.tokenizer = 5  # set later: checked the same way


# 5. experiment=induction with rows of one repeat.


def test_induction_with_one_repeat_is_refused_before_any_batch(tmp_path):
    said = _refused(tmp_path, ["experiment=induction", "dataset.repeats=1", "dataset.size=4"])
    assert said.startswith("dataset.repeats: 1 ") and "valid: 2 or more" in said, said
    assert not list((tmp_path / "run").glob("*.h5"))


def test_induction_on_a_one_token_sequence_is_refused_before_any_batch(tmp_path):
    said = _refused(tmp_path, ["experiment=induction", "dataset.length=1", "dataset.size=4"])
    assert said.startswith("dataset.length: 1: ") and "valid: 2 or more" in said, said


# 6. Rows past the model's positions; sanity on token data; a broken config.json.


def test_a_context_past_the_models_positions_names_dataset_context(tmp_path):
    n_positions = json.loads((TINY_LM / "config.json").read_text())["n_positions"]
    context = n_positions + 44
    said = _refused(tmp_path, ["experiment=lm_cache", f"dataset.context={context}"])
    assert said == (
        f"dataset.context: {context}, past the model's {n_positions} positions (n_positions); "
        f"valid: a context from 2 to {n_positions}"
    )


def test_repeated_rows_past_the_models_positions_name_length_and_repeats(tmp_path):
    config = f"model.config={{{GPT2}, n_head: 2, n_positions: 32}}"
    args = ["experiment=induction", "model=hf", config, "dataset.length=11", "dataset.repeats=3"]
    said = _refused(tmp_path, [*args, "dataset.size=2"])
    assert said.startswith("dataset.length: 11 × dataset.repeats: 3 = 33 tokens a row, past"), said
    assert "the model's 32 positions (n_positions); valid: length × repeats up to 32" in said


def test_a_prompt_past_the_models_positions_names_its_line(tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab"}, {"prompt": "x" * 20}])
    config = f"model.config={{{GPT2}, n_head: 2, n_positions: 16}}"
    said = _refused(tmp_path, ["model=hf", config, "dataset=prompts", f"dataset.path={data}"])
    assert said.startswith(f"dataset.path: the prompt at {data}:2 has 20 tokens, past the"), said
    assert "valid: prompts of up to 16 tokens" in said


def test_rotary_positions_have_no_hard_limit_and_are_not_refused(tmp_path):
    llama = (
        "model.config={model_type: llama, num_hidden_layers: 1, hidden_size: 32, "
        "intermediate_size: 64, num_attention_heads: 2, num_key_value_heads: 1, "
        "vocab_size: 257, max_position_embeddings: 8}"
    )
    args = ["experiment=induction", "model=hf", llama, "dataset.length=6", "dataset.repeats=2"]
    result = run_config(tmp_path / "run", [*args, "dataset.size=2", "render=false"])
    with result.open() as res:
        assert res["samples/tokens"].shape == (2, 12)  # 12 tokens on 8 "positions": fine


@pytest.mark.parametrize(
    ("experiment", "key"), [("sanity_check", "sanity"), ("grad_cam", "derive: grad_cam")]
)
def test_gradient_methods_on_token_data_get_the_embeddings_hint(tmp_path, experiment, key):
    args = [f"experiment={experiment}", "model=tiny_lm", "dataset=repeated_tokens"]
    said = _refused(tmp_path, [*args, "dataset.size=2"])
    assert said.startswith(f"{key}: a language model's input is token ids"), said
    assert said.endswith(EMBEDDINGS_HINT) and "probe" not in said


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("{broken", "is not valid JSON (Expecting property name"),
        ("", "is empty"),
        ("[1, 2]", "holds an array, not a JSON object"),
    ],
)
def test_a_broken_config_json_is_named_not_the_tokenizer(tmp_path, text, what):
    folder = tmp_path / "lm"
    shutil.copytree(TINY_LM, folder)
    (folder / "config.json").write_text(text)
    said = _refused(tmp_path, ["experiment=lm_cache", "model=hf", f"model.path={folder}"])
    assert said.startswith(f"model.path: {folder / 'config.json'} {what}"), said
    assert "valid: a JSON object" in said and "tokenizer" not in said


def test_a_broken_config_json_in_a_tokenizer_folder_is_named(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_LM / name, folder / name)
    (folder / "config.json").write_text("[]")
    config = f"model.config={{{GPT2}, n_head: 2, vocab_size: 2048}}"
    said = _refused(tmp_path, ["model=hf", config, f"model.tokenizer={folder}"])
    assert said.startswith(f"model.tokenizer: {folder / 'config.json'} holds an array"), said


# 7. dataset.size of repeated tokens: checked against the machine's memory before anything
# is allocated; a size that fits draws the same rows as before, in one array.


@pytest.mark.slow
def test_a_repeated_tokens_size_that_cannot_fit_is_refused_by_the_cli(tmp_path):
    said = _cli_refused(tmp_path, ["experiment=induction", "dataset.size=1000000000000"], 120)
    assert re.match(
        r"dataset\.size: 1000000000000 makes the rows \[1000000000000, 50\] of int64 token ids "
        r"need 363\.8 TiB at once, more than this machine's .* of memory; valid: a smaller value$",
        said,
    ), said


def test_repeated_rows_are_the_documented_draws_and_keep_their_fingerprint():
    """Row r's sequence is the r-th `rng.choice(allowed, length, replace=False)` of one
    generator seeded by the run's seed, repeated; the fingerprint hashes the same bytes as
    before (the rows, lengths, reads, labels, then repr of the list of sources), so runs
    started before resume."""
    from hookrun.models.hf import byte_tokenizer

    tok = byte_tokenizer()
    kind = DATASETS.get("repeated_tokens", "dataset")
    cfg = kind.schema(length=7, repeats=3, size=70_000, prepend_bos=True)  # > one block
    data = kind.build(cfg, 11, Tokenizing(tok))
    specials = set(tok.all_special_ids)
    allowed = np.array([i for i in range(len(tok)) if i not in specials], np.int64)
    rng = np.random.default_rng(11)
    drawn = np.stack([rng.choice(allowed, size=7, replace=False) for _ in range(cfg.size)])
    rows = np.concatenate([np.full((cfg.size, 1), tok.bos_token_id), np.tile(drawn, 3)], 1)
    np.testing.assert_array_equal(data.ids.numpy(), rows)
    digest = hashlib.sha256()
    for part in (rows, np.full(cfg.size, 22), np.full(cfg.size, 20), rows[:, -1]):
        digest.update(np.asarray(part, np.int64).tobytes())
    digest.update(repr([("repeated_tokens", r + 1) for r in range(cfg.size)]).encode())
    assert data.fingerprint() == digest.hexdigest()
    assert data.sources[-1] == ("repeated_tokens", cfg.size) and len(data.sources) == cfg.size
    assert data.sources[:2] == [("repeated_tokens", 1), ("repeated_tokens", 2)]
