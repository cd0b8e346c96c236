"""Small Hugging Face language models for the tests, saved as `save_pretrained` writes them:
four families (GPT-2, Llama, GPT-NeoX, BERT), random seeded weights, and a byte-level BPE
tokenizer trained on a few sentences — nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = {
    "gpt2": (
        "causal_lm",
        {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64},
        "transformer.h.{}",
    ),
    "llama": (
        "causal_lm",
        {
            "model_type": "llama",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 64,
        },
        "model.layers.{}",
    ),
    "gpt_neox": (
        "causal_lm",
        {
            "model_type": "gpt_neox",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "max_position_embeddings": 64,
        },
        "gpt_neox.layers.{}",
    ),
    "bert": (
        "masked_lm",
        {
            "model_type": "bert",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "max_position_embeddings": 64,
        },
        "bert.encoder.layer.{}",
    ),
}
SENTENCES = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Hooks capture activations of every block.",
    "def add(a, b): return a + b",
]
EOT = "<|endoftext|>"


def tokenizer():
    """A byte-level BPE tokenizer (about 300 tokens) with one special token for bos/eos/pad."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(SENTENCES * 4, vocab_size=300, min_frequency=1, special_tokens=[EOT])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token=EOT, eos_token=EOT, pad_token=EOT
    )


def save_lm(folder: Path, family: str, seed: int = 0, **config_changes):
    """The family's model with seeded random weights and the tokenizer, saved to `folder`;
    the model (eval mode) and the model.class hookrun needs for it. `config_changes`:
    config values other than the family's here."""
    import transformers

    kind, config, _ = FAMILIES[family]
    tok = tokenizer()
    cfg = transformers.AutoConfig.for_model(**(config | config_changes), vocab_size=len(tok) + 4)
    cfg.pad_token_id = tok.pad_token_id
    auto = transformers.AutoModelForMaskedLM if kind == "masked_lm" else None
    auto = auto or transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    model = auto.from_config(cfg, attn_implementation="eager").eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model, kind


def prompt_run(folder: Path, kind: str, data: Path) -> list[str]:
    """The overrides of a run of the model saved in `folder` (model.class `kind`) on the
    prompts file `data`, batches of 3, no pictures; callers add their hooks."""
    return [
        "model=hf",
        f"model.path={folder}",
        f"model.class={kind}",
        "dataset=prompts",
        f"dataset.path={data}",
        "batch_size=3",
        "render=false",
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
