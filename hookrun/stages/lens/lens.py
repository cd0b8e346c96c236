"""The logit lens (nostalgebraist 2020): each block's output — the residual stream after the
block — projected through the model's final norm and unembedding, as if the model stopped
there; at the last block that is the model's own output distribution.

`derive.logit_lens`: `k` (5) likeliest tokens kept per block and position; `norm`, `unembed`
(module names; null: the family's, from the architecture table (models/architectures.py):
GPT-2 `transformer.ln_f` + `lm_head`, Llama-family `model.norm` + `lm_head`, GPT-NeoX
`gpt_neox.final_layer_norm` + `embed_out` (`lm_head` since transformers 5), BERT none + its
masked-LM head `cls.predictions`; `norm: none` for a model without a final norm); `blocks`
(the nn.ModuleList of the blocks; null: the family's, else the model's longest
ModuleList). Before the first batch the lens is checked on sample 0: the norm must
run on the last block's output and keep its shape, the unembedding must run on the norm's
output and give the model's logits (else each is refused naming its key, its value and the
model's own module), and at the last block the lens must give the model's output.

Reads each block's captured output at every position (`args.positions: all`, as
conf/experiment/logit_lens.yaml captures them) and writes, for every row and position
(padding included; /samples/mask says which are real): /derived/logit_lens/top_ids and
top_probs (N, layers, T, k), and target_prob (N, layers): the probability of the row's
target (/samples/target) at its read position after each block, NaN where it has none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookrun.data.batch import READ
from hookrun.errors import HookrunError, nearest
from hookrun.io import layout
from hookrun.models.adapter import adapt
from hookrun.models.architectures import architecture_of, families
from hookrun.models.placement import execution_device
from hookrun.runtime.handles import hooked, output_hooks
from hookrun.runtime.leaves import leaves
from hookrun.runtime.targets import NO_TARGET
from hookrun.stages.derive.registry import BatchContext, Method, register_method
from hookrun.typed import Frozen

__all__ = [
    "LOGIT_LENS",
    "TOP_IDS",
    "TOP_PROBS",
    "TARGET_PROB",
    "LensArgs",
    "LensState",
    "LogitLens",
    "NO_NORM",
    "project",
]

LOGIT_LENS = "logit_lens"  # the method: /derived/logit_lens/{top_ids,top_probs,target_prob}
KEY = f"derive.{LOGIT_LENS}"
TOP_IDS, TOP_PROBS, TARGET_PROB = (
    layout.derived_key(LOGIT_LENS, n) for n in ("top_ids", "top_probs", "target_prob")
)
NO_NORM = "none"  # `norm: none`: the model has no final norm before its unembedding
# The largest difference in any probability between the lens at the last block and the
# model's output on sample 0 that still counts as equal: float32, half precision models.
_AGREE, _AGREE_HALF = 1e-4, 1e-2


@dataclass
class LensArgs(Frozen):
    k: int = 5
    """The top-k tokens stored per block and position."""
    norm: str | None = None
    """the final norm's module name; none: no norm; null: found"""
    unembed: str | None = None
    """the unembedding's module name; null: found"""
    blocks: str | None = None
    """the nn.ModuleList of the blocks; null: found"""


@dataclass(frozen=True)
class LensState:
    """The modules the lens applies, and where each block's output is captured."""

    blocks: tuple[str, ...]  # module names, in the model's order
    keys: tuple[str, ...]  # each block's output capture (its first floating-point leaf)
    norm: nn.Module | None
    unembed: nn.Module
    vocab: int
    row: tuple[int, ...] = ()  # a block output's per-row shape at every position: (T, D)


def _normed(state: LensState, hidden: torch.Tensor) -> torch.Tensor:
    """Block outputs `hidden` (..., D) through the final norm (if any), on the unembedding's
    device and in its dtype."""
    param = next(state.unembed.parameters(), None)  # its dtype (meta too: offloaded)
    device = execution_device(state.unembed)
    h = hidden if param is None else hidden.to(device or hidden.device, param.dtype)
    return h if state.norm is None else _tensor(state.norm(h))


