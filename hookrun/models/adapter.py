"""What a model takes and gives, as the runtime and the stages see it: `adapt(module)` is
the one place that tells a language model (hookrun's LanguageModel around a transformers
model) from an image classifier or a caller's own module. The runtime hooks `module`, calls
it with a batch's inputs (data/batch.py), and asks the adapter where gradients start, what
the gradient methods explain, what the output's columns are and how far positions go.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import torch
from torch import nn

from hookrun.data.batch import Batch
from hookrun.errors import HookrunError
from hookrun.models.language import LanguageModel
from hookrun.models.placement import execution_device

__all__ = ["Adapter", "LanguageAdapter", "adapt"]

# (points, rows) → the model's output for `points`, row i standing for batch row rows[i].
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Adapter:
    """A module called with a batch's inputs (an image classifier, a caller's model):
    gradients start at the input, which is also what the gradient methods explain."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def language(self) -> LanguageModel | None:
        """The language model, for a stage that runs its transformers model itself."""
        return None

    @property
    def tokenizer(self) -> Any:
        return None

    def graph_start(self) -> nn.Module | None:
        """The module whose output starts the gradient graph (None: the input does)."""
        return None

    def explained(self, batch: Batch) -> tuple[torch.Tensor | None, Forward | None]:
        """What the gradient methods explain of `batch` when it is not its inputs, and how
        the model runs on it (None, None: the inputs, through the module)."""
        return None, None

    def explained_sample(self, sample: torch.Tensor) -> torch.Tensor:
        """What the gradient methods explain of one sample."""
        return sample

    def output_names(self) -> Sequence[str] | None:
        """What each column of the output is (None: the classes, unnamed)."""
        return None

    def max_positions(self) -> tuple[int, str] | None:
        """The most tokens a row may have and the key that says so (None: no limit)."""
        return None

    def roots(self) -> list[nn.Module]:
        """Modules outside `module.named_modules()` whose `training` flag the run keeps."""
        return []

    def prefix_tokens(self) -> int | None:
        """The tokens a vision transformer puts before its grid of patches: timm's declared
        `num_prefix_tokens`, else its token parameters (torchvision's `class_token`,
        `cls_token`, `dist_token`, `reg_token`); None where it has none."""
        declared = getattr(self.module, "num_prefix_tokens", None)
        if isinstance(declared, int):
            return declared
        count = 0
        for name, p in self.module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("class_token", "cls_token", "dist_token", "reg_token") and p.dim() == 3:
                count += p.shape[1]
        return count or None

    def transformers_model(self) -> nn.Module | None:
        """The transformers model behind the module, whose attention implementation a
        pattern site switches (None: none)."""
        module = self.module
        return module if hasattr(getattr(module, "config", None), "_attn_implementation") else None

    def use_eager(self) -> str:
        """Switch fused attention (sdpa, flash) to eager, which forms the probabilities a
        pattern site reads; the plan's line saying so ('' when nothing changed)."""
        hf = self.transformers_model()
        config = getattr(hf, "config", None)
        running = getattr(config, "_attn_implementation", None)
        if hf is None or running in (None, "eager"):
            return ""
        switch = getattr(hf, "set_attn_implementation", None)
        if switch is not None:
            with suppress(ValueError, RuntimeError, NotImplementedError):
                switch("eager")
        if getattr(config, "_attn_implementation", None) != "eager":
            raise HookrunError(
                f"at: pattern: the model runs {running} attention, which never forms the "
                f"attention probabilities, and {type(hf).__name__} cannot switch to eager "
                "attention; valid: load the model with attn_implementation='eager'"
            )
        return (
            f"Attention: the model ran {running} attention, which never forms the "
            "probabilities; switched to eager attention for this run (at: pattern)"
        )

    @contextmanager
    def attention_kept(self) -> Iterator[None]:
        """The model leaves with the attention implementation it came with."""
        hf = self.transformers_model()
        running = getattr(getattr(hf, "config", None), "_attn_implementation", None)
        try:
            yield
        finally:
            now = getattr(getattr(hf, "config", None), "_attn_implementation", None)
            if running is not None and now != running and hasattr(hf, "set_attn_implementation"):
                hf.set_attn_implementation(running)


class LanguageAdapter(Adapter):
    """hookrun's LanguageModel: called with token rows; token ids have no gradient, so
    gradients start at the input embeddings' output, which the gradient methods explain."""

    module: LanguageModel

    @property
    def language(self) -> LanguageModel:
        return self.module

    @property
    def tokenizer(self) -> Any:
        return self.module.tokenizer

    def graph_start(self) -> nn.Module:
        return self.module.input_embeddings()

    def explained(self, batch: Batch) -> tuple[torch.Tensor, Forward]:
        model, inputs = self.module, batch.inputs
        with torch.no_grad():
            points = model.embed(inputs)
        return points, lambda p, rows: model.from_embeddings(p, inputs[rows])

    def explained_sample(self, sample: torch.Tensor) -> torch.Tensor:
        if sample.is_floating_point():
            return sample
        with torch.no_grad():
            device = execution_device(self.module.input_embeddings()) or torch.device("cpu")
            return self.module.embed(sample[None].to(device))[0].cpu()

    def output_names(self) -> Sequence[str] | None:
        return self.module.output_names()

    def max_positions(self) -> tuple[int, str] | None:
        return self.module.max_positions()

    def roots(self) -> list[nn.Module]:
        return [self.module.hf]  # the wrapped root: not one of its modules (its children are)

    def transformers_model(self) -> nn.Module:
        return self.module.hf


def adapt(module: nn.Module | None) -> Adapter:
    """The adapter of `module` (a plain one for None: no model)."""
    if isinstance(module, LanguageModel):
        return LanguageAdapter(module)
    return Adapter(module if module is not None else nn.Module())
