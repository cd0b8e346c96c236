"""What a unit's dashboard adds beyond the stream: a residual-stream latent's logit effects,
and on image data each top context's receptive field in the input (its box and patch)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hookrun.dictionaries.dictionary import Dictionary
from hookrun.models.architectures import architecture_of
from hookrun.runtime.sitevalues import SiteRead, take_sites

__all__ = ["residual_stream", "logit_effects", "receptive_fields"]


def residual_stream(model: nn.Module, module: str, at: str) -> bool:
    """Whether (module, at) is the residual stream: a block's output or input, by the
    architecture table."""
    arch = architecture_of(model)
    if arch is None or arch.final_norm is None:
        return False
    prefix, _, rest = module.rpartition(".")
    return prefix == arch.blocks and rest.isdigit() and at in ("input", "output")


def logit_effects(model: nn.Module, d: Dictionary, n: int) -> dict[str, np.ndarray] | None:
    """Each latent's decoder row through the final norm and the unembedding, as
    SAEDashboard reads a feature's direct logit effect: a LayerNorm's centring and weight
    ((W_dec[j] - mean W_dec[j]) diag(w_ln) W_U; TransformerLens folds both into W_U), an
    RMSNorm's weight only; the norm's 1/sigma and bias are left out. The `n` largest and
    smallest, by token id.

    Returns:
        top_token, top_value, bottom_token, bottom_value (d_sae, n) each, or None where the
        model's final norm or unembedding is not known.
    """
    arch = architecture_of(model)
    if arch is None or arch.final_norm is None:
        return None
    modules = dict(model.named_modules())
    unembed = arch.unembedding_of(modules)
    if unembed is None or arch.final_norm not in modules:
        return None
    w_u = getattr(modules[unembed], "weight", None)
    if w_u is None:
        return None
    w_u = w_u.detach().double()  # (V, D), a Linear's weight
    final = modules[arch.final_norm]
    norm = getattr(final, "weight", None)
    scale = torch.ones(w_u.shape[1], dtype=torch.float64) if norm is None else norm.detach()
    rows = d.tensors["W_dec"].double().to(w_u.device)
    if d.rescale_acts_by_decoder_norm:
        rows = rows / rows.norm(dim=-1, keepdim=True)
    if d.normalize == "expected_average_only_in" and d.scaling_factor is not None:
        rows = rows / d.scaling_factor
    if isinstance(final, nn.LayerNorm):  # it subtracts the mean: a direction's mean is lost
        rows = rows - rows.mean(dim=-1, keepdim=True)
    effects = (rows * scale.double().to(w_u.device)) @ w_u.T  # (d_sae, V)
    n = min(n, effects.shape[1])
    top = effects.topk(n, dim=1)
    bottom = effects.topk(n, dim=1, largest=False)
    return {
        "top_token": top.indices.cpu().numpy().astype(np.int64),
        "top_value": top.values.float().cpu().numpy(),
        "bottom_token": bottom.indices.cpu().numpy().astype(np.int64),
        "bottom_value": bottom.values.float().cpu().numpy(),
    }


def _to_uint8(image: torch.Tensor) -> torch.Tensor:
    """An input image (C, H, W) as 3 uint8 channels, its own min and max stretched to 0..255
    (the model's input is normalised: this shows it, not the file it came from)."""
    image = image.float()
    if image.shape[0] == 1:
        image = image.expand(3, *image.shape[1:])
    elif image.shape[0] == 2:
        image = torch.cat([image, image[:1]])
    else:
        image = image[:3]
    low, high = image.min(), image.max()
    span = (high - low) if high > low else torch.ones((), device=image.device)
    return ((image - low) / span * 255).round().clamp(0, 255).to(torch.uint8)


def receptive_fields(
    model: nn.Module,
    read: SiteRead,
    image_of: Callable[[int], torch.Tensor],
    rows: np.ndarray,
    tokens: np.ndarray,
    map_width: int,
    patch: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The box and patch of each top context (unit c, row r, position y*W+x) of a conv site.

    Found exactly by autograd: the gradient of that one activation (channel c at (y, x) of
    row r's map) with respect to the input image; the box is the bounding box of where it
    is not zero (y0, x0, y1, x1, the ends exclusive), the whole image where it is zero
    everywhere (a unit that only its bias drives). The patch is the box's crop of the input
    resized (bilinear) to patch x patch.

    Args:
        rows, tokens: (U, k) each; -1 rows are left empty.

    Returns:
        boxes (U, k, 4) int64 (-1 where empty), patches (U, k, 3, patch, patch) uint8.
    """
    units, k = rows.shape
    boxes = np.full((units, k, 4), -1, dtype=np.int64)
    patches = np.zeros((units, k, 3, patch, patch), dtype=np.uint8)
    for row in sorted(set(int(r) for r in rows.reshape(-1) if r >= 0)):
        image = image_of(row)
        x = image[None].clone().requires_grad_(True)
        with torch.enable_grad():
            ((site, _),) = take_sites(
                model, [read], lambda x=x: model(x), "features", keep=lambda t: t
            )
            for unit, slot in zip(*np.nonzero(rows == row), strict=True):
                y, xx = divmod(int(tokens[unit, slot]), map_width)
                (grad,) = torch.autograd.grad(site[0, unit, y, xx], x, retain_graph=True)
                where = grad[0].abs().sum(0) > 0
                ys, xs = where.nonzero(as_tuple=True)
                if len(ys):
                    box = (int(ys.min()), int(xs.min()), int(ys.max()) + 1, int(xs.max()) + 1)
                else:
                    box = (0, 0, image.shape[1], image.shape[2])
                boxes[unit, slot] = box
                crop = _to_uint8(image)[:, box[0] : box[2], box[1] : box[3]].float()
                resized = F.interpolate(crop[None], size=(patch, patch), mode="bilinear")
                patches[unit, slot] = resized[0].round().clamp(0, 255).byte().cpu().numpy()
    return boxes, patches