def _unembedded(state: LensState, normed: torch.Tensor) -> torch.Tensor:
    """Logits (..., V) in float32 of the final norm's output."""
    return _tensor(state.unembed(normed)).float()


def _tensor(out: Any) -> torch.Tensor:
    """A module's output, or its first tensor when it is structured (a tuple, a dict)."""
    if isinstance(out, torch.Tensor):
        return out
    found = leaves(out)
    if not found:
        raise TypeError(f"it returned a {type(out).__name__} with no tensor")
    return found[0][1]


def project(state: LensState, hidden: torch.Tensor) -> torch.Tensor:
    """Logits (..., V) in float32 of block outputs `hidden` (..., D): norm, then unembed, on
    the modules' device and in their dtype."""
    return _unembedded(state, _normed(state, hidden))


def _known(model: nn.Module) -> tuple[str, str | None, str] | None:
    """(blocks, final norm or None, unembedding) of the model's family (models/
    architectures.py), where the table knows it and the model has them."""
    entry = architecture_of(model)
    modules = dict(model.named_modules())
    unembed = entry.unembedding_of(modules) if entry is not None else None
    if entry is None or unembed is None:
        return None
    return entry.blocks, entry.final_norm, unembed


def _valid(model: nn.Module, key: str) -> str:
    """What `derive.logit_lens.<key>` (norm or unembed) may be, for this model."""
    known = _known(model)
    if key == "norm":
        if known is not None:
            return f"the model's final norm, {known[1] or NO_NORM} here"
        return f"the model's final norm (a module keeping each vector's size), or {NO_NORM}"
    if known is not None:
        return f"the model's unembedding, {known[2]} here"
    return "the model's unembedding (a module from the last block's width to the vocabulary)"


def _module(model: nn.Module, name: str, key: str) -> nn.Module:
    modules = dict(model.named_modules())
    if name not in modules or not name:
        close = nearest(name, [n for n in modules if n])
        hint = f"; nearest: {', '.join(close)}" if close else ""
        raise HookrunError(
            f"{KEY}.{key}: {name!r} is not a module of the model{hint}; valid: "
            f"{_valid(model, key)}, a name from model.named_modules()"
        )
    return modules[name]


def _tied(modules: Mapping[str, nn.Module], module: nn.Module) -> str:
    """For an embedding named as the unembedding: the module that shares its weight (GPT-2
    ties lm_head to transformer.wte), as a hint; else ''."""
    weight = getattr(module, "weight", None)
    if not isinstance(module, nn.Embedding) or weight is None:
        return ""
    for name, other in modules.items():
        if other is not module and getattr(other, "weight", None) is weight:
            return f" ({name} shares its weight and maps vectors to logits)"
    return " (an embedding maps token ids to vectors, not vectors to logits)"


def _checked_logits(
    state: LensState,
    names: tuple[str, str | None, str],
    model: nn.Module,
    hidden: torch.Tensor,
    vocab: int,
) -> torch.Tensor:
    """The lens's logits (1, T, V) of the last block's output `hidden` (1, T, D) on one
    sample, as a batch is projected; each module's failure refused naming its key: the norm
    must run and keep the shape, the unembedding must run and give the model's `vocab`
    logits at each position."""
    last, norm_name, unembed_name = names
    with torch.no_grad():
        try:
            normed = _normed(state, hidden)
            if normed.shape != hidden.shape:
                raise _Shape(f"it gives {list(normed.shape)}, not {list(hidden.shape)}")
        except Exception as err:
            raise HookrunError(
                f"{KEY}.norm: {norm_name!r} fails on the last block's output ({last}, "
                f"{list(hidden.shape)}) ({_first(err)}); valid: "
                f"{_valid(model, 'norm')}"
            ) from None
        try:
            logits = _unembedded(state, normed)
            if logits.shape != (*hidden.shape[:-1], vocab):
                raise _Shape(f"it gives {list(logits.shape)}; the model gives {vocab} logits")
        except Exception as err:
            raise HookrunError(
                f"{KEY}.unembed: {unembed_name!r} fails on the output of "
                f"{KEY}.norm ({norm_name or NO_NORM}) ({_first(err)})"
                f"{_tied(dict(model.named_modules()), state.unembed)}; valid: "
                f"{_valid(model, 'unembed')}"
            ) from None
    return logits


