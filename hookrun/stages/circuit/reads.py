"""How each attention head reads the residual stream: its query, its key and its value are
each a slice of a projection of the attention norm's output (models/architectures.py's
`qkv`, `qkv_layout`). These are the attention receivers of edge attribution — one per
head's query and, per key/value head, one for its key and one for its value (grouped-query
attention: query head h reads key/value head h // (heads / key_value_heads), as
transformers' repeat_kv lays them out).

Two things are done with them without touching the attention's code:

- `read_gradients`: the gradient of the metric with respect to what one read takes in —
  the residual stream before the norm, through that slice alone — from the gradient at the
  projection's output: the slice's gradient times the slice's weight, then back through
  the norm at the residual (one autograd pass for all the layer's reads, the residual
  repeated once per read).
- `shifted_reads`: hooks under which some reads take in something other than the
  residual stream (an ablated or patched one): the norm is run again on what they read,
  and their slices of the projections' outputs are made from it; every other read and the
  residual stream itself are left as they are, to the bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hookrun.errors import HookrunError
from hookrun.runtime.handles import ModuleHook

__all__ = [
    "Read",
    "attention_reads",
    "read_gradients",
    "shifted_reads",
    "Shift",
    "LAYOUTS",
    "CHUNK",
]

LAYOUTS = ("stacked", "separate", "per_head")
# Reads worked on at once: what they take in is a residual stream's worth each, so a
# layer's reads (three per head) are taken this many at a time to bound the memory.
CHUNK = 16


@dataclass(frozen=True)
class Read:
    """One head's query, key or value: the slice [start, stop) of the last dimension of
    projection `module`'s output (an index into the layer's projections)."""

    name: str  # a<layer>.h<head>.q, a<layer>.h<head>.k (or a<layer>.kv<group>.k), ...
    module: int
    start: int
    stop: int


def _width(module: nn.Module) -> tuple[int, int] | None:
    """(input width, output width) of a linear projection as transformers builds one: an
    nn.Linear (weight (out, in)) or GPT-2's Conv1D (weight (in, out)); None otherwise."""
    weight = getattr(module, "weight", None)
    # An integer weight (8-bit quantized: its scales live elsewhere) is no slice to use.
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if not weight.dtype.is_floating_point:
        return None
    if isinstance(module, nn.Linear) and tuple(weight.shape) == (
        module.out_features,
        module.in_features,
    ):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and weight.shape[1] == getattr(module, "nf", -1):
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def attention_reads(
    layer: int, projections: list[tuple[str, nn.Module]], layout: str, heads: int, kv_heads: int
) -> list[Read]:
    """The layer's reads — every query head's query, then every key/value head's key, then
    its value — from its projections (name, module) laid out as `layout`; refused in one
    line where the projections are not the widths the layout says."""
    widths = [_width(m) for _, m in projections]
    bad = next((name for (name, _), w in zip(projections, widths, strict=True) if w is None), None)
    if bad is not None:
        raise HookrunError(
            f"circuit: {bad} is a {type(dict(projections)[bad]).__name__}, whose weight edge "
            "attribution cannot slice per head; valid: an nn.Linear or transformers' Conv1D "
            "(an unquantized model)"
        )
    outs = [w[1] for w in widths if w is not None]
    # Heads' worth of outputs each projection puts out.
    counts = {
        "stacked": [heads + 2 * kv_heads],
        "separate": [heads, kv_heads, kv_heads],
        "per_head": [3 * heads],
    }[layout]
    size = outs[0] // counts[0] if len(outs) == len(counts) else 0
    if not size or outs != [c * size for c in counts]:
        names = ", ".join(name for name, _ in projections)
        raise HookrunError(
            f"circuit: the projections {names} put out {outs} features, not a {layout} layout "
            f"of {heads} query and {kv_heads} key/value heads; valid: a model whose "
            "architecture table entry says its qkv layout (models/architectures.py)"
        )
    kv = "h" if kv_heads == heads else "kv"
    reads = []
    for h in range(heads):
        start = 3 * h * size if layout == "per_head" else h * size
        reads.append(Read(f"a{layer}.h{h}.q", 0, start, start + size))
    for part, letter in ((1, "k"), (2, "v")):
        for j in range(kv_heads):
            module, start = {
                "stacked": (0, (heads + (part - 1) * kv_heads + j) * size),
                "separate": (part, j * size),
                "per_head": (0, (3 * j + part) * size),
            }[layout]
            reads.append(Read(f"a{layer}.{kv}{j}.{letter}", module, start, start + size))
    return reads


