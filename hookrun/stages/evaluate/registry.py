"""The faithfulness metrics (`evaluate.metrics`): how faithful is an attribution to its model.

A metric is one class registered with `@register_faithfulness_metric(name)` in its own
module under hookrun/stages/evaluate/ (imported by its __init__.py): its `Args` (what
`evaluate.<name>:` accepts) and `check`, the datasets it writes per attribution (`stored`,
with their attributes), and `evaluate` on one batch. Every metric scores a perturbed image
by the softmax probability of the run's target class, through the bare model (the run's
hooks stand aside), without gradients, `rows_per_pass` images per forward pass. (The
`metrics` stage, hookrun/stages/metrics/, is another thing: a language model's loss, KL and
logit difference under the run's hooks.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hookrun.registry import Registry
from hookrun.stage import Stored
from hookrun.typed import Frozen

__all__ = [
    "FAITHFULNESS_METRICS",
    "FaithfulnessMetric",
    "NoArgs",
    "EvalBatch",
    "Stored",
    "register_faithfulness_metric",
    "target_probabilities",
]


@dataclass
class NoArgs(Frozen):
    """A metric without arguments of its own."""


@dataclass(frozen=True)
class EvalBatch:
    """One batch as a metric sees it."""

    inputs: torch.Tensor  # (N, C, H, W) on the run's device, as the data loader gave them
    targets: torch.Tensor  # (N,) int64 on the device: the class whose probability is scored
    # images (rows, C, H, W) → logits (rows, K) of the bare model (no hook acts)
    logits: Callable[[torch.Tensor], torch.Tensor]
    # name → a CPU generator seeded by (run seed, name, the batch's first row)
    generator: Callable[[str], torch.Generator]
    rows_per_pass: int  # perturbed images per forward pass (evaluate.batch_size)
    # attribution path → (N, H, W) float32 relevance of each pixel (stages/evaluate/relevance.py)
    relevance: Mapping[str, torch.Tensor]


class FaithfulnessMetric:
    """Base class: `name` is the word in `evaluate.metrics`, `Args` its `evaluate.<name>:`."""

    name: ClassVar[str]
    Args: ClassVar[type] = NoArgs
    # Ranking: True when a larger mean is a more faithful attribution.
    higher_is_better: ClassVar[bool] = True
    # The per-sample number a sweep ranks by: the suffix of its dataset (AUC_SUFFIX, ...).
    summary_suffix: ClassVar[str] = ""

    @classmethod
    def check(cls, args: Any, key: str) -> None:
        """Refuse bad `args` (HookrunError naming `key.<x>`); called before any work."""

    @classmethod
    def check_image(cls, args: Any, key: str, image: tuple[int, int]) -> None:
        """Refuse `args` that do not fit images of `image` = (H, W) pixels (more steps than
        pixels); called before any work, once the input's shape is known."""

    def summary_key(self, attribution: str) -> str:
        """The dataset whose mean over samples ranks this attribution in a sweep."""
        raise NotImplementedError

    def stored(self, args: Any, attribution: str, image: tuple[int, int]) -> dict[str, Stored]:
        """Every dataset this metric writes for `attribution` (path → shape, attributes),
        for images of `image` = (H, W) pixels."""
        raise NotImplementedError

    def evaluate(self, args: Any, batch: EvalBatch, attribution: str) -> dict[str, torch.Tensor]:
        """The datasets' rows for one batch (host float32 tensors), keyed by path."""
        raise NotImplementedError


FAITHFULNESS_METRICS: Registry[FaithfulnessMetric] = Registry("a metric")


def register_faithfulness_metric(name: str):
    """Class decorator: register a FaithfulnessMetric under its `evaluate.metrics` name."""
    return FAITHFULNESS_METRICS.register_class(name)


def _chunks(total: int, size: int) -> Iterator[slice]:
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))


def target_probabilities(
    batch: EvalBatch, rows: int, images: Callable[[slice], tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """The softmax probability of each row's target class, (rows,) float32 on the host.
    `images(chunk)` builds the rows of one forward pass: (images, sample of each row);
    at most `rows_per_pass` rows exist at once."""
    out = torch.empty(rows, dtype=torch.float32)
    with torch.inference_mode():
        for chunk in _chunks(rows, batch.rows_per_pass):
            x, samples = images(chunk)
            logits = batch.logits(x).reshape(len(x), -1).float()
            prob = torch.softmax(logits, dim=1)
            out[chunk] = prob.gather(1, batch.targets[samples].unsqueeze(1)).squeeze(1).cpu()
    return out
