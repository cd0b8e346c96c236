"""The metrics of one batch from a causal language model's logits at every position
(N, T, V), the token ids, the attention mask (right padding) and each row's read position.

- loss (N,): the mean over the row's real tokens after its first of −log p(token | the tokens
  before it), as `model(ids, labels=ids).loss` gives it for the row alone;
- token_loss (N, T): that loss at each position t for the token at t + 1 (NaN where t + 1 is
  padding or past the row);
- answer_logprob (N,): log p(target) at the read position (the run's target token);
- logit_diff (N,): logit(answer) − logit(counterfactual answer) at the read position
  (target.kind=logit_diff);
- kl (N,): how far the hooks moved the next-token distribution, with the unhooked model as
  the reference: at each real position Σ_v p_unhooked(v) · (log p_unhooked(v) − log
  p_hooked(v)), in nats — KL(unhooked ‖ hooked), the expectation taken under the unhooked
  model — then the mean over the row's real positions (KL_MEANING says it in the file).
"""

from __future__ import annotations

import torch

__all__ = ["NAMES", "PAIRED", "KL_MEANING", "KL_SAID", "token_losses", "row_metrics", "kl"]

NAMES = ("loss", "token_loss", "answer_logprob", "logit_diff", "kl")
PAIRED = ("loss", "token_loss", "answer_logprob", "logit_diff")  # hooked and unhooked
# Which distribution is the reference, in words: /metrics/kl's attribute `meaning` (ASCII,
# the whole definition) and the summary's line (KL_SAID).
KL_MEANING = (
    "the unhooked model is the reference: the mean over the row's real positions of "
    "sum_v p_unhooked(v) * (log p_unhooked(v) - log p_hooked(v)), in nats (KL(unhooked || hooked))"
)
KL_SAID = "KL(unhooked ‖ hooked): the unhooked model's next-token distribution is the reference"


def token_losses(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, T): −log p(ids[:, t + 1]) at position t; NaN where the next token is not real."""
    logp = logits[:, :-1].float().log_softmax(-1)
    nll = -logp.gather(2, ids[:, 1:, None])[..., 0]
    real = mask[:, 1:].bool() & mask[:, :-1].bool()
    out = torch.full(ids.shape, float("nan"), device=logits.device)
    out[:, :-1] = torch.where(real, nll, torch.full_like(nll, float("nan")))
    return out


def row_metrics(
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    read: torch.Tensor,
    targets: torch.Tensor,
    names: tuple[str, ...],
) -> dict[str, torch.Tensor]:
    """The paired metrics of `names` for one model's logits (see the module docstring)."""
    out: dict[str, torch.Tensor] = {}
    rows = torch.arange(len(ids), device=ids.device)
    if "loss" in names or "token_loss" in names:
        losses = token_losses(logits, ids, mask)
        out["token_loss"] = losses
        out["loss"] = losses.nanmean(dim=1)
    at_read = logits[rows, read].float()
    if "answer_logprob" in names:
        answer = targets if targets.dim() == 1 else targets[:, 0]
        out["answer_logprob"] = at_read.log_softmax(-1)[rows, answer]
    if "logit_diff" in names:
        out["logit_diff"] = at_read[rows, targets[:, 0]] - at_read[rows, targets[:, 1]]
    return {k: v for k, v in out.items() if k in names}


def kl(hooked: torch.Tensor, unhooked: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,): each real position's KL divergence of the hooked next-token distribution from
    the unhooked one (the reference: the sum is weighted by its probabilities), the mean over
    the row's real positions."""
    p = unhooked.float().log_softmax(-1)
    q = hooked.float().log_softmax(-1)
    per_position = (p.exp() * (p - q)).sum(-1)  # (N, T)
    real = mask.bool()
    return (per_position * real).sum(1) / real.sum(1)