class _Shape(Exception):
    """A lens module that runs but gives the wrong shape (said without a type name)."""


def _first(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0][:200]
    return text if isinstance(err, _Shape) else f"{type(err).__name__}: {text}"


def _names(args: LensArgs, model: nn.Module) -> tuple[str, str | None, str]:
    """(blocks, norm or None, unembed) from the arguments, else the known architectures."""
    modules = dict(model.named_modules())
    known = _known(model)
    if known is None and (args.norm is None or args.unembed is None):
        kind = type(adapt(model).transformers_model() or model).__name__
        raise HookrunError(
            f"{KEY}: no known final norm and unembedding for {kind}; valid: a causal_lm or "
            f"masked_lm of {', '.join(families())}, or name them: {KEY}.norm=<module> "
            f"(none: no final norm) {KEY}.unembed=<module>"
        )
    blocks, norm, unembed = known or ("", None, "")
    if args.norm is not None:
        norm = None if args.norm == NO_NORM else args.norm
    unembed = args.unembed or unembed
    if args.blocks is not None:
        blocks = args.blocks
    elif known is None:
        lists = [(len(m), n) for n, m in modules.items() if isinstance(m, nn.ModuleList)]
        blocks = max(lists)[1] if lists else ""
    if not isinstance(modules.get(blocks), nn.ModuleList) or not len(modules[blocks]):
        raise HookrunError(
            f"{KEY}.blocks: {blocks!r} is not an nn.ModuleList of the model; valid: the "
            "module holding its blocks, e.g. transformer.h"
        )
    return blocks, norm, unembed


def _probe(model: nn.Module, blocks: list[str], sample: torch.Tensor) -> tuple[list, Any]:
    """Each block's output (first call) and the model's output, on one sample."""
    seen: dict[str, Any] = {}

    def keep(name: str):
        return lambda m, a, o: seen.setdefault(name, o)

    with hooked(output_hooks(model, blocks, keep)), torch.no_grad():
        output = model(sample.unsqueeze(0))
    return [seen.get(name) for name in blocks], output


