"""LXT 2.1's efficient AttnLRP on a saved Hugging Face GPT-2, Llama, Qwen2 or Gemma 3, run in
.venv-lxt (tests/reference_venvs.py) by tests/lm/test_attnlrp.py: each prompt's relevance per token,
(input embeddings × their gradient) summed over the hidden size, for the answer's logit at
the last token, written as JSON.

Usage: python lxt_script.py FAMILY MODEL_FOLDER ROWS_JSON OUT_JSON, ROWS_JSON a list of
{"ids": [...], "answer": id}.

Two shims, both outside the rules LXT applies, let LXT 2.1 run with transformers 5.24:
- `lxt.efficient` imports its BERT file at package import, and that imports
  `transformers.modeling_attn_mask_utils`, gone in transformers 5: a stand-in module takes
  its place (BERT is not used here).
- `patch_attention` replaces the modeling module's `ALL_ATTENTION_FUNCTIONS` (an
  `AttentionInterface`) with a plain dict of wrapped functions, and transformers 5's attention
  asks it `.get_interface(name, eager_attention_forward)`: the dict is given that method
  (the name's wrapped function, else the default, which LXT wrapped in the module too).
"""

from __future__ import annotations

import json
import sys
import types

import torch


class _Functions(dict):
    def get_interface(self, name, default):
        return self.get(name, default)


def patch(family: str) -> types.ModuleType:
    """LXT 2.1's efficient AttnLRP patched into the family's transformers modeling module
    (with the two shims above); that module. tests/benchmarks/attnlrp.py patches through
    this too, so the benchmark runs LXT as the equality test does."""
    bert = types.ModuleType("lxt.efficient.models.bert")
    bert.modeling_bert, bert.attnLRP = types.ModuleType("modeling_bert_unused"), {}
    sys.modules["lxt.efficient.models.bert"] = bert
    from lxt.efficient import monkey_patch

    if family == "gpt2":
        from transformers.models.gpt2 import modeling_gpt2 as modeling
    elif family == "gemma3_text":
        from transformers.models.gemma3 import modeling_gemma3 as modeling
    elif family == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as modeling
    else:
        from transformers.models.llama import modeling_llama as modeling
    monkey_patch(modeling)
    modeling.ALL_ATTENTION_FUNCTIONS = _Functions(modeling.ALL_ATTENTION_FUNCTIONS)
    return modeling


def main() -> None:
    family, folder, rows_path, out_path = sys.argv[1:5]
    from transformers import AutoModelForCausalLM

    patch(family)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    out = []
    with open(rows_path) as f:
        rows = json.load(f)
    for row in rows:
        ids = torch.tensor([row["ids"]])
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds, use_cache=False).logits[0, -1]
        logits[row["answer"]].backward()
        relevance = (embeds * embeds.grad).sum(-1)[0]
        out.append({"relevance": relevance.tolist(), "logit": logits[row["answer"]].item()})
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
