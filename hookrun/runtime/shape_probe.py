"""The shape probe: which rows of each hooked tensor are which sample's, measured before any work.

The model runs twice, on a batch of two different samples (a, b) and a batch of three
(b, a, b). Every floating-point leaf of every hooked call is then one of:
- *per sample*: its first axis is the batch (2, then 3) — one row per sample;
- *folded*: its first axis is k times the batch (2k, then 3k; Swin's windows, heads) and
  rows [i*k, (i+1)*k) belong to sample i — checked on the values: sample a's block in the
  first batch equals sample a's block in the second, and b's likewise, and a's differs
  from b's (otherwise the order could not be told). Stored per sample as (N, k, ...);
- *per batch*: the same shape whatever the batch (a relative-position bias table): it has
  no sample rows, so it is stored once per batch;
- anything else (a batch axis that is not first, a window-major fold): refused, with why.
Each block is compared through two numbers per row (a fixed random projection and the
absolute sum), so the probe keeps no activations.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from hookrun.runtime.functions import CallSites, resolve_words, watch_calls, weights_of
from hookrun.runtime.handles import hooked, input_hooks, output_hooks
from hookrun.runtime.hooks import run_mode
from hookrun.runtime.leaves import leaves, model_logits
from hookrun.runtime.plan import CallShapes, HookPlan, Leaf, bind_calls
from hookrun.runtime.selectors import INPUT_LAYER

__all__ = ["probe_shapes", "second_sample"]

# The sample order of the two probe batches; sample 0 is the data's, 1 a perturbed copy.
_ORDERS = ((0, 1), (1, 0, 1))
# Relative differences (to the leaf's largest row signature): at most _SAME between blocks of
# one sample in the two batches (kernels differ by batch size), at least _APART between the
# blocks of the two samples.
_SAME, _APART = 1e-4, 1e-3

# One leaf as seen in one probe batch: (suffix, shape, signature (rows, 2) float64).
_Seen = tuple[str, tuple[int, ...], torch.Tensor]


def second_sample(sample: torch.Tensor) -> torch.Tensor:
    """A sample that differs from `sample` everywhere (fixed noise; a roll for integers)."""
    if not sample.is_floating_point():
        return sample.roll(1, dims=-1)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(sample.shape, generator=gen, dtype=sample.dtype).to(sample.device)
    scale = float(sample.std()) if sample.numel() > 1 and float(sample.std()) > 0 else 1.0
    return sample + noise * scale


def _signature(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0 or t.shape[0] == 0:
        return torch.zeros(0, 2, dtype=torch.float64)
    flat = t.detach().reshape(t.shape[0], -1).to(torch.float64)
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(flat.shape[1], generator=gen, dtype=torch.float64).to(flat.device)
    return torch.stack([flat @ weights, flat.abs().sum(1)], dim=1).cpu()


def _seen(value: Any) -> tuple[_Seen, ...]:
    return tuple((name, tuple(t.shape), _signature(t)) for name, t in leaves(value))


def _sample_major(k: int, first: torch.Tensor, second: torch.Tensor) -> str:
    """'' if rows [i*k, (i+1)*k) are sample i's in both probe batches, else why not."""
    block = {}
    for order, sig in zip(_ORDERS, (first, second), strict=True):
        for i, sample in enumerate(order):
            block.setdefault(sample, []).append(sig[i * k : (i + 1) * k])
    scale = max(float(torch.cat([first, second]).abs().max()), 1e-30)
    for blocks in block.values():
        if any(float((b - blocks[0]).abs().max()) > _SAME * scale for b in blocks[1:]):
            return "its rows are not grouped sample by sample"
    if float((block[0][0] - block[1][0]).abs().max()) <= _APART * scale:
        return "two different samples give the same rows, so their order cannot be checked"
    return ""


def _classify(first: _Seen, second: _Seen | None) -> Leaf:
    name, shape, sig = first
    if second is None or second[0] != name:  # the second batch took another path
        if shape and shape[0] == 2:
            return Leaf(name, shape[1:])
        return Leaf(name, shape, refused="the model calls it differently for another batch size")
    other = second[1]
    if shape == other:
        return Leaf(name, shape, fold=0)
    rest_same = len(shape) == len(other) and shape[1:] == other[1:]
    if rest_same and shape[0] % 2 == 0 and shape[0] // 2 * 3 == other[0]:
        k = shape[0] // 2
        if k == 1:
            return Leaf(name, shape[1:])
        why = _sample_major(k, sig, second[2])
        return Leaf(name, (k, *shape[1:]), fold=k, refused=why)
    why = f"shape {list(shape)} for a batch of 2 but {list(other)} for a batch of 3"
    return Leaf(name, shape, refused=f"{why}: the batch is not its first axis")