@register_method(LOGIT_LENS)
class LogitLens(Method):
    Args = LensArgs
    reads_batch = True
    tokens_ok = True
    makes_map = False
    example = "logit_lens"

    @classmethod
    def check(cls, args: LensArgs, key: str) -> None:
        if isinstance(args.k, bool) or args.k < 1:
            raise HookrunError(f"{key}.k: {args.k}; valid: 1 or more (tokens kept per cell)")

    def requires(self, args: LensArgs) -> list[str]:
        return []  # every block's output: named once the model is known (requires_prepared)

    def requires_prepared(self, args: LensArgs, state: LensState) -> list[str]:
        return list(state.keys)

    def prepare(self, args: LensArgs, model: nn.Module, sample: torch.Tensor) -> LensState:
        if sample.dim() != 2 or sample.shape[0] != 3 or sample.is_floating_point():
            raise HookrunError(
                f"{KEY}: the model input is {list(sample.shape)} per row, not token data; "
                "valid: a language model on dataset=text or dataset=prompts"
            )
        blocks_name, norm_name, unembed_name = _names(args, model)
        modules = dict(model.named_modules())
        norm = None if norm_name is None else _module(model, norm_name, "norm")
        unembed = _module(model, unembed_name, "unembed")
        blocks = [f"{blocks_name}.{i}" for i in range(len(modules[blocks_name]))]
        outputs, logits = _probe(model, blocks, sample)
        keys = []
        for name, out in zip(blocks, outputs, strict=True):
            found = leaves(out) if out is not None else []
            if not found:
                raise HookrunError(
                    f"{KEY}.blocks: block {name} gave no tensor on sample 0; valid: the "
                    "nn.ModuleList of the model's blocks"
                )
            keys.append(layout.capture_key(name, "output", leaf=found[0][0]))
        state = LensState(tuple(blocks), tuple(keys), norm, unembed, 0)
        read = int(sample[READ].argmax())  # the token row's read marker (data/batch.py)
        last = leaves(outputs[-1])[0][1]
        own = logits if isinstance(logits, torch.Tensor) else leaves(logits)[0][1]
        own = own.reshape(-1).float()
        names = (blocks[-1], norm_name, unembed_name)
        lens = _checked_logits(state, names, model, last[:1], len(own))[0, read].softmax(-1)
        diff = float((lens - own.softmax(-1)).abs().max())
        if not diff <= (_AGREE if last.dtype == torch.float32 else _AGREE_HALF):
            raise HookrunError(
                f"{KEY}.norm, {KEY}.unembed: {norm_name or NO_NORM} then {unembed_name} on the "
                f"last block's output ({blocks[-1]}) do not give the model's output on sample 0 "
                f"(max |Δp| {diff:.2g}); valid: {_valid(model, 'norm')}, and "
                f"{_valid(model, 'unembed')}"
            )
        if args.k > lens.shape[-1]:
            raise HookrunError(f"{KEY}.k: {args.k}; valid: 1..{lens.shape[-1]} (the vocabulary)")
        row = (int(sample.shape[-1]), int(last.shape[-1]))
        return LensState(tuple(blocks), tuple(keys), norm, unembed, int(lens.shape[-1]), row)

    def check_captures(
        self, args: LensArgs, state: LensState, shapes: Mapping[str, tuple[int, ...]]
    ) -> None:
        for key in state.keys:
            if tuple(shapes[key]) != state.row:
                raise HookrunError(
                    f"{KEY}: /{key} holds {list(shapes[key])} per row, not the block's output "
                    f"at every position {list(state.row)}; valid: block outputs captured with "
                    "args.positions: all and no args.pool"
                )

    def stored_shapes(
        self, args: LensArgs, state: LensState, key: str, sample: tuple[int, ...]
    ) -> dict[str, tuple[int, ...]]:
        cells = (len(state.blocks), sample[-1], args.k)
        return {
            TOP_IDS: cells,
            TOP_PROBS: cells,
            TARGET_PROB: (len(state.blocks),),
        }

    def compute_batch(
        self,
        args: LensArgs,
        state: LensState,
        records: Mapping[str, torch.Tensor],
        batch: BatchContext,
    ) -> dict[str, torch.Tensor]:
        ids, probs, target = [], [], []
        read = batch.batch.read
        wanted = records[layout.SAMPLES_TARGET].to(torch.int64).to(read.device)
        rows = torch.arange(len(read), device=read.device)
        with torch.no_grad():
            for key in state.keys:
                hidden = records[key]  # (N, T, D): check_captures saw to it
                p = project(state, hidden).softmax(-1)  # (N, T, V)
                top = p.topk(args.k, dim=-1)
                ids.append(top.indices.to(torch.int32).cpu())
                probs.append(top.values.cpu())
                at = p[rows, read.to(p.device)]  # (N, V) at each row's read position
                at = at.gather(1, wanted.clamp(min=0).to(p.device).unsqueeze(1)).squeeze(1)
                target.append(torch.where(wanted.cpu() == NO_TARGET, torch.nan, at.cpu()))
        return {
            TOP_IDS: torch.stack(ids, dim=1),
            TOP_PROBS: torch.stack(probs, dim=1),
            TARGET_PROB: torch.stack(target, dim=1),
        }