def _weight_rows(module: nn.Module, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slice's weight as (stop − start, in) and its bias (zeros where there is none)."""
    weight = module.weight
    rows = weight[start:stop] if isinstance(module, nn.Linear) else weight[:, start:stop].T
    bias = getattr(module, "bias", None)
    return rows, (bias[start:stop] if bias is not None else rows.new_zeros(stop - start))


def _project(module: nn.Module, normed: torch.Tensor, read: Read) -> torch.Tensor:
    """The read's slice of the projection's output, made from `normed` (…, in)."""
    rows, bias = _weight_rows(module, read.start, read.stop)
    return nn.functional.linear(normed, rows.to(normed.dtype), bias.to(normed.dtype))


def read_gradients(
    norm: nn.Module,
    residual: torch.Tensor,
    projections: list[nn.Module],
    grads: list[torch.Tensor],
    reads: list[Read],
    out: torch.Tensor,
) -> None:
    """Into `out` (N, reads, T, D) float32: the gradient with respect to the residual
    stream each read takes in (`residual` (N, T, D), the norm's input), through that read
    alone; `grads`: the gradient at each projection's output. Callers pass at most CHUNK
    reads: each costs a few copies of the residual stream here."""
    n, t, width = residual.shape
    cotangent = residual.new_empty(n, t, len(reads), width)
    for j, read in enumerate(reads):
        rows, _ = _weight_rows(projections[read.module], read.start, read.stop)
        slice_grad = grads[read.module][..., read.start : read.stop]
        torch.matmul(slice_grad, rows.to(slice_grad.dtype), out=cotangent[:, :, j])
    with torch.enable_grad():
        repeated = residual.detach()[:, :, None].expand(-1, -1, len(reads), -1).clone()
        repeated.requires_grad_(True)
        (grad,) = torch.autograd.grad(norm(repeated), repeated, cotangent)
    out.copy_(grad.transpose(1, 2))


# Of the receivers asked about (indices into Graph.receivers) and the residual stream x
# (N, T, D) they would read: those that read something else, and that minus x (N, T, k, D);
# None: all read x.
Shift = Callable[[list[int], torch.Tensor], "tuple[list[int], torch.Tensor] | None"]


class _LayerReads:
    """One layer's shifted reads: the norm's pre-hook works out their slices of the
    projections' outputs from what they take in (CHUNK reads at a time); each projection's
    hook puts them in place."""

    def __init__(
        self,
        norm: nn.Module,
        projections: list[nn.Module],
        reads: list[Read],
        receivers: list[int],
        shift: Shift,
    ):
        self.norm, self.projections, self.reads, self.shift = norm, projections, reads, shift
        self.receivers = receivers  # the reads' indices among the graph's receivers
        self.at = {r: i for i, r in enumerate(receivers)}  # a receiver's read
        self.made: list[tuple[Read, torch.Tensor]] = []

    def before_norm(self, module: nn.Module, args: tuple) -> None:
        self.made = []
        x = args[0]
        # The slices are kept until the projections run, the chunks' tensors (a residual
        # stream per read) only while they are made: the slices get one block, taken
        # before the chunks', so that small blocks kept between big freed ones do not
        # leave the heap fragmented (glibc holds such a heap's peak resident).
        slices = None
        for lo in range(0, len(self.receivers), CHUNK):
            found = self.shift(self.receivers[lo : lo + CHUNK], x)
            if found is None:
                continue
            if slices is None:
                width = self.reads[0].stop - self.reads[0].start
                slices = x.new_empty(len(self.reads), *x.shape[:-1], width)
            chosen, delta = found
            # The norm's own forward, not its hooks (this is one of them).
            normed = self.norm.forward(x[:, :, None] + delta)
            for j, r in enumerate(chosen):
                at = self.at[r]
                read = self.reads[at]
                slices[at] = _project(self.projections[read.module], normed[:, :, j], read)
                self.made.append((read, slices[at]))

    def projection(self, index: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor):
            mine = [(read, part) for read, part in self.made if read.module == index]
            if not mine:
                return None
            out = output.clone()
            for read, part in mine:
                out[..., read.start : read.stop] = part
            return out

        return hook


def shifted_reads(
    named: dict[str, nn.Module],
    attention: list[tuple[str, list[str], list[Read], list[int]]],
    norms: list[tuple[str, int]],
    shift: Shift,
) -> list[ModuleHook]:
    """Hooks under which receivers read x + shift: `attention`, per layer (its norm, its
    projections, its reads, their receiver indices); `norms`, each other receiver's norm
    and receiver index (an MLP, the logits), whose input is changed itself."""
    hooks = []
    for norm_name, modules, reads, receivers in attention:
        projections = [named[m] for m in modules]
        layer = _LayerReads(named[norm_name], projections, reads, receivers, shift)
        hooks.append(ModuleHook(named[norm_name], layer.before_norm, before=True))
        hooks += [ModuleHook(named[m], layer.projection(i)) for i, m in enumerate(modules)]

    for norm_name, receiver in norms:

        def read_else(module, args, receiver=receiver):
            found = shift([receiver], args[0])
            if found is None:
                return None
            return (args[0] + found[1][:, :, 0], *args[1:])

        hooks.append(ModuleHook(named[norm_name], read_else, before=True))
    return hooks
