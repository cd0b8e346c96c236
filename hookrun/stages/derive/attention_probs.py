"""Every layer's attention probabilities of one pass, as attention rollout reads them, with
the model left as it came:

- a Hugging Face language model (hookrun's LanguageModel): its base model called with
  `output_attentions=True` under eager attention — the probabilities its own attention
  multiplies the values with, after the causal and padding masks, for every family
  transformers builds, in layer order, with no module names to find (sdpa and flash never
  form them: the run switches to eager as `at: pattern` does, and `attention_kept` switches
  back at the run's end);
- torchvision's VisionTransformer (any model with `nn.MultiheadAttention` modules):
  forward hooks that recompute softmax(q·kᵀ/√d) from the module's own query and key inputs
  and its in_proj weights. The blocks call it with `need_weights=False`, whose fused path
  returns no weights; the hook changes no argument and returns nothing, so the forward runs
  bit for bit as without it, and `hooked` removes every hook on every exit path.

`run_attention(...)` hands each layer's probabilities (N, heads, T, T) to `take`, in the order the
layers ran, so a caller can fuse a layer's heads before the next layer's are formed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookrun.errors import HookrunError
from hookrun.models.adapter import adapt
from hookrun.runtime.handles import ModuleHook, hooked

__all__ = ["attention_kind", "attention_modules", "run_attention", "self_attention", "NO_ATTENTION"]

# What the refusal of a model without any says it could read instead.
NO_ATTENTION = (
    "valid: torchvision's VisionTransformer (model=torchvision model.name=vit_b_16, any "
    "nn.MultiheadAttention self-attention) or a Hugging Face transformer (model=tiny_lm, "
    "model=hf)"
)

Take = Callable[[torch.Tensor], None]


def attention_modules(model: nn.Module) -> list[str]:
    """The names of the model's `nn.MultiheadAttention` modules, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]


def attention_kind(model: nn.Module, key: str) -> str:
    """`language` (a transformers model behind hookrun's LanguageModel) or `modules`
    (`nn.MultiheadAttention` self-attention); a model with neither refused, in one line."""
    if adapt(model).language is not None:
        return "language"
    if attention_modules(model):
        return "modules"
    raise HookrunError(
        f"{key}: {type(model).__name__} has no attention modules found (no "
        f"nn.MultiheadAttention, and not a Hugging Face transformer); {NO_ATTENTION}"
    )


def run_attention(model: nn.Module, inputs: torch.Tensor, kind: str, key: str, take: Take) -> None:
    """One pass of `model` on `inputs` (images, or token rows (N, 3, T)), each layer's
    probabilities (N, heads, T, T) handed to `take` in the order the layers ran."""
    with torch.no_grad():
        if kind == "language":
            _language(model, inputs, key, take)
        else:
            _modules(model, inputs, key, take)


def _language(model: nn.Module, rows: torch.Tensor, key: str, take: Take) -> None:
    hf = adapt(model).transformers_model()
    base = getattr(hf, "base_model", hf)
    out = base(
        input_ids=rows[:, 0],
        attention_mask=rows[:, 1],
        output_attentions=True,
        use_cache=False,
        return_dict=True,
    )
    found = getattr(out, "attentions", None)
    if not found or any(a is None for a in found):
        running = getattr(getattr(hf, "config", None), "_attn_implementation", None)
        raise HookrunError(
            f"{key}: {type(hf).__name__} returned no attention probabilities under "
            f"{running} attention; valid: a model with eager attention (model.attention=eager)"
        )
    for probs in found:
        take(probs)


def _modules(model: nn.Module, inputs: torch.Tensor, key: str, take: Take) -> None:
    named = dict(model.named_modules())
    hooks = [
        ModuleHook(named[name], _hook(name, key, take), kwargs=True)
        for name in attention_modules(model)
    ]
    with hooked(hooks):
        model(inputs)


def _hook(name: str, key: str, take: Take) -> Callable[..., None]:
    def hook(module: nn.MultiheadAttention, args: tuple, kwargs: dict, output: Any) -> None:
        take(self_attention(module, args, kwargs, f"{key}: {name}"))

    return hook


def self_attention(
    module: nn.MultiheadAttention, args: tuple, kwargs: dict, where: str
) -> torch.Tensor:
    """softmax(q·kᵀ/√d) per head (N, heads, T, S) of one call of `module`, from its query
    and key arguments and its projections, as `F.multi_head_attention_forward` computes
    them when asked for unaveraged weights (q scaled first); what would make them differ
    (a mask, bias_k, add_zero_attn) refused."""
    given = dict(zip(("query", "key", "value"), args, strict=False)) | kwargs
    used = [k for k in ("attn_mask", "key_padding_mask") if given.get(k) is not None]
    used += ["is_causal"] if given.get("is_causal") else []
    used += ["bias_k"] if module.bias_k is not None else []
    used += ["add_zero_attn"] if module.add_zero_attn else []
    if used:
        raise HookrunError(
            f"{where} is called with {', '.join(used)}, which attention rollout does not "
            f"read; valid: self-attention without masks or extra keys (torchvision's ViT)"
        )
    query, keys = given["query"], given["key"]
    if not module.batch_first:  # (T, N, E) → (N, T, E)
        query, keys = query.transpose(0, 1), keys.transpose(0, 1)
    if module._qkv_same_embed_dim:
        w_q, w_k, _ = module.in_proj_weight.chunk(3)
    else:
        w_q, w_k = module.q_proj_weight, module.k_proj_weight
    b_q = b_k = None
    if module.in_proj_bias is not None:
        b_q, b_k, _ = module.in_proj_bias.chunk(3)
    heads, size = module.num_heads, module.head_dim
    n, t, s = query.shape[0], query.shape[1], keys.shape[1]
    q = F.linear(query, w_q, b_q).view(n, t, heads, size).transpose(1, 2)
    k = F.linear(keys, w_k, b_k).view(n, s, heads, size).transpose(1, 2)
    scores = (q * math.sqrt(1.0 / size)) @ k.transpose(-2, -1)
    return torch.softmax(scores.float(), dim=-1)
