"""What the backward pass starts from: one class per sample, the difference of two, or the
sum of all outputs.

The model's output is read as (N, K) — any trailing axes are flattened — so `target.index`
and labels are positions in that flattened output. Targets are (N,) int64, one class per
sample; for target.kind=logit_diff (N, 2): the answer and the counterfactual answer, whose
logit difference is the score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from hookrun.errors import HookrunError
from hookrun.typed import Frozen

__all__ = [
    "TargetKind",
    "TargetConfig",
    "NO_TARGET",
    "check_target",
    "choose_targets",
    "target_scores",
    "backward_seed",
]


class TargetKind(str, Enum):
    """What the backward pass starts from."""

    predicted = "predicted"
    label = "label"
    index = "index"
    sum = "sum"
    none = "none"
    # Language models (token data): the actual next token of a text row at its read
    # position (dataset.read), or the first token of a prompt's answer — the row's label.
    next_token = "next_token"
    answer = "answer"
    # logit(answer) − logit(counterfactual_answer) of a prompt (dataset=prompts rows with both):
    # /samples/target holds the answer, /samples/counterfactual_target the other token.
    logit_diff = "logit_diff"


@dataclass
class TargetConfig(Frozen):
    kind: TargetKind = TargetKind.predicted
    """What the backward pass starts from: the predicted class, the label, a class `index`, the
    sum of the outputs, none (no backward pass); language models: the next token, the answer or
    the logit difference of answer and counterfactual.
    """
    index: int | None = None
    """The class to start from when kind=index."""


# Kinds whose target is each row's label: a class, or a language model's token (the token
# data puts a text row's next token or a prompt's answer token there).
_FROM_LABELS = (TargetKind.label, TargetKind.next_token, TargetKind.answer, TargetKind.logit_diff)

# Stored in /samples/target when the backward pass starts from no single class (sum, none).
NO_TARGET = -1


def check_target(target: TargetConfig, output_shape: tuple[int, ...], has_labels: bool) -> None:
    """Reject a target the model's output or the dataset cannot serve, before any work."""
    classes = math.prod(output_shape)
    if target.kind == TargetKind.index and not 0 <= (target.index or 0) < classes:
        raise HookrunError(
            f"target.index: {target.index} is out of range for a model output of {classes} "
            f"value(s) per sample; valid: 0..{classes - 1}"
        )
    if target.kind in _FROM_LABELS and not has_labels:
        raise HookrunError(
            f"target.kind: '{target.kind.value}' but this dataset has no labels (for answer: "
            "no row has an answer); valid here: predicted, index, sum, none"
        )


def choose_targets(
    output: torch.Tensor, target: TargetConfig, labels: torch.Tensor, against: Any = None
) -> torch.Tensor:
    """The class index each sample's backward pass starts from, as int64 (N,); (N, 2) for
    logit_diff, the labels beside `against` (each row's counterfactual answer)."""
    flat = output.detach().reshape(output.shape[0], -1)
    n, classes = flat.shape
    if target.kind == TargetKind.logit_diff:
        labels = torch.stack([labels.to(torch.int64).cpu(), torch.as_tensor(against).cpu()], 1)
    if target.kind == TargetKind.predicted:
        return flat.argmax(dim=1).cpu()
    if target.kind == TargetKind.index:
        return torch.full((n,), int(target.index), dtype=torch.int64)
    if target.kind in _FROM_LABELS:
        bad = (labels < 0) | (labels >= classes)
        if bool(bad.any()):
            raise HookrunError(
                f"target.kind: '{target.kind.value}', but a sample has label "
                f"{int(labels[bad][0])} and the model has {classes} outputs; valid labels: "
                f"0..{classes - 1}"
            )
        return labels.to(torch.int64).cpu()
    return torch.full((n,), NO_TARGET, dtype=torch.int64)


def target_scores(output: torch.Tensor, targets: torch.Tensor, kind: TargetKind) -> torch.Tensor:
    """Each sample's score (N,) whose gradient is explained: its target logit, or the sum
    of its outputs for target.kind=sum."""
    flat = output.reshape(output.shape[0], -1)
    if kind == TargetKind.sum:
        return flat.sum(dim=1)
    if kind == TargetKind.logit_diff:
        picked = flat.gather(1, targets.to(flat.device))
        return picked[:, 0] - picked[:, 1]
    return flat.gather(1, targets.to(flat.device).unsqueeze(1)).squeeze(1)


def backward_seed(output: torch.Tensor, targets: torch.Tensor, kind: TargetKind) -> torch.Tensor:
    """The scalar whose gradient the backward pass computes.

    Samples do not interact in eval mode, so the sum over the batch gives each sample the
    gradient of its own target logit.
    """
    return target_scores(output, targets, kind).sum()
