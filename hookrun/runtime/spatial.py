"""Where the spatial grid is in a CAM layer's output, and the one conversion to (N, C, H, W).

The captured tensors stay as the model produced them; CAM-family methods convert them here,
just before their math. Three layouts exist in today's models:
- nchw: (N, C, H, W) feature maps of CNNs;
- nhwc: (N, H, W, C) channels-last maps (torchvision Swin's blocks and `norm`);
- tokens: (N, P + H*W, D) token sequences with P prefix (class, distillation, register)
  tokens first (ViT).
`decide_grid` makes the choice once, from a probe of the layer on one sample; the result
(a `Grid`) is the derivation's state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from hookrun.errors import HookrunError
from hookrun.io.dimensions import LAYOUT_AXES, AxisFacts
from hookrun.models.adapter import adapt
from hookrun.runtime.selectors import INPUT_LAYER

__all__ = [
    "Layout",
    "Grid",
    "decide_grid",
    "to_channels_first",
    "channels_first_hint",
    "axis_facts",
]


class Layout(str, Enum):
    auto = "auto"
    nchw = "nchw"
    nhwc = "nhwc"
    tokens = "tokens"


@dataclass(frozen=True)
class Grid:
    """The layout decision for one layer: how to reach (N, C, H, W) and the grid's size."""

    layout: Layout
    prefix_tokens: int
    size: tuple[int, int]


def to_channels_first(
    tensor: torch.Tensor, layout: Layout | str, prefix_tokens: int = 0, size: tuple | None = None
) -> torch.Tensor:
    """`tensor` (batch first) as (N, C, H, W); `size` (H, W) is needed for tokens on a
    non-square grid (a square one is found from the token count)."""
    layout = Layout(layout)
    if layout is Layout.nchw:
        return tensor
    if layout is Layout.nhwc:
        return tensor.permute(0, 3, 1, 2)
    if layout is Layout.tokens:
        grid = tensor[:, prefix_tokens:]
        h, w = size if size else (math.isqrt(grid.shape[1]),) * 2
        return grid.reshape(grid.shape[0], h, w, grid.shape[2]).permute(0, 3, 1, 2)
    raise ValueError(f"layout {layout.value!r} is decided by decide_grid, not converted")


def _fits(h: int, w: int, image: tuple[int, int]) -> bool:
    """Whether an h × w grid can tile the input with (nearly) one stride on both axes."""
    if not (0 < h <= image[0] and 0 < w <= image[1]):
        return False
    sh, sw = image[0] / h, image[1] / w
    return max(sh, sw) / min(sh, sw) < 1.5


