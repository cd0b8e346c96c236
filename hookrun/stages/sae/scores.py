"""The numbers of a dictionary's scores: each row's sums (per batch, from the stage's own
passes) and the whole run's scores made of them (once every row is in the file).

Definitions, as SAELens's evals give them (and where they went wrong for its users):
- L0: latents != 0 per token, averaged over the run's real tokens.
- explained variance: 1 − Σ‖x − x̂‖² / Σ‖x − μ‖², μ the per-dimension mean of the run's
  activations (not zero: SAELens #665).
- MSE: ‖x − x̂‖² per token (summed over the width), averaged over tokens, not scaled by
  the batch size (SAELens #711).
- cosine: cos(x, x̂) per token, averaged.
- CE loss recovered: (CE zero-ablated − CE spliced) / (CE zero-ablated − CE clean), each
  CE the mean next-token loss over tokens whose next token is real; spliced = the site
  replaced by the reconstruction (no error term), zero-ablated = the site zeroed.
- KL score: (KL zero − KL spliced) / KL zero, KL(clean ‖ changed) of the next-token
  distributions, averaged over real tokens.
- dead: latents that never fired on a real token of the run (the run's recorded latents);
  dense: those that fired on more than `dense` of them.

Each equals SAELens 6.54's `run_evals` on the same tokens to ~1e-7 relative
(tests/dictionaries/test_scores_vs_saelens.py). Which tokens count differs: SAELens by default
drops the tokenizer's special tokens (BOS, EOS, PAD) and its CE keeps a position whose input
token is kept, so on right-padded rows it scores the prediction of the first pad; here a token
counts when it is real (not padding), a CE term when its input and its next token are.
"""

from __future__ import annotations

import h5py
import numpy as np
import torch

from hookrun.stages.sae.keys import ROW_FIELDS, SCORE_FIELDS

__all__ = ["activation_rows", "language_rows", "whole_run_scores", "fired"]


def activation_rows(
    x: torch.Tensor, latents: torch.Tensor, rebuilt: torch.Tensor, mask: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each row's sums over its real tokens, and its Σx, Σx² (N, 2, width), in float64.

    Args:
        x: The site's activations (N, T, width), or (N, width) for one vector per row.
        latents: The dictionary's latents of them.
        rebuilt: Its reconstruction (no error term).
        mask: (N, T) True at real tokens (ignored for one vector per row).
    """
    if x.dim() == 2:  # one vector per row: a single "token"
        x, latents, rebuilt = x[:, None], latents[:, None], rebuilt[:, None]
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    real = mask.to(x.device, torch.float64)
    x, rebuilt = x.double(), rebuilt.double()
    cosine = torch.nn.functional.cosine_similarity(x, rebuilt, dim=-1, eps=1e-12)
    rows = {
        "tokens": real.sum(1),
        "l0": ((latents != 0).sum(-1).double() * real).sum(1),
        "sse": (((x - rebuilt) ** 2).sum(-1) * real).sum(1),
        "cosine": (cosine * real).sum(1),
    }
    weighted = x * real[..., None]
    sums = torch.stack([weighted.sum(1), (weighted * x).sum(1)], dim=1)
    return rows, sums


def language_rows(
    clean: torch.Tensor,
    spliced: torch.Tensor,
    zeroed: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    special: str = "keep",
) -> dict[str, torch.Tensor]:
    """Each row's CE and KL sums from three passes' logits (N, T, vocab).

    KL over every counted position (`mask`). CE: with `special` keep, over counted positions
    whose next token is counted too; with exclude, as SAELens's evals mask it (`mask[:, :-1]`:
    every counted position but the row's last, whatever follows).
    """
    mask = mask.bool().to(clean.device)
    predicted = mask[:, :-1] if special == "exclude" else mask[:, :-1] & mask[:, 1:]
    following = tokens[:, 1:].long()[..., None]
    out = {"predicted": predicted.double().sum(1)}
    clean_logp = torch.log_softmax(clean.double(), dim=-1)
    for name, logits in (("clean", clean), ("spliced", spliced), ("zero", zeroed)):
        logp = clean_logp if name == "clean" else torch.log_softmax(logits.double(), dim=-1)
        loss = -logp[:, :-1].gather(-1, following)[..., 0]
        out[f"ce_{name}"] = (loss * predicted).sum(1)
        if name != "clean":
            kl = (clean_logp.exp() * (clean_logp - logp)).sum(-1)
            out[f"kl_{name}"] = (kl * mask).sum(1)
    return out


def fired(f: h5py.File, latents: str, mask: np.ndarray | None, rows: int, width: int) -> np.ndarray:
    """How many real tokens each latent fired on (width,), from the run's sparse latents
    (io/sparse.py: counts per token, then each non-zero's latent index), read in blocks."""
    group = f[latents]
    counts_ds, index_ds = group["counts"], group["latent"]
    out = np.zeros(width, dtype=np.int64)
    start, block = 0, 256
    for first in range(0, rows, block):
        counts = counts_ds[first : min(first + block, rows)].astype(np.int64)
        n = int(counts.sum())
        index = index_ds[start : start + n]
        start += n
        if mask is not None and counts.ndim == 2:
            real = np.repeat(mask[first : first + len(counts)].reshape(-1), counts.reshape(-1))
            index = index[real]
        out += np.bincount(index, minlength=width)[:width]
    return out


def whole_run_scores(
    rows: np.ndarray, sums: np.ndarray, firing: np.ndarray | None, dense: float
) -> np.ndarray:
    """The run's scores (SCORE_FIELDS) from every row's sums; NaN where a score has no
    tokens to be made of (no CE without a causal language model, no dead latents without
    recorded latents).

    Args:
        rows: (N, ROW_FIELDS) each row's sums.
        sums: (N, 2, width) each row's Σx and Σx².
        firing: (d_sae,) tokens each latent fired on, or None.
        dense: The fraction of tokens above which a latent is dense.
    """
    total = dict(zip(ROW_FIELDS, rows.sum(0), strict=True))
    tokens, predicted = total["tokens"], total["predicted"]
    x_sum, x_sq = sums[:, 0].sum(0), sums[:, 1].sum(0)
    spread = float(x_sq.sum() - (x_sum**2).sum() / tokens) if tokens else np.nan
    score = {
        "tokens": tokens,
        "l0": total["l0"] / tokens,
        "mse": total["sse"] / tokens,
        "explained_variance": 1 - total["sse"] / spread if spread else np.nan,
        "cosine": total["cosine"] / tokens,
    }
    with np.errstate(invalid="ignore", divide="ignore"):
        for name in ("ce_clean", "ce_spliced", "ce_zero"):
            score[name] = total[name] / predicted if predicted else np.nan
        for name in ("kl_spliced", "kl_zero"):
            score[name] = total[name] / tokens if predicted else np.nan
        recovered = score["ce_zero"] - score["ce_clean"]
        score["ce_loss_score"] = (score["ce_zero"] - score["ce_spliced"]) / recovered
        score["kl_div_score"] = (score["kl_zero"] - score["kl_spliced"]) / score["kl_zero"]
    if firing is None:
        score["dead"] = score["dense"] = np.nan
    else:
        score["dead"] = float((firing == 0).sum())
        score["dense"] = float((firing > dense * tokens).sum())
    return np.array([score[name] for name in SCORE_FIELDS], dtype=np.float64)