def _classify_all(
    first: dict[str, list[tuple]], second: dict[str, list[tuple]]
) -> dict[str, list[CallShapes]]:
    """CallShapes of every call in the first batch, classified against the second."""
    out: dict[str, list[CallShapes]] = {}
    for layer, calls in first.items():
        again = second.get(layer, [])
        for c, (ins, outs) in enumerate(calls):
            ins2, outs2 = again[c] if c < len(again) else ((), ())
            pair = [
                tuple(_classify(s, o[i] if i < len(o) else None) for i, s in enumerate(seen))
                for seen, o in ((ins, ins2), (outs, outs2))
            ]
            out.setdefault(layer, []).append(CallShapes(pair[0], pair[1]))
    return out


def _observe_modules(
    model: nn.Module, layers: list[str], batch: torch.Tensor
) -> tuple[dict[str, list[tuple]], Any]:
    """Every call of `layers` in one forward of `batch`: (inputs, outputs) seen; the output."""
    seen: dict[str, list[tuple]] = defaultdict(list)
    pending: dict[str, list[tuple]] = defaultdict(list)

    def pre(layer: str):
        def hook(module: nn.Module, args: tuple) -> None:
            pending[layer].append(_seen(args))

        return hook

    def post(layer: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            seen[layer].append((pending[layer].pop(), _seen(output)))

        return hook

    hooks = input_hooks(model, layers, pre) + output_hooks(model, layers, post)
    with hooked(hooks), run_mode(model), torch.no_grad():
        output = model(batch)
    return dict(seen), output


def _observe_calls(
    model: nn.Module, plan: HookPlan, weights: dict[int, str], batch: torch.Tensor
) -> dict[str, list[tuple]]:
    """Every intercepted call (function selectors, weight-used modules) in one forward."""
    seen: dict[str, list[tuple]] = defaultdict(list)
    words = resolve_words(list(plan.words), "select.function")

    def record(name: str, func, args: tuple, kwargs: dict) -> Any:
        output = func(*args, **kwargs)
        seen[name].append((_seen(args), _seen(output)))
        return output

    with watch_calls(model, CallSites(words, weights, record)), run_mode(model), torch.no_grad():
        model(batch)
    return dict(seen)


def probe_shapes(
    model: nn.Module, plan: HookPlan, sample: torch.Tensor
) -> tuple[dict[str, list[CallShapes]], tuple[int, ...], HookPlan]:
    """Run `sample` (no batch axis) and a perturbed copy through the model in the two probe
    batches; the classified leaves of every call of the plan's modules (and, when the plan
    has function selectors or modules used through their weights, of those calls), the
    model's output shape, and the plan with its call sites bound."""
    pair = (sample, second_sample(sample))
    batches = [torch.stack([pair[i] for i in order]) for order in _ORDERS]
    # No module to classify (a stage's passes alone, as AttnLRP's): the first batch's output
    # is all the probe needs, and a second forward would only cost.
    probed = batches if plan.layers else batches[:1]
    seen = [_observe_modules(model, plan.layers, batch) for batch in probed]
    shapes = _classify_all(seen[0][0], seen[-1][0])
    idle = [layer for layer in plan.layers if layer not in shapes]
    weights = weights_of(model, idle)
    weighted: tuple[str, ...] = ()
    if plan.words or weights:
        calls = [_observe_calls(model, plan, weights, batch) for batch in batches]
        shapes.update(_classify_all(calls[0], calls[1]))
        weighted = tuple(name for name in weights.values() if name in shapes)
    plan = bind_calls(dataclasses.replace(plan, weighted=weighted), shapes)
    # The model input is a floating-point leaf (an image) or none: token ids are no value a
    # hook acts on (they are stored at /samples/tokens), so nothing is captured or sized.
    leaf = (Leaf("", tuple(sample.shape)),) if sample.is_floating_point() else ()
    shapes[INPUT_LAYER] = [CallShapes((), leaf)]
    return shapes, tuple(model_logits(seen[0][1]).shape[1:]), plan