def _token_grid(tokens: int, prefix: int, image: tuple[int, int]) -> tuple[int, int] | None:
    n = tokens - prefix
    if n <= 0:
        return None
    h = round(math.sqrt(n * image[0] / image[1]))
    if h and n % h == 0 and _fits(h, n // h, image):
        return h, n // h
    return None


def channels_first_hint(module: nn.Module, channels: int) -> bool:
    """Whether `module` is, or ends in, a Conv2d / BatchNorm2d with `channels` channels: its
    output is then channels-first whatever the shape suggests."""
    last = None
    for sub in module.modules():
        if isinstance(sub, (nn.Conv2d, nn.BatchNorm2d)):
            last = sub
    if isinstance(last, nn.Conv2d):
        return last.out_channels == channels
    return isinstance(last, nn.BatchNorm2d) and last.num_features == channels


def decide_grid(
    shape: tuple[int, ...],
    image: tuple[int, int],
    layout: Layout,
    prefix: int | None,
    key: str,
    conv: bool = False,
) -> Grid:
    """The grid of a layer whose per-sample output shape is `shape`, for an input of size
    `image` (H, W); `layout`/`prefix` as the user set them (auto / None: find out); `conv`:
    the layer ends in a conv/batch norm with shape[0] channels (decides a tie). `key` is the
    config path of what asks (a method's). HookrunError when it cannot be told."""
    where = f"per-sample output shape {list(shape)} (input {image[0]}x{image[1]})"
    if len(shape) == 3:
        found = [
            option
            for option, (h, w) in ((Layout.nchw, shape[1:]), (Layout.nhwc, shape[:2]))
            if _fits(h, w, image)
        ]
        if layout is Layout.auto and len(found) == 2 and conv:
            found = [Layout.nchw]
        if layout is Layout.auto and len(found) == 1:
            layout = found[0]
        if layout is Layout.nchw:
            return Grid(layout, 0, (shape[1], shape[2]))
        if layout is Layout.nhwc:
            return Grid(layout, 0, (shape[0], shape[1]))
        if layout is Layout.auto:
            why = "both channels-first and channels-last fit" if found else "no grid fits"
            raise HookrunError(
                f"{key}.layout: auto cannot tell the layout of {where}: {why}; valid: nchw, nhwc"
            )
    if len(shape) == 2 and layout in (Layout.auto, Layout.tokens):
        count = prefix if prefix is not None else None
        options = [count] if count is not None else [0, 1, 2, 5]
        grids = {p: g for p in options if (g := _token_grid(shape[0], p, image))}
        if len(grids) == 1:
            ((p, g),) = grids.items()
            return Grid(Layout.tokens, p, g)
        why = "several prefix-token counts fit" if grids else "no square-ish grid fits"
        raise HookrunError(
            f"{key}.prefix_tokens: cannot tell the token grid of {where}: {why}; valid: set "
            f"{key}.prefix_tokens=P (class/register tokens before the H*W grid tokens)"
        )
    raise HookrunError(
        f"{key}.layout: {layout.value!r} does not fit {where}; valid: nchw or nhwc for 3 axes "
        "per sample, tokens for 2 (N, L, D); a CAM layer needs a spatial output"
    )


def _axes(shape: tuple[int, ...], image: tuple[int, int] | None, prefix: int | None, conv: bool):
    """LAYOUT_AXES' names for a tensor's per-row `shape`; () when no layout fits."""
    if len(shape) == 1:
        return LAYOUT_AXES["vector"]
    if image is None or len(shape) not in (2, 3):
        return ()
    try:
        grid = decide_grid(shape, image, Layout.auto, prefix, "", conv)
    except HookrunError:
        return ()
    return LAYOUT_AXES[grid.layout.value]


# Per-row axes of a capture when the input is token ids (T,): by (rank, first axis is T).
# A language model's tensors by (rank per row, whether the first axis is the T positions):
# block outputs, one position's vector (`args.positions: last`), listed positions, attention.
_SEQUENCE = {
    (2, True): ("token", "feature"),
    (1, False): ("feature",),
    (2, False): ("position", "feature"),
    (3, False): ("head", "query", "key"),
}
# The token sample (data/tokens.py): ids, attention mask and read marker over T positions.
_TOKEN_INPUT = ("part", "token")


def axis_facts(
    captures: Mapping[str, tuple[int, ...]],
    folds: Mapping[str, int],
    model: nn.Module,
    sample: torch.Tensor,
) -> AxisFacts:
    """What the run knows of its axes, for their names in captures.h5: the model input's
    (an image is channels-first; a token sample is its parts × tokens) and each capture's
    per-row shape (`captures`: path → stored shape per row) read as the CAM layouts read; none
    for a tensor stored once per batch (a table, not a sample's map)."""
    image = (int(sample.shape[-2]), int(sample.shape[-1])) if sample.dim() >= 2 else None
    # Token ids (T,) of a caller's model, or hookrun's token sample (3, T).
    tokens = sample.dim() in (1, 2) and not sample.is_floating_point()
    if tokens:
        given: tuple[str, ...] = ("token",) if sample.dim() == 1 else _TOKEN_INPUT
    else:
        given = _axes(tuple(sample.shape), image, 0, True)
    prefix, modules = adapt(model).prefix_tokens(), dict(model.named_modules())
    tensors = {}
    for key, shape in captures.items():
        layer = key.split("/", 1)[1].rsplit("/", 1)[0]  # layout.capture_key's <layer>
        row = shape[1:] if folds.get(key, 1) > 1 else shape
        module = modules.get(layer)
        conv = module is not None and bool(row) and channels_first_hint(module, row[0])
        if folds.get(key) == 0:
            continue
        if layer == INPUT_LAYER:
            tensors[key] = given
        elif tokens:  # a language model: (T, D) per token, (heads, T, T)
            first_is_t = bool(row) and row[0] == sample.shape[-1]
            tensors[key] = _SEQUENCE.get((len(row), first_is_t), ())
        else:
            tensors[key] = _axes(row, image, prefix, conv)
    return AxisFacts(given, tensors)
