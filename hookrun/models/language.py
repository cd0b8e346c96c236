"""A Hugging Face transformers model as a plain module the engine can hook.

`LanguageModel` takes the token sample batch (N, 3, T) int64 of hookrun's token datasets
(row 0 the token ids, row 1 the attention mask, row 2 the read marker: 1 at the one position
whose output is the row's output; padding on the right) and returns the model's output at
each row's read position. It shares the wrapped model's children, so its module names and
state_dict keys are the wrapped model's own (`transformer.h.0.attn`, not
`hf.transformer.h.0.attn`) and selectors written for the Hugging Face model work unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["LanguageModel", "OUTPUT_KINDS"]

# What forward returns for each `model.class`:
#   causal_lm, masked_lm: the logits at the read position (N, V);
#   base: the last hidden state at the read position (N, D);
#   sequence_classification: the classifier's logits (N, C), pooled by the model itself (the
#   first token for BERT, the last non-padding token for GPT-2); the read marker is not used.
OUTPUT_KINDS = ("causal_lm", "masked_lm", "base", "sequence_classification")


class LanguageModel(nn.Module):
    """`hf` (a transformers PreTrainedModel) behind hookrun's token sample interface.

    Attributes: `hf` (the wrapped model, not a child: its children are this module's),
    `tokenizer` (the Hugging Face tokenizer), `config` (the model's config), `kind` (one of
    OUTPUT_KINDS).
    """

    def __init__(self, hf: nn.Module, tokenizer: Any, kind: str = "causal_lm") -> None:
        super().__init__()
        if kind not in OUTPUT_KINDS:
            raise ValueError(f"kind: {kind!r}; valid: {', '.join(OUTPUT_KINDS)}")
        object.__setattr__(self, "hf", hf)  # not registered: the names stay the model's own
        self.tokenizer = tokenizer
        self.kind = kind
        for name, child in hf.named_children():
            self.add_module(name, child)
        for name, param in hf._parameters.items():  # tensors at the root, rare but possible
            self.register_parameter(name, param)
        for name, buf in hf._buffers.items():
            persistent = name not in hf._non_persistent_buffers_set
            self.register_buffer(name, buf, persistent=persistent)

    @property
    def config(self) -> Any:
        return self.hf.config

    def train(self, mode: bool = True) -> LanguageModel:
        super().train(mode)
        self.hf.train(mode)  # the wrapped root's own flag (its children are ours)
        return self

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        # .to()/.half() may replace root tensors: the wrapped model keeps seeing ours.
        for name in list(self.hf._parameters):
            self.hf._parameters[name] = self._parameters[name]
        for name in list(self.hf._buffers):
            self.hf._buffers[name] = self._buffers[name]
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, mask, read = x[:, 0], x[:, 1], x[:, 2]
        out = self.hf(input_ids=ids, attention_mask=mask, return_dict=True, use_cache=False)
        if self.kind == "sequence_classification":
            return out.logits
        states = out.last_hidden_state if self.kind == "base" else out.logits
        position = read.argmax(dim=1)
        return states[torch.arange(states.shape[0], device=states.device), position]

    def extra_repr(self) -> str:
        return f"kind={self.kind}, wraps={type(self.hf).__name__}"
