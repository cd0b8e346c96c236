"""The derived-methods registry: results computed per batch from captured tensors, stored
raw (un-normalised, un-resized) at /derived/<method>/<layer or input>.

A new method is one class registered with `@register_method(name)` in its own module under
hookrun/stages/derive/ (imported by its __init__.py): its `Args` (what
`derive.<name>:` accepts) and `check`, the captures it `requires`, an optional `prepare` on
the model before the first batch, and `compute` on one batch of records. A method that needs
passes of its own over the input (integrated gradients, SmoothGrad) sets `runs_passes` and
implements `passes` on a `BatchContext` instead; the run's hooks stand aside meanwhile. A
method that writes several results from the captures and the batch (the logit lens: the
read marker of token data) sets `reads_batch` and implements `compute_batch`; captures only
its prepared state can name (every block of the model) come from `requires_prepared`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.registry import Registry
from hookrun.runtime.step import BatchContext
from hookrun.typed import Frozen

__all__ = [
    "METHODS",
    "Method",
    "LayerArgs",
    "register_method",
    "Derivation",
    "plan_derivations",
    "derive",
]


@dataclass
class LayerArgs(Frozen):
    layer: str | None = None
    """The module whose captures the method reads (the experiments pass model.cam_layer)."""


class Method:
    """Base class: `name` is the config word under `derive:`, `Args` its arguments."""

    name: ClassVar[str]
    Args: ClassVar[type] = LayerArgs
    # Target kinds the method needs a class for (CAM reads the target's weights).
    needs_class: ClassVar[bool] = False
    # True: the method runs its own forward/backward passes (`passes`), not `compute`.
    runs_passes: ClassVar[bool] = False
    # True: `compute_batch` (the records and the batch → every result by path), not `compute`.
    reads_batch: ClassVar[bool] = False
    # False: its results are a table, not a relevance map (the logit lens): no sanity check
    # or faithfulness metric compares them.
    makes_map: ClassVar[bool] = True
    # True: the method means something on token data (a language model's input is token ids:
    # other gradient methods on the input are refused there, pipeline/tokencheck.py).
    tokens_ok: ClassVar[bool] = False
    # Why the method takes images only, for a method that needs no gradient but runs the
    # model on perturbed images ('' for the others): said where token data is refused.
    perturbs: ClassVar[str] = ""
    # True: the method explains the model's input (BatchContext.explained): on token data it
    # is prepared on, and stores results shaped like, the input embeddings (T, D).
    explains_input: ClassVar[bool] = False
    # A method that stores a completeness gap: what makes it smaller, said in the summary.
    gap_note: ClassVar[str] = ""
    # The experiment whose hooks capture what the method reads (named when they are missing).
    example: ClassVar[str] = "grad_cam"

    @classmethod
    def check(cls, args: Any, key: str) -> None:
        """Refuse bad `args` (HookrunError naming `key.<x>`); called before any work."""

    def requires(self, args: Any) -> list[str]:
        """The capture datasets this method reads."""
        raise NotImplementedError

    def requires_prepared(self, args: Any, state: Any) -> list[str]:
        """The capture datasets the prepared state says the method reads (none by default)."""
        return []

    def prepare(self, args: Any, model: nn.Module, sample: torch.Tensor) -> Any:
        """State computed once from the model before the first batch (None by default)."""
        return None

    def check_captures(self, args: Any, state: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse, before any work, captures it reads whose per-row shapes (`shapes`: path →
        shape, every capture of the run) it cannot read (HookrunError naming the key)."""

    def compute(self, args: Any, state: Any, records: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The result for one batch from its records — the captures it `requires` as the run
        made them (on the run's device, in its dtype), the host copies for anything else."""
        raise NotImplementedError

    def compute_batch(
        self, args: Any, state: Any, records: Mapping[str, torch.Tensor], batch: BatchContext
    ) -> dict[str, torch.Tensor]:
        """A `reads_batch` method's results for one batch, keyed by HDF5 path (host tensors)."""
        raise NotImplementedError

    def passes(self, args: Any, state: Any, batch: BatchContext) -> dict[str, torch.Tensor]:
        """A `runs_passes` method's results for one batch, keyed by HDF5 path (host tensors)."""
        raise NotImplementedError

    def stored_shapes(
        self, args: Any, state: Any, key: str, sample: tuple[int, ...]
    ) -> dict[str, tuple[int, ...]]:
        """Per-sample shape of each dataset the method writes, `key` being its main one and
        `sample` the model input's shape (the dry run's size estimate); by default one
        result shaped like the input."""
        return {key: sample}

    def extra_rows(
        self, args: Any, state: Any, sample: tuple[int, ...]
    ) -> tuple[int, tuple[int, ...]]:
        """(rows its extra passes run per batch row, the shape of one such row) — what
        `internal_batch_size` rows a pass are checked against memory with (`sample`: what
        the method explains per row). `state` is None at config time: a count that needs
        the model or the image is then 1, its lower bound. None by default."""
        return 0, sample

    def check_sizes(self, args: Any, state: Any, rows: int, sample: tuple[int, ...]) -> None:
        """Refuse (memory.check_fits, naming the key) what a batch of `rows` makes the method
        allocate at once beside its passes (masks, coalitions); called before any work."""


METHODS: Registry[Method] = Registry("a method")


def register_method(name: str):
    """Class decorator: register a Method under its `derive:` name."""
    return METHODS.register_class(name)


@dataclass(frozen=True)
class Derivation:
    """One derived result of a run: its method, arguments and prepared state."""

    method: Method
    args: Any
    state: Any = None
    # The shape of what an `explains_input` method explains per sample, where it is not the
    # model input's (a language model's embeddings, (T, D)).
    explained: tuple[int, ...] | None = None

    @property
    def key(self) -> str:
        # Methods that attribute the model input store at /derived/<method>/input.
        return layout.derived_key(self.method.name, getattr(self.args, "layer", None) or "input")

    def stored_shapes(self, sample: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Per-sample shape of each dataset this derivation writes (`sample`: the input's)."""
        shape = self.explained if self.explained is not None else sample
        return self.method.stored_shapes(self.args, self.state, self.key, shape)


def plan_derivations(
    requests: Mapping[str, Any],
    captures: Mapping[str, tuple[int, ...]],
    model: nn.Module,
    sample: torch.Tensor,
    explained: torch.Tensor | None = None,
) -> list[Derivation]:
    """Each requested method (name → parsed Args) against the captures the plan makes
    (path → per-row shape); its state prepared on the model, on `explained` (one sample of
    what the gradient methods explain, when it is not `sample`: a language model's
    embeddings) for those methods."""
    out = []
    for name, args in requests.items():
        method = METHODS.get(name, f"derive.{name}")
        _check_captures(method, method.requires(args), set(captures))
        other = explained is not None and method.explains_input
        state = method.prepare(args, model, explained if other else sample)
        _check_captures(method, method.requires_prepared(args, state), set(captures))
        method.check_captures(args, state, captures)
        shape = tuple(explained.shape) if other else None
        out.append(Derivation(method, args, state, shape))
    return out


def _check_captures(method: Method, needed: list[str], capture_keys: set[str]) -> None:
    missing = [k for k in needed if k not in capture_keys]
    if missing:
        raise HookrunError(
            f"derive.{method.name}: needs the captures {', '.join('/' + k for k in missing)}; "
            f"add hooks that capture them (see conf/experiment/{method.example}.yaml)"
        )


def derive(
    derivations: list[Derivation],
    records: Mapping[str, torch.Tensor],
    batch: BatchContext | None = None,
) -> dict:
    """The derived tensors for one batch of records, keyed by their HDF5 paths; `batch` is
    what methods with passes of their own need."""
    out = {}
    for d in derivations:
        if d.method.runs_passes:
            if batch is None:
                raise RuntimeError(f"{d.method.name} runs passes of its own: needs the batch")
            out.update(d.method.passes(d.args, d.state, batch))
        elif d.method.reads_batch:
            if batch is None:
                raise RuntimeError(f"{d.method.name} reads the batch: needs it")
            out.update(d.method.compute_batch(d.args, d.state, records, batch))
        else:  # computed where the records are (the run's device): stored from the host
            out[d.key] = d.method.compute(d.args, d.state, records).cpu()
    return out
