"""What a hook does to the tensor at its site: record it, change it, or both.

Each action is a small class with typed arguments. The same action works at a forward site
(it sees an activation) and at a gradient site (it sees a gradient). `apply` returns the
tensor that continues the computation; a capture returns its input unchanged.

Two facts of an action are separate: whether it changes the value at its site (`changes`)
and what it records (`outputs`: named tensors with their paths, shapes, axis names, float
and storage, which the plan, the dry run, the file's layout, resume, verify and the
torchrun join learn from it). A capture records its site and changes nothing; `scale`
changes it and records nothing; a dictionary's splice (runtime/splice.py) does both,
recording tensors of other shapes at paths of their own.

A new action is one class here, registered with `@_action(name)` (from outside:
`ACTIONS.register(name)` on a subclass that sets `name`); its `Args` dataclass is what
`args:` accepts, and `check()` what it refuses before any work.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F

from hookrun.errors import HookrunError
from hookrun.memory import check_fits
from hookrun.registry import Registry
from hookrun.runtime.positions import Positions, parse_heads, parse_positions
from hookrun.runtime.vectors import digests, parse_vector, read_vector
from hookrun.typed import check_finite, parse_typed

__all__ = [
    "SiteContext",
    "Output",
    "Action",
    "Capture",
    "Scale",
    "Add",
    "Clamp",
    "Zero",
    "Noise",
    "AblateDirection",
    "ACTIONS",
    "build_action",
]


class SiteContext(Protocol):
    """What an action may use at the moment it runs."""

    def record(self, tensor: torch.Tensor, path: str | None = None) -> None:
        """Store `tensor` for the current batch at `path`.

        `path` is one of the action's `outputs` (None: the site's own capture path, `key`).
        """

    def generator(self, device: torch.device) -> torch.Generator:
        """A random generator seeded for this hook and batch (same seed → same numbers)."""

    @property
    def rows(self) -> torch.Tensor:
        """The dataset index (N,) of each row of the current batch."""

    @property
    def key(self) -> str:
        """The capture path of the tensor it acts on (the same at every decoding step)."""

    def on_gradient(self, tensor: torch.Tensor, fn: Any) -> None:
        """Call `fn(grad)` when the run's backward pass reaches `tensor`.

        `grad` is the gradient of the run's target with respect to `tensor`, a tensor the
        action made.
        """

    @property
    def inputs(self) -> torch.Tensor | None:
        """At a module's output: the call's first floating-point input, else None.

        What a transcoder reads.
        """


@dataclass(frozen=True)
class Output:
    """One tensor an action records per sample at one site.

    Attributes:
        path: Its path in captures.h5 (a capture's: the site's own, `captures/<layer>/<site>`).
        shape: One sample's row.
        dims: The names of its axes after the sample axis (None: named from its shape as a
            capture's are, io/dimensions.py).
        dtype: The float it is stored in (None: sink.dtype).
        sparse: Stored as its non-zero values with their indices along the last axis
            (io/sparse.py): bytes in proportion to the non-zeros, not the width.
    """

    path: str
    shape: tuple[int, ...]
    dims: tuple[str, ...] | None = None
    dtype: str | None = None
    sparse: bool = False


class Action:
    """Base class of a hook's action: what it does to the tensor at its site.

    A subclass sets `name` (the config word, `action: clamp`) and `Args` (the dataclass of
    its `args:`, parsed by `build_action`), overrides `apply` and, where it refuses some
    arguments, `check`; one that records overrides `outputs` and sets `stores`.
    `args.positions`, `args.heads` and `args.dtype` are common to all (`CommonArgs`) and land
    in `positions`, `heads` and `dtype`.

    Attributes:
        args: The parsed `Args`.
        changes: Whether it changes the value at its site (a capture does not): only those
            act in a stage's own passes (a decoding step, the unhooked comparison), and only
            those are limited to a site's first input.
        stores: Whether it can record (`outputs`): only those take `args.dtype`.
        reads_rows: Whether it puts stored rows in per sample (`patch`): it needs a site
            with one row per sample, and takes no `args.positions`.
    """

    name: ClassVar[str]
    Args: ClassVar[type]
    changes: bool = True
    stores: ClassVar[bool] = False
    # Puts stored rows in per sample (patch): needs a site with one row per sample.
    reads_rows: ClassVar[bool] = False
    # `args.positions` on token data (runtime/positions.py): where along the tokens it acts.
    positions: Positions | None = None
    # `args.heads` at a pattern site (runtime/pattern.py): the heads it acts on (None: all).
    heads: tuple[int, ...] | None = None
    # `args.dtype` of a capture: the float its tensors are stored in (None: sink.dtype).
    dtype: str | None = None

    def __init__(self, args: Any) -> None:
        """Keep the parsed arguments; `build_action` makes actions, checked.

        Args:
            args: An instance of the class's `Args`.
        """
        self.args = args

    @classmethod
    def check(cls, args: Any, key: str) -> None:
        """Refuse bad `args`; called before any work. By default every `Args` is fine.

        Args:
            args: The parsed `Args`.
            key: The hook's key (`hooks.<name>`), to name `key.args.<x>` in the error.

        Raises:
            HookrunError: An argument is out of range or conflicts with another.
        """

    def prepare(
        self, shape: tuple[int, ...], site: str, key: str, rows: int, measured: Any = None
    ) -> None:
        """Check against the model, before any work: once per site the shape probe saw.

        Args:
            shape: The site's tensor per sample.
            site: Its capture path (`captures/<layer>/<site>`).
            key: The hook's key, for errors.
            rows: The run covers dataset rows 0..rows-1.
            measured: What the run's model read for its vector sources (runtime/vectors.py).

        Raises:
            HookrunError: The action cannot act on this site.
        """

    @property
    def records(self) -> bool:
        """Whether it records anything (by default: whether it can)."""
        return self.stores

    @property
    def needs_gradient(self) -> bool:
        """Whether it records a gradient of its own at a forward site (`ctx.on_gradient`).

        The run then has a backward pass from its target. False by default.
        """
        return False

    def outputs(self, shape: tuple[int, ...], site: str, key: str) -> dict[str, Output]:
        """What it records at one site, before any work.

        Args:
            shape: The site's tensor per sample (at `args.positions`, what they pick).
            site: The site's capture path (`captures/<layer>/<site>`).
            key: The hook's key, for errors.

        Returns:
            Path → Output of each tensor it records there; {} by default.

        Raises:
            HookrunError: It cannot record at this site.
        """
        return {}

    def place(self, model: Any, site: Any, key: str) -> tuple[str, ...] | None:
        """The modules it acts on when its hook selects none (a dictionary names its own).

        Args:
            model: The run's model.
            site: The hook's `at`.
            key: The hook's key, for errors.

        Returns:
            Module names; None by default (a hook must then select its modules).

        Raises:
            HookrunError: What it names does not exist in the model.
        """
        return None

    def bind(self, model: Any, layers: tuple[str, ...], site: Any, key: str) -> None:
        """Check against the model once its modules are selected, before the probe.

        Args:
            model: The run's model.
            layers: The modules the hook selected.
            site: The hook's `at`.
            key: The hook's key, for errors.

        Raises:
            HookrunError: The action cannot act on those modules.
        """

    def claims(self) -> tuple[str, ...]:
        """What it records at a site, by kind.

        Two hooks claiming one kind at one site are refused before any work (two captures
        of one output).

        Returns:
            The kinds; () by default.
        """
        return ()

    def apply(self, tensor: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
        """Act on the tensor at the site: the one subclasses must write.

        Args:
            tensor: The activation (forward site) or gradient (gradient site).
            ctx: What the action may use as it runs: record, generator, rows, key.

        Returns:
            The tensor that continues the computation (a capture: `tensor` itself).

        Raises:
            NotImplementedError: The base class does nothing.
        """
        raise NotImplementedError

    def sources(self) -> dict[str, str]:
        """Files the action reads, recorded in the run's provenance.

        Returns:
            {"file": path, "sha256": digest} of each; {} by default.
        """
        return {}

    def describe(self) -> str:
        """How the plan prints this action, e.g. `clamp{min=0.0}`.

        Returns:
            Its name and the arguments that are set.
        """
        items = ", ".join(f"{k}={v}" for k, v in vars(self.args).items() if v is not None)
        if self.positions is not None:
            items = ", ".join(filter(None, (items, f"positions={self.positions.describe()}")))
        if self.heads is not None:
            items = ", ".join(filter(None, (items, f"heads={list(self.heads)}")))
        if self.dtype is not None:
            items = ", ".join(filter(None, (items, f"dtype={self.dtype}")))
        return f"{self.name}{{{items}}}" if items else self.name


@dataclass
class CommonArgs:
    """The `args:` every action takes beside its own `Args`, parsed by build_action."""

    positions: Any = None
    """On token data (runtime/positions.py): where along the tokens the action acts, e.g. last
    or a list of positions; null: every position."""
    heads: Any = None
    """At an attention pattern site (runtime/pattern.py): the heads it acts on; null: all."""
    dtype: str | None = None
    """A capture's storage float (float32, float16, bfloat16); null: sink.dtype."""


@dataclass
class NoArgs:
    """An action with no arguments of its own (zero)."""


@dataclass
class CaptureArgs:
    """The `args:` of capture."""

    pool: str | None = None
    """Store pooled feature maps instead of whole ones: avg | max (adaptive), to size x size."""
    size: int = 1
    """With `pool`: the side of the pooled map (size x size)."""


@dataclass
class ScaleArgs:
    """The `args:` of scale."""

    factor: float = 1.0
    """The site's tensor is multiplied by this."""


@dataclass
class AddArgs:
    """The `args:` of add."""

    value: float = 0.0
    """A number added to every element of the site's tensor (without `vector`)."""
    vector: Any = None
    """A direction added along the site's last axis, `scale` times (runtime/vectors.py);
    `normalize`: at unit length first.
    """
    scale: float = 1.0
    """Times `vector` when it is added."""
    normalize: bool = False
    """Scale `vector` to unit length before it is added."""


@dataclass
class AblateArgs:
    """The `args:` of ablate_direction."""

    vector: Any = None
    """The direction removed (runtime/vectors.py)."""


@dataclass
class ClampArgs:
    """The `args:` of clamp."""

    min: float | None = None
    """Values below this are raised to it; null: no lower bound."""
    max: float | None = None
    """Values above this are lowered to it; null: no upper bound."""


@dataclass
class NoiseArgs:
    """The `args:` of noise."""

    std: float = 1.0
    """Standard deviation of the Gaussian noise added (seeded per row)."""


ACTIONS: Registry[type[Action]] = Registry("an action")


def _action(name: str):
    """Register an Action class under its config word."""

    def add(cls: type[Action]) -> type[Action]:
        cls.name = name
        return ACTIONS.register(name)(cls)

    return add


@_action("capture")
class Capture(Action):
    """Store the tensor in captures.h5, a copy, so later in-place ops cannot change it.

    With `pool`, feature maps (C, H, W) or sequences (C, L) are first pooled adaptively to
    `size` per spatial axis: what extraction jobs that want pooled vectors store.
    """

    Args, changes, stores = CaptureArgs, False, True

    def apply(self, tensor: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
        """Record the tensor (pooled with `pool`) and return it unchanged."""
        ctx.record(self._pooled(tensor) if self.args.pool else tensor)
        return tensor

    def outputs(self, shape: tuple[int, ...], site: str, key: str) -> dict[str, Output]:
        """The site's own tensor (pooled with `pool`), at its capture path."""
        return {site: Output(site, self.stored_shape(shape, key), dtype=self.dtype)}

    def claims(self) -> tuple[str, ...]:
        """The site's tensor itself."""
        return ("capture",)

    def _pooled(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            value = tensor.detach()
            if value.dim() == 4:
                pool = F.adaptive_avg_pool2d if self.args.pool == "avg" else F.adaptive_max_pool2d
            else:
                pool = F.adaptive_avg_pool1d if self.args.pool == "avg" else F.adaptive_max_pool1d
            return pool(value, self.args.size)

    def stored_shape(self, shape: tuple[int, ...], key: str) -> tuple[int, ...]:
        """The per-sample shape stored for a tensor of per-sample `shape`.

        Args:
            shape: The site's tensor per sample.
            key: The hook's key, for errors.

        Returns:
            `shape`, or with `pool` (C, size, ...).

        Raises:
            HookrunError: `pool` on a tensor that is not (C, H, W) or (C, L), or a pooled
                row too large.
        """
        if not self.args.pool:
            return shape
        if len(shape) not in (2, 3):
            raise HookrunError(
                f"{key}.args.pool: {key.split('.')[-1]} captures a tensor of per-sample shape "
                f"{list(shape)}; pooling needs feature maps (C, H, W) or sequences (C, L)"
            )
        pooled = (shape[0], *([self.args.size] * (len(shape) - 1)))
        what = f"one pooled row {list(pooled)}"
        check_fits(f"{key}.args.size", self.args.size, 4 * math.prod(pooled), what)
        return pooled

    @classmethod
    def check(cls, args: CaptureArgs, key: str) -> None:
        """Refuse a `pool` other than avg, max or null, and a `size` below 1."""
        if args.pool is None:
            return
        if args.pool not in ("avg", "max"):
            raise HookrunError(f"{key}.args.pool: {args.pool!r}; valid: avg, max, null")
        if args.size < 1:
            raise HookrunError(f"{key}.args.size: {args.size} is out of range; valid: >= 1")


@_action("scale")
class Scale(Action):
    """Multiply by `factor` (the seeds' `2 * grad`)."""

    Args = ScaleArgs

    def apply(self, tensor: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
        """The tensor times `factor`."""
        return tensor * self.args.factor


class _Directed(Action):
    """An action along a vector of the site's last axis, read before any work.

    One vector for every site, or each site's own where it was measured there (a prompts
    source).
    """

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.source = None if args.vector is None else parse_vector(args.vector, "vector")
        self.vectors: dict[str, torch.Tensor] = {}  # capture path → direction, float64
        self.digests: dict[str, str] = {}  # its files' provenance, hashed once

    def prepare(
        self, shape: tuple[int, ...], site: str, key: str, rows: int, measured: Any = None
    ) -> None:
        if self.source is None or not shape:
            return
        if len(shape) > 2:  # (C, H, W): the last axis is the image's width, not a feature
            raise HookrunError(
                f"{key}.args.vector: /{site} holds {list(shape)} per sample; valid: a site of "
                "(tokens, width) or (width,) per sample, a vector along its width"
            )
        vector = read_vector(self.source, f"{key}.args.vector", shape[-1], site, measured)
        widths = {len(v) for v in self.vectors.values()}
        # One vector for every site must fit them all; a measured one is each site's own.
        if widths and len(vector) not in widths and not self.source.measured():
            raise HookrunError(
                f"{key}.args.vector: one vector for sites of widths {widths.pop()} and "
                f"{len(vector)}; valid: sites of one width (a hook per width)"
            )
        self.vectors[site] = self._direction(vector, key)
        self.digests = self.digests or digests(self.source)

    def _direction(self, vector: torch.Tensor, key: str) -> torch.Tensor:
        return vector

    def _on(self, tensor: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
        vector = self.vectors.get(ctx.key)
        if vector is None:
            if not self.vectors or self.source is None or self.source.measured():
                raise RuntimeError(f"{self.name}: no vector was read for /{ctx.key}")
            vector = next(iter(self.vectors.values()))  # a file's: the same at every site
        return vector.to(tensor.device, tensor.dtype)

    def sources(self) -> dict[str, str]:
        """The vector's files and their digests."""
        return self.digests

    def describe(self) -> str:
        """As Action.describe, the vector named by its files."""
        if self.source is None:
            return super().describe()
        files = ", ".join(p.name for p in self.source.files())
        return super().describe().replace(f"vector={self.args.vector}", f"vector=<{files}>")


@_action("add")
class Add(_Directed):
    """Add `value` to every element, or `scale` × a vector along the site's last axis.

    The first is the seeds' `grad + 2`; the second, activation addition.
    """

    Args = AddArgs

    def apply(self, tensor: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
        """The tensor plus `value`, or plus `scale` × the vector."""
        if self.source is None:
            return tensor + self.args.value
        return tensor + self.args.scale * self._on(tensor, ctx)

    def _direction(self, vector: torch.Tensor, key: str) -> torch.Tensor:
        if not self.args.normalize:
            return vector
        norm = float(vector.norm())
        if norm == 0:
            raise HookrunError(
                f"{key}.args.vector: a zero vector cannot be normalized; valid: a non-zero "
                "vector, or normalize: false"
            )
        return vector / norm

    @classmethod
    def check(cls, args: AddArgs, key: str) -> None:
        """Refuse `scale`/`normalize` without `vector`, `value` with it, a bad vector."""
        if args.vector is None and (args.scale != 1.0 or args.normalize):
            said = "scale" if args.scale != 1.0 else "normalize"
            raise HookrunError(f"{key}.args.{said}: applies to args.vector, which is not given")
        if args.vector is not None and args.value != 0.0:
            raise HookrunError(
                f"{key}.args.value: {args.value} with args.vector; valid: one of them"
            )
        if args.vector is not None:
            parse_vector(args.vector, f"{key}.args.vector")


@_action("ablate_direction")
class AblateDirection(_Directed):
    """Remove each position's component along a direction: x − (x·d̂) d̂.

    As Arditi et al. 2024, d̂ the vector at unit length.
    """

    Args = AblateArgs

    def apply(self, tensor: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
        """The tensor without its component along the direction."""
        unit = self._on(tensor, ctx)
        return tensor - (tensor @ unit)[..., None] * unit

    def _direction(self, vector: torch.Tensor, key: str) -> torch.Tensor:
        norm = float(vector.norm())
        if norm == 0:
            raise HookrunError(
                f"{key}.args.vector: a zero vector has no direction; valid: a non-zero vector"
            )
        return vector / norm

    @classmethod
    def check(cls, args: AblateArgs, key: str) -> None:
        """Refuse a missing or bad `vector`."""
        if args.vector is None:
            raise HookrunError(
                f"{key}.args.vector: null; valid: the direction ablate_direction removes (a "
                ".npy, .pt or .safetensors file, a stored run, or plus and minus)"
            )
        parse_vector(args.vector, f"{key}.args.vector")


@_action("clamp")
class Clamp(Action):
    """Clamp into [min, max]; `clamp {min: 0}` at a ReLU's grad_input is Guided Backprop."""

    Args = ClampArgs

    def apply(self, tensor: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
        """The tensor clamped into [min, max]."""
        return tensor.clamp(min=self.args.min, max=self.args.max)

    @classmethod
    def check(cls, args: ClampArgs, key: str) -> None:
        """Refuse neither bound, and `min` above `max`."""
        if args.min is None and args.max is None:
            raise HookrunError(f"{key}.args: clamp needs min, max or both")
        if args.min is not None and args.max is not None and args.min > args.max:
            raise HookrunError(f"{key}.args: clamp min {args.min} is above max {args.max}")


@_action("zero")
class Zero(Action):
    """Replace with zeros (ablation of an activation, or cutting a gradient path)."""

    Args = NoArgs

    def apply(self, tensor: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
        """Zeros of the tensor's shape."""
        return torch.zeros_like(tensor)


@_action("noise")
class Noise(Action):
    """Add Gaussian noise of `std`, drawn from the run's seeded generator."""

    Args = NoiseArgs

    def apply(self, tensor: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
        """The tensor plus `std` × seeded standard normal noise."""
        gen = ctx.generator(tensor.device)
        noise = torch.randn(tensor.shape, generator=gen, device=tensor.device, dtype=tensor.dtype)
        return tensor + self.args.std * noise

    @classmethod
    def check(cls, args: NoiseArgs, key: str) -> None:
        """Refuse a negative `std`."""
        if args.std < 0:
            raise HookrunError(f"{key}.args.std: {args.std} is negative; valid: std >= 0")


def build_action(name: str, args: dict[str, Any], key: str) -> Action:
    """An Action from its config word and `args`, checked.

    Args:
        name: The config word (`capture`, `clamp`, ...).
        args: The hook's `args:`, common ones (positions, heads, dtype) included.
        key: The hook's key (`hooks.<name>`), named in errors.

    Returns:
        The action, its `positions`, `heads` and `dtype` set.

    Raises:
        HookrunError: An unknown action (naming `key.action` and the near match) or a bad
            argument (naming `key.args.<x>`).
    """
    cls = ACTIONS.get(name, f"{key}.action")
    args = dict(args)
    common = {f.name: args.pop(f.name, None) for f in dataclasses.fields(CommonArgs)}
    positions = parse_positions(common["positions"], f"{key}.args.positions")
    if positions is not None and cls.reads_rows:
        raise HookrunError(
            f"{key}.args.positions: {positions.describe()} with action {name}, which puts "
            "whole stored rows back; valid: no positions (patch the whole tensor)"
        )
    heads = parse_heads(common["heads"], f"{key}.args.heads")
    dtype = _parse_dtype(common["dtype"], cls, f"{key}.args.dtype")
    parsed = parse_typed(args, cls.Args, f"{key}.args")
    check_finite(f"{key}.args", parsed)
    cls.check(parsed, key)
    action = cls(parsed)
    action.positions, action.heads, action.dtype = positions, heads, dtype
    return action


# The floats a capture can be stored in (io/encoding.py: bfloat16 as its 16 raw bits).
CAPTURE_DTYPES = ("float32", "float16", "bfloat16")


def _parse_dtype(value: Any, cls: type[Action], key: str) -> str | None:
    """A capture's `args.dtype`, refused on an action that stores nothing."""
    if value is None:
        return None
    if not cls.stores:
        raise HookrunError(
            f"{key}: {value!r} with action {cls.name}, which stores nothing; valid: an action "
            f"that records ({', '.join(n for n, c in ACTIONS.items() if c.stores)})"
        )
    if value not in CAPTURE_DTYPES:
        raise HookrunError(f"{key}: {value!r}; valid: {', '.join(CAPTURE_DTYPES)}")
    return str(value)
