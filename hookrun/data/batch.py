"""One batch of a run, typed: what the data loader gave (the model's input, the labels, the
dataset indices) and, for token data, what its rows are — the token ids, the attention mask
and each row's read position — read out of the (N, 3, T) rows the token datasets make
(data/tokens.py `sample_of`), which stay the model's input (models/language.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Batch", "IDS", "MASK", "READ"]

# The parts of a token row (N, 3, T): the ids, the attention mask, the read marker.
IDS, MASK, READ = 0, 1, 2


@dataclass(frozen=True)
class Batch:
    """A batch: `inputs` is what the model is called with (images (N, C, H, W), a token
    dataset's rows), `labels` (N,), `index` (N,) its dataset indices; token data also has
    `tokens` and `mask` (N, T) and `read` (N,), the position whose output is the row's."""

    inputs: torch.Tensor
    labels: torch.Tensor
    index: torch.Tensor
    tokens: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    read: torch.Tensor | None = None

    @classmethod
    def of(cls, loaded: tuple, token_rows: bool) -> Batch:
        """The batch of what the loader gave: (inputs, labels, indices)."""
        inputs, labels, index = loaded
        return cls(inputs, labels, index).typed(token_rows)

    def typed(self, token_rows: bool) -> Batch:
        """This batch with its token parts read out of `inputs` (token rows)."""
        if not token_rows:
            return self
        rows = self.inputs
        read = rows[:, READ].argmax(dim=1)
        return Batch(self.inputs, self.labels, self.index, rows[:, IDS], rows[:, MASK], read)

    def to(self, device: torch.device) -> Batch:
        """The batch's tensors the model reads (inputs, token parts) on `device`."""
        inputs = self.inputs.to(device, non_blocking=True)
        return Batch(inputs, self.labels, self.index).typed(self.tokens is not None)

    @property
    def rows(self) -> int:
        return len(self.index)

    def take(self, rows: torch.Tensor) -> Batch:
        """The batch's rows `rows` (indices into it), in that order."""
        picked = Batch(self.inputs[rows], self.labels[rows.cpu()], self.index[rows.cpu()])
        return picked.typed(self.tokens is not None)
