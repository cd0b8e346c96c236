"""Where the dictionary scores live in captures.h5, beside the splice's own records
(`/sae/<module>/<site>/…`, io/layout.py `splice_key`)."""

from __future__ import annotations

from hookrun.io.layout import splice_key

__all__ = ["ROW_FIELDS", "SCORE_FIELDS", "FIELDS_ATTR", "rows_key", "sums_key", "scores_key"]

# Each row's sums over its real tokens (sae/<module>/<site>/score_rows, (N, fields) float64):
# what the whole run's scores are made of, so a resume or a torchrun join adds them up.
ROW_FIELDS = (
    "tokens",  # real tokens at the site
    "l0",  # Σ latents != 0
    "sse",  # Σ ||x − x̂||²
    "cosine",  # Σ cos(x, x̂)
    "predicted",  # tokens with a real next token (the CE's)
    "ce_clean",  # Σ −log p(next token), the model as it is
    "ce_spliced",  # … with the site replaced by the reconstruction (no error term)
    "ce_zero",  # … with the site zeroed
    "kl_spliced",  # Σ KL(clean ‖ spliced) over real tokens
    "kl_zero",  # Σ KL(clean ‖ zeroed)
)
# The whole run's scores (sae/<module>/<site>/scores, (fields,) float64), as SAELens's evals
# name them.
SCORE_FIELDS = (
    "l0",
    "explained_variance",
    "mse",
    "cosine",
    "ce_clean",
    "ce_spliced",
    "ce_zero",
    "ce_loss_score",
    "kl_spliced",
    "kl_zero",
    "kl_div_score",
    "dead",
    "dense",
    "tokens",
)
FIELDS_ATTR = "fields"


def rows_key(site: str) -> str:
    """Each row's sums: (N, ROW_FIELDS)."""
    return splice_key(site, "score_rows")


def sums_key(site: str) -> str:
    """Each row's Σx and Σx² over its real tokens: (N, 2, width), for the explained
    variance against the run's per-dimension mean."""
    return splice_key(site, "activation_sums")


def scores_key(site: str) -> str:
    """The whole run's scores: (SCORE_FIELDS,)."""
    return splice_key(site, "scores")
