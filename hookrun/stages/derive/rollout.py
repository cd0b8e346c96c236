"""Attention rollout (Abnar & Zuidema 2020): how much each input token reaches a token's
final representation through attention alone, the residual connection counted as the
identity. Per layer l the attention probabilities are fused over the heads (`head_fusion`),
the lowest `discard_ratio` of the fused matrix's entries set to zero, Â_l = (A_l + I) / 2
row-normalised, and the rollout is Â_L · … · Â_s (s = `start_layer`); the arithmetic is in
rollout_math.py, the probabilities are read as attention_probs.py says.

`derive.attention_rollout`: head_fusion (mean | max | min), discard_ratio (0, in [0, 1)),
start_layer (0: every layer).

Results, both at /derived/attention_rollout/input (the model input's attribution):
- torchvision's ViT (images): the class token's row of the rollout over the patches,
  (N, h, w) on the patch grid — a map, drawn upsampled over the photo as Grad-CAM's are, and
  evaluated by evaluate=faithfulness as one;
- a Hugging Face language model (token rows): the read position's row over the input tokens,
  (N, T) (causal: zero after the read position and at padding), drawn in the token picture
  (render/tokens.py).
The rollout needs no target: it explains no class, only where attention carries information.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.memory import check_fits
from hookrun.models.adapter import adapt
from hookrun.models.placement import execution_device
from hookrun.runtime.spatial import Layout, decide_grid
from hookrun.stages.derive.attention_probs import attention_kind, run_attention
from hookrun.stages.derive.registry import BatchContext, Method, register_method
from hookrun.stages.derive.rollout_math import (
    HEAD_FUSIONS,
    discard_lowest,
    fuse_heads,
    rollout_rows,
    with_residual,
)
from hookrun.typed import Frozen

__all__ = ["AttentionRollout", "RolloutArgs", "RolloutState"]

log = logging.getLogger("hookrun")
KEY = "derive.attention_rollout"


@dataclass
class RolloutArgs(Frozen):
    """The `derive.attention_rollout:` arguments."""

    head_fusion: str = "mean"
    """How a layer's heads become one matrix: mean | max | min (over the heads, per entry)."""
    discard_ratio: float = 0.0
    """The fraction of each fused matrix's entries set to zero, the smallest first, in [0, 1)."""
    start_layer: int = 0
    """The first layer of the product Â_L · … · Â_s (0: every layer)."""


@dataclass(frozen=True)
class RolloutState:
    """What the probe pass found: how the probabilities are read, the layers and heads, the
    tokens, and for images the prefix tokens and the patch grid."""

    kind: str  # attention_probs.attention_kind
    layers: int
    heads: int
    tokens: int
    prefix: int = 0  # the class token (and others) before the patches; images only
    grid: tuple[int, int] | None = None  # (h, w) of the patches; None: token rows

    @property
    def shape(self) -> tuple[int, ...]:
        """One sample's result: the patch grid, or the tokens."""
        return self.grid if self.grid is not None else (self.tokens,)


