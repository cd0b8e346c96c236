"""The shipped model: small, trained (its held-out loss far below an untrained copy's,
computed here with transformers alone), loaded by model=tiny_lm, and the default of
experiment=lm_cache, whose captures equal a hand-written hook loop on it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import numpy as np
import torch
from conftest import run_config

import hookrun

TINY = Path(hookrun.__file__).parent / "models" / "checkpoints" / "tiny_lm"


def _loss(model, tokenizer, texts: list[str], context: int) -> float:
    """Mean next-token cross-entropy over the documents, each cut to `context` tokens."""
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:context]
            if len(ids) < 2:
                continue
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
            target = torch.tensor(ids[1:])
            total += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            count += len(ids) - 1
    return total / count


def test_tiny_lm_is_small_and_trained():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = [f for f in TINY.iterdir() if f.is_file() and f.name != "heldout.jsonl"]
    assert sum(f.stat().st_size for f in files) <= 8 * 2**20
    model = AutoModelForCausalLM.from_pretrained(TINY, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY, local_files_only=True)
    assert model.config.model_type == "gpt2"
    rows = (TINY / "heldout.jsonl").read_text(encoding="utf-8").splitlines()
    texts = [json.loads(r)["text"] for r in rows[:40]]
    trained = _loss(model, tokenizer, texts, 128)
    torch.manual_seed(0)
    untrained = _loss(type(model)(model.config).eval(), tokenizer, texts, 128)
    assert untrained > 0.9 * math.log(len(tokenizer))  # an untrained model guesses
    assert trained < 0.75 * untrained, (trained, untrained)


def test_lm_cache_defaults_run_tiny_lm_and_equal_a_hand_hook_loop(tmp_path):
    from transformers import AutoModelForCausalLM

    result = run_config(tmp_path, ["experiment=lm_cache", "limit=3", "render=false"])
    model = AutoModelForCausalLM.from_pretrained(TINY, local_files_only=True).eval()
    blocks = [f"transformer.h.{i}" for i in range(model.config.n_layer)]
    with h5py.File(result.path) as f:
        tokens = f["samples/tokens"][:]
        stored = [f[f"captures/{b}/output"][:] for b in blocks]
        assert f["samples/path"][0].decode().endswith("heldout.jsonl")
    seen: list[torch.Tensor] = []
    modules = dict(model.named_modules())
    handles = [modules[b].register_forward_hook(lambda m, a, o: seen.append(o)) for b in blocks]
    with torch.no_grad():
        model(input_ids=torch.from_numpy(tokens.astype(np.int64)), use_cache=False)
    for h in handles:
        h.remove()
    for got, want in zip(stored, seen, strict=True):
        assert got.dtype == np.float16
        # float16 storage: equal to the hand loop's values within float16's resolution
        np.testing.assert_allclose(got.astype(np.float32), want.numpy(), rtol=2e-3, atol=2e-3)
