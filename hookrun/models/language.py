"""A Hugging Face transformers model as a plain module the engine can hook.

`LanguageModel` takes the token sample batch (N, 3, T) int64 of hookrun's token datasets
(row 0 the token ids, row 1 the attention mask, row 2 the read marker: 1 at the one position
whose output is the row's output; padding on the right) and returns the model's output at
each row's read position. It shares the wrapped model's children, so its module names and
state_dict keys are the wrapped model's own (`transformer.h.0.attn`, not
`hf.transformer.h.0.attn`) and selectors written for the Hugging Face model work unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from hookrun.errors import HookrunError

__all__ = ["LanguageModel", "OUTPUT_KINDS", "check_tokenizer", "vocabulary_texts"]

# What forward returns for each `model.class`:
#   causal_lm, masked_lm: the logits at the read position (N, V);
#   base: the last hidden state at the read position (N, D);
#   sequence_classification: the classifier's logits (N, C), pooled by the model itself (the
#   first token for BERT, the last non-padding token for GPT-2); the read marker is not used.
OUTPUT_KINDS = ("causal_lm", "masked_lm", "base", "sequence_classification")
# Learned position embeddings (an nn.Embedding, one row a position), by the last part of
# their module name, and the config keys that size them.
_POSITION_MODULES = ("wpe", "position_embeddings", "embed_positions")
_POSITION_KEYS = ("n_positions", "max_position_embeddings", "n_ctx")


class LanguageModel(nn.Module):
    """`hf` (a transformers PreTrainedModel) behind hookrun's token sample interface.

    Attributes: `hf` (the wrapped model, not a child: its children are this module's),
    `tokenizer` (the Hugging Face tokenizer), `config` (the model's config), `kind` (one of
    OUTPUT_KINDS).
    """

    def __init__(self, hf: nn.Module, tokenizer: Any, kind: str = "causal_lm") -> None:
        super().__init__()
        if kind not in OUTPUT_KINDS:
            raise HookrunError(
                f"model: LanguageModel's kind is {kind!r}; valid: {', '.join(OUTPUT_KINDS)}"
            )
        object.__setattr__(self, "hf", hf)  # not registered: the names stay the model's own
        self.tokenizer = tokenizer  # checked: see the property
        self.kind = kind
        # Causal LMs that take `logits_to_keep` (transformers ≥ 4.45) unembed only the read
        # positions: the rest of the (N, T, V) logits are never read.
        takes = "logits_to_keep" in inspect.signature(hf.forward).parameters
        head = hf.get_output_embeddings() if takes and kind == "causal_lm" else None
        object.__setattr__(self, "head", head)  # not registered: it is a child already
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

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer token data is read with (None: the caller's own token
        tensors only)."""
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        check_tokenizer(tokenizer)
        object.__setattr__(self, "_tokenizer", tokenizer)

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

    def max_positions(self) -> tuple[int, str] | None:
        """The most tokens a row may have, and the config key that sets it: the rows of the
        model's learned position embedding (GPT-2's wpe, BERT's position_embeddings, OPT's
        embed_positions less its offset); None where positions have no hard limit (rotary,
        ALiBi, relative: Llama, GPT-NeoX, ...)."""
        for name, module in self.hf.named_modules():
            if name.rsplit(".", 1)[-1] in _POSITION_MODULES and isinstance(module, nn.Embedding):
                rows = module.num_embeddings - int(getattr(module, "offset", 0) or 0)
                keys = [k for k in _POSITION_KEYS if getattr(self.config, k, None) == rows]
                return rows, keys[0] if keys else f"the {rows} rows of {name}"
        return None

    def forward(self, x: torch.Tensor | None = None, **hf_kwargs: Any) -> Any:
        """The output at each row's read position of the token sample batch `x`; without
        `x`, the wrapped model's own output for `hf_kwargs` (a stage's passes: generation's
        steps, the metrics' logits), called through this module so that what hooks the
        model's root (function sites, the run's hooks on it) sees those passes too."""
        if x is None:
            return self.hf(**hf_kwargs)
        return self._output(x, input_ids=x[:, 0])

    def input_embeddings(self) -> nn.Module:
        """The module turning token ids into vectors: where gradients start (token ids have
        none)."""
        return self.hf.get_input_embeddings()

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The input embeddings (N, T, D) of the token sample batch `x`: the input the
        gradient methods explain."""
        return self.input_embeddings()(x[:, 0])

    def from_embeddings(self, embeds: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The output for input embeddings `embeds` (N, T, D) in place of the token ids of
        `x` (N, 3, T), whose mask and read marker it keeps."""
        return self._output(x, inputs_embeds=embeds)

    def _output(self, x: torch.Tensor, **given: torch.Tensor) -> torch.Tensor:
        mask, read = x[:, 1], x[:, 2]
        position = read.argmax(dim=1)
        rows = torch.arange(x.shape[0], device=x.device)
        extra: dict[str, Any] = {}
        if self.head is not None and not _watched(self.head):
            keep = torch.unique(position)  # sorted: the read position's column in the kept
            extra["logits_to_keep"] = keep
            position = torch.searchsorted(keep, position)
        out = self.hf(attention_mask=mask, return_dict=True, use_cache=False, **given, **extra)
        if self.kind == "sequence_classification":
            return out.logits
        states = out.last_hidden_state if self.kind == "base" else out.logits
        return states[rows, position]

    def output_names(self) -> Sequence[str] | None:
        """What each column of the output is, for the run summary: the vocabulary's tokens
        as text (decoded when asked, so a large vocabulary costs nothing), or a
        classifier's labels; None for a base model's hidden state."""
        if self.kind == "sequence_classification":
            labels = getattr(self.config, "id2label", None) or {}
            return [str(labels.get(i, f"class {i}")) for i in range(len(labels))] or None
        if self.kind == "base" or self.tokenizer is None:
            return None
        return _TokenNames(self.tokenizer, int(self.config.vocab_size))

    def extra_repr(self) -> str:
        return f"kind={self.kind}, wraps={type(self.hf).__name__}"


def check_tokenizer(tokenizer: Any) -> None:
    """Refuse a tokenizer hookrun cannot read text with: valid are a transformers tokenizer
    (PreTrainedTokenizerBase: AutoTokenizer.from_pretrained(DIR)) and None."""
    if tokenizer is None:
        return
    from transformers import PreTrainedTokenizerBase  # a LanguageModel wraps a transformers one

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return
    text = repr(tokenizer)
    given = f"a {type(tokenizer).__qualname__} ({text[:60]}{'...' if len(text) > 60 else ''})"
    hint = ""
    if type(tokenizer).__module__.split(".")[0] == "tokenizers":
        hint = "; a tokenizers.Tokenizer wrapped: PreTrainedTokenizerFast(tokenizer_object=...)"
    raise HookrunError(
        f"model: LanguageModel's tokenizer is {given}; valid: a transformers tokenizer "
        f"(PreTrainedTokenizerBase, e.g. AutoTokenizer.from_pretrained(DIR)){hint}, or None"
    )


def _watched(head: nn.Module) -> bool:
    """Whether anything hooks the unembedding (a capture of its output, a gradient site,
    a global module hook): then it runs on every position, as the wrapped model runs it."""
    own = (
        head._forward_hooks,
        head._forward_pre_hooks,
        head._backward_hooks,
        head._backward_pre_hooks,
    )
    global_hooks = (
        module_hooks._global_forward_hooks,
        module_hooks._global_forward_pre_hooks,
        module_hooks._global_backward_hooks,
        module_hooks._global_backward_pre_hooks,
    )
    return any(own) or any(global_hooks)


class _TokenNames(Sequence):
    """`token <id> '<text>'` for each id of a vocabulary, decoded on demand."""

    def __init__(self, tokenizer: Any, size: int) -> None:
        self.tokenizer, self.size = tokenizer, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.size))]
        return f"token {i} {self.tokenizer.decode([i])!r}"


def vocabulary_texts(tokenizer: Any, size: int) -> list[str]:
    """Each of `size` token ids' text as `tokenizer` decodes it alone ('' past the
    tokenizer's own tokens: a model's vocabulary may be padded beyond them)."""
    known = min(size, len(tokenizer))
    texts = tokenizer.batch_decode([[i] for i in range(known)])
    return [*texts, *[""] * (size - known)]