@register_method("attention_rollout")
class AttentionRollout(Method):
    Args = RolloutArgs
    runs_passes = True
    needs_target = False  # no class is explained: attention carries what it carries
    tokens_ok = True  # a language model's rows are read as they are (not its embeddings)
    example = "attention_rollout"

    @classmethod
    def check(cls, args: RolloutArgs, key: str) -> None:
        if args.head_fusion not in HEAD_FUSIONS:
            raise HookrunError(
                f"{key}.head_fusion: {args.head_fusion!r}; valid: {', '.join(HEAD_FUSIONS)}"
            )
        if not 0 <= args.discard_ratio < 1:
            raise HookrunError(
                f"{key}.discard_ratio: {args.discard_ratio} is out of range; valid: a number "
                "in [0, 1) (0: nothing discarded)"
            )
        if args.start_layer < 0:
            raise HookrunError(
                f"{key}.start_layer: {args.start_layer} is out of range; valid: >= 0 (a "
                "layer's index, 0 the first)"
            )

    def requires(self, args: RolloutArgs) -> list[str]:
        return []

    def prepare(self, args: RolloutArgs, model: nn.Module, sample: torch.Tensor) -> RolloutState:
        kind = attention_kind(model, KEY)
        if kind == "language":
            _eager(model)
        device = _device(model)
        found: list[tuple[int, ...]] = []
        run_attention(model, sample[None].to(device), kind, KEY, lambda p: found.append(p.shape))
        if not found:
            raise HookrunError(
                f"{KEY}: {type(model).__name__}'s attention modules did not run on the input; "
                "valid: a model whose forward calls its self-attention"
            )
        odd = [s for s in found if s[-1] != s[-2] or s[-1] != found[0][-1]]
        if odd:
            raise HookrunError(
                f"{KEY}: attention of shape {list(odd[0][1:])} per row is not self-attention "
                f"over the same {found[0][-1]} tokens in every layer; valid: self-attention"
            )
        if not args.start_layer < len(found):
            raise HookrunError(
                f"{KEY}.start_layer: {args.start_layer} is out of range; valid: 0 to "
                f"{len(found) - 1} (the model's {len(found)} attention layers)"
            )
        tokens, heads = found[0][-1], max(s[1] for s in found)
        state = RolloutState(kind, len(found), heads, tokens)
        if kind == "language":
            return state
        return _image_state(state, model, sample)

    def stored_shapes(
        self, args: RolloutArgs, state: RolloutState, key: str, sample: tuple[int, ...]
    ) -> dict[str, tuple[int, ...]]:
        return {key: state.shape}

    def check_sizes(self, args: RolloutArgs, state: RolloutState, rows: int, sample: tuple) -> None:
        # A language model hands back every layer's heads at once; the hooks of an image
        # model fuse each layer's heads as it runs (one layer's heads at a time).
        layers = state.layers if state.kind == "language" else 1
        per_row = 4 * layers * state.heads * state.tokens**2 + 8 * state.layers * state.tokens**2
        what = f"{KEY}'s attention probabilities ({state.layers} layers, {state.heads} heads)"
        check_fits("batch_size", rows, rows * per_row, what)

    def passes(
        self, args: RolloutArgs, state: RolloutState, batch: BatchContext
    ) -> dict[str, torch.Tensor]:
        layers: list[torch.Tensor] = []
        mask = None if batch.batch.mask is None else batch.batch.mask.bool()

        def take(probs: torch.Tensor) -> None:
            if len(layers) < args.start_layer:  # before start_layer: not in the product
                layers.append(torch.empty(0))
                return
            fused = fuse_heads(probs.double(), args.head_fusion)
            kept = discard_lowest(fused, args.discard_ratio, mask)
            layers.append(with_residual(kept))

        run_attention(batch.model, batch.inputs, state.kind, KEY, take)
        kept = layers[args.start_layer :]
        if state.grid is None:  # token rows: the read position's row
            rows = batch.batch.read
            return {self._key(): rollout_rows(kept, rows).float().cpu()}
        n = len(batch.inputs)
        row = rollout_rows(kept, torch.zeros(n, dtype=torch.long))  # the class token's
        patches = row[:, state.prefix :].reshape(n, *state.grid)
        return {self._key(): patches.float().cpu()}

    def _key(self) -> str:
        return layout.derived_key(self.name, "input")


def _device(model: nn.Module) -> torch.device:
    return execution_device(model) or torch.device("cpu")


def _eager(model: nn.Module) -> None:
    """Eager attention, which forms the probabilities (the run switches back at its end,
    pipeline/runner.py `attention_kept`); refused in one line where the model cannot."""
    try:
        note = adapt(model).use_eager()
    except HookrunError as err:
        raise HookrunError(f"{KEY}: {str(err).split(': ', 1)[1]}") from None
    if note:
        log.info("%s", note.replace("(at: pattern)", f"({KEY})"))


def _image_state(state: RolloutState, model: nn.Module, sample: torch.Tensor) -> RolloutState:
    """The class token and the patch grid of an image model's tokens: refused when the
    input is no image or the tokens hold no class token and grid."""
    if sample.dim() != 3:
        raise HookrunError(
            f"{KEY}: the model input is {list(sample.shape)} per sample; valid: images "
            "(C, H, W) for a vision transformer, or token data for a language model"
        )
    prefix = adapt(model).prefix_tokens()
    if not prefix:
        raise HookrunError(
            f"{KEY}: {type(model).__name__} has no class token (class_token, cls_token) "
            "whose rollout row is the map; valid: a vision transformer with a class token"
        )
    image = (int(sample.shape[-2]), int(sample.shape[-1]))
    grid = decide_grid((state.tokens, 1), image, Layout.tokens, prefix, KEY)
    return RolloutState(state.kind, state.layers, state.heads, state.tokens, prefix, grid.size)
