"""The derived-methods registry: results computed per batch from captured tensors.

They are stored raw (un-normalised, un-resized) at /derived/<method>/<layer or input>.

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
    """The `derive.<name>:` arguments of a method that reads one layer's captures."""

    layer: str | None = None
    """The module whose captures the method reads (the experiments pass model.cam_layer)."""


class Method:
    """Base class of a derived method: `name` is its word under `derive:`, `Args` its args.

    A subclass is registered with `@register_method(name)`, which makes the one instance
    the run uses (and sets `name`). It says which captures it reads (`requires`) and
    computes one batch's result from them (`compute`); or, with `runs_passes`, runs passes
    of its own (`passes`); or, with `reads_batch`, writes several results from the captures
    and the batch (`compute_batch`). The class variables say what data and targets it
    takes.
    """

    name: ClassVar[str]
    Args: ClassVar[type] = LayerArgs
    # Target kinds the method needs a class for (CAM reads the target's weights).
    needs_class: ClassVar[bool] = False
    # True: the method runs its own forward/backward passes (`passes`), not `compute`.
    runs_passes: ClassVar[bool] = False
    # False: a method with passes of its own that explains no target (attention rollout):
    # target.kind=none is fine for it.
    needs_target: ClassVar[bool] = True
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
    # What its gap is, said in the summary (integrated gradients': against f(x) - f(x')).
    gap_meaning: ClassVar[str] = "sum of attributions minus f(x) - f(baseline)"
    # The experiment whose hooks capture what the method reads (named when they are missing).
    example: ClassVar[str] = "grad_cam"

    @classmethod
    def check(cls, args: Any, key: str) -> None:
        """Refuse bad `args`; called before any work. By default every `Args` is fine.

        Args:
            args: The parsed `Args`.
            key: The method's key (`derive.<name>`), to name `key.<x>` in the error.

        Raises:
            HookrunError: An argument is out of range or conflicts with another.
        """

    @classmethod
    def complete(cls, args: Any, dataset: Any) -> Any:
        """`args` with what the dataset's config decides filled in, before `check`.

        Args:
            args: The parsed `Args`.
            dataset: The parsed dataset kind's config (its `mean`, `std`, ...), or None.

        Returns:
            The arguments to use; by default `args` as they are.
        """
        return args

    def describe(self, args: Any, state: Any) -> list[str]:
        """Lines of the dry run beyond its datasets (what it applies where); none by default."""
        return []

    def requires(self, args: Any) -> list[str]:
        """The capture datasets this method reads.

        Args:
            args: The parsed `Args`.

        Returns:
            Their paths (`captures/<layer>/<site>`); the run refuses to start without them.

        Raises:
            NotImplementedError: The base class reads nothing it could name.
        """
        raise NotImplementedError

    def requires_prepared(self, args: Any, state: Any) -> list[str]:
        """The capture datasets the prepared state says the method reads.

        Args:
            args: The parsed `Args`.
            state: What `prepare` returned.

        Returns:
            Their paths; none by default.
        """
        return []

    def prepare(self, args: Any, model: nn.Module, sample: torch.Tensor) -> Any:
        """State computed once from the model before the first batch.

        Args:
            args: The parsed `Args`.
            model: The run's model.
            sample: One row of what the method explains (the input, or a language model's
                embeddings).

        Returns:
            Its state, handed to every later call; None by default.
        """
        return None

    def check_captures(self, args: Any, state: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse, before any work, captures it reads whose per-row shapes it cannot read.

        Args:
            args: The parsed `Args`.
            state: What `prepare` returned.
            shapes: Every capture of the run: path → per-row shape.

        Raises:
            HookrunError: A capture of a shape the method cannot read; names the key.
        """

    def compute(self, args: Any, state: Any, records: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The result for one batch from its records.

        Args:
            args: The parsed `Args`.
            state: What `prepare` returned.
            records: The captures it `requires` as the run made them (on the run's device,
                in its dtype), the host copies for anything else; by path.

        Returns:
            The batch's result, one row per sample, stored at `derived/<name>/<layer>`.

        Raises:
            NotImplementedError: A method with `runs_passes` or `reads_batch` has none.
        """
        raise NotImplementedError

    def compute_batch(
        self, args: Any, state: Any, records: Mapping[str, torch.Tensor], batch: BatchContext
    ) -> dict[str, torch.Tensor]:
        """A `reads_batch` method's results for one batch.

        Args:
            args: The parsed `Args`.
            state: What `prepare` returned.
            records: The batch's records, by path.
            batch: The batch as a method with passes of its own sees it.

        Returns:
            HDF5 path → host tensor.

        Raises:
            NotImplementedError: Only a `reads_batch` method has it.
        """
        raise NotImplementedError

    def gives_output(self, args: Any, state: Any) -> bool:
        """Whether `passes` forwards the batch as the model does and takes the targets.

        Its forward of the batch is unperturbed, its output the model's own value for value,
        and it asks `batch.choose` for the targets when `batch.targets` is None: the run then
        makes no forward of its own for the batch (Plan.gives_output).

        Args:
            args: The parsed `Args`.
            state: What `prepare` returned.

        Returns:
            False by default.
        """
        return False

    def passes(self, args: Any, state: Any, batch: BatchContext) -> dict[str, torch.Tensor]:
        """A `runs_passes` method's results for one batch, from passes of its own.

        Args:
            args: The parsed `Args`.
            state: What `prepare` returned.
            batch: The batch: its inputs, targets and model, to run passes on.

        Returns:
            HDF5 path → host tensor.

        Raises:
            NotImplementedError: Only a `runs_passes` method has it.
        """
        raise NotImplementedError

    def stored_shapes(
        self, args: Any, state: Any, key: str, sample: tuple[int, ...]
    ) -> dict[str, tuple[int, ...]]:
        """Per-sample shape of each dataset the method writes (the dry run's size estimate).

        Args:
            args: The parsed `Args`.
            state: What `prepare` returned.
            key: Its main dataset's path.
            sample: The model input's shape per sample.

        Returns:
            Path → per-sample shape; by default one result shaped like the input.
        """
        return {key: sample}

    def extra_rows(
        self, args: Any, state: Any, sample: tuple[int, ...]
    ) -> tuple[int, tuple[int, ...]]:
        """The rows its extra passes run per batch row, checked against memory.

        `internal_batch_size` rows a pass are checked with this.

        Args:
            args: The parsed `Args`.
            state: What `prepare` returned; None at config time, where a count that needs
                the model or the image is 1, its lower bound.
            sample: What the method explains per row.

        Returns:
            (rows per batch row, the shape of one such row); (0, sample) by default.
        """
        return 0, sample

    def check_sizes(self, args: Any, state: Any, rows: int, sample: tuple[int, ...]) -> None:
        """Refuse what a batch of `rows` makes the method allocate at once beside its passes.

        Masks and coalitions, say; called before any work.

        Args:
            args: The parsed `Args`.
            state: What `prepare` returned.
            rows: The batch's rows.
            sample: What the method explains per row.

        Raises:
            HookrunError: It would not fit (memory.check_fits, naming the key).
        """


METHODS: Registry[Method] = Registry("a method")


def register_method(name: str):
    """Class decorator: register a Method under its `derive:` name.

    Args:
        name: The word under `derive:`; the class's `name` is set to it.

    Returns:
        The decorator, which registers one instance of the class and returns the class.

    Raises:
        ValueError: (from the decorator) another method has that name already.
    """
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
        """Its main dataset's path, `derived/<method>/<layer or input>`."""
        # Methods that attribute the model input store at /derived/<method>/input.
        return layout.derived_key(self.method.name, getattr(self.args, "layer", None) or "input")

    def stored_shapes(self, sample: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Per-sample shape of each dataset this derivation writes.

        Args:
            sample: The model input's shape per sample.

        Returns:
            Path → per-sample shape.
        """
        shape = self.explained if self.explained is not None else sample
        return self.method.stored_shapes(self.args, self.state, self.key, shape)


def plan_derivations(
    requests: Mapping[str, Any],
    captures: Mapping[str, tuple[int, ...]],
    model: nn.Module,
    sample: torch.Tensor,
    explained: torch.Tensor | None = None,
) -> list[Derivation]:
    """Each requested method checked against the captures the plan makes, its state prepared.

    Args:
        requests: Method name → parsed Args.
        captures: Every capture of the run: path → per-row shape.
        model: The run's model, which each method prepares on.
        sample: One row of the model's input.
        explained: One sample of what the gradient methods explain, when it is not
            `sample` (a language model's embeddings); those methods prepare on it.

    Returns:
        One Derivation per request, in order.

    Raises:
        HookrunError: An unknown method (with the near match), missing captures, or
            captures of a shape the method cannot read.
    """
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
    """The derived tensors for one batch of records.

    Args:
        derivations: What `plan_derivations` returned.
        records: The batch's records, by path.
        batch: What methods with passes of their own, or reading the batch, need.

    Returns:
        HDF5 path → host tensor.

    Raises:
        RuntimeError: A method needs `batch` and none was given.
    """
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
