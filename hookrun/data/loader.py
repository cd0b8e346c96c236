"""From a dataset config (or the caller's own dataset) to sequential batches of
(tensor, label, index): the first `limit` samples, rows always in dataset order."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from hookrun.data.kinds import DATASETS, NO_LABEL, check_image
from hookrun.data.tokens import TokenData, Tokenizing, token_rows
from hookrun.errors import HookrunError

__all__ = [
    "build_dataset",
    "wrap_dataset",
    "has_labels",
    "make_loader",
    "worker_init",
    "files_fingerprint",
    "SourceFiles",
    "source_files",
]


def build_dataset(
    cfg: Any, seed: int, limit: int | None, tokenizer: Any = None, cache: Path | None = None
) -> Dataset:
    """The dataset `cfg` (a registered kind's config) describes, cut to `limit` samples;
    every image file of the run checked up front (a bad last file stops the run before
    its first batch, not after hours). Token kinds (data/tokens.py) are tokenized with the
    language model's `tokenizer` (a corpus kept in `cache`, the run's token cache, when
    given: data/token_cache.py); other kinds refuse one."""
    kind = DATASETS.get(cfg.kind, "dataset.kind")
    if getattr(kind, "tokens", False) != (tokenizer is not None):
        token_kinds = [
            k for k in DATASETS.choices() if getattr(DATASETS.get(k, ""), "tokens", False)
        ]
        if tokenizer is None:
            raise HookrunError(
                f"dataset.kind: {cfg.kind} is text, read with a language model's tokenizer, "
                "and this model has none; valid: model=hf, model=tiny_lm, or from Python "
                "LanguageModel(model, tokenizer) with its transformers tokenizer"
            )
        raise HookrunError(
            f"dataset.kind: {cfg.kind}; valid with a language model: {', '.join(token_kinds)}"
        )
    if tokenizer is not None:
        return _limited(kind.build(cfg, seed, Tokenizing(tokenizer, limit, cache)), limit)
    data = _limited(kind.build(cfg, seed), limit)
    for _, path, _ in _file_rows(data) or ():
        check_image(path)
    return data


def _limited(data: Dataset, limit: int | None) -> Dataset:
    if limit is None or limit >= len(data):  # type: ignore[arg-type]
        return data
    labelled = has_labels(data)
    cut = Subset(data, range(limit))
    cut.has_labels = labelled  # type: ignore[attr-defined]
    return cut


class _CallerData(Dataset):
    """The caller's dataset (`hookrun.run(dataset=...)`): items that are a tensor or an
    (input, label) pair become (tensor, label, index)."""

    def __init__(self, items: Any, labelled: bool) -> None:
        self.items = items
        self.has_labels = labelled

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        tensor, label = _split_item(self.items[index], index)
        return tensor, label, index


def _split_item(item: Any, index: int) -> tuple[torch.Tensor, int]:
    label: Any = NO_LABEL
    if isinstance(item, (tuple, list)) and len(item) >= 2:
        item, label = item[0], item[1]
    if isinstance(item, np.ndarray):
        item = torch.from_numpy(item)
    if not isinstance(item, torch.Tensor):
        raise HookrunError(
            f"dataset: item {index} is a {type(item).__name__}; valid: a tensor, or an "
            "(input tensor, label) pair (give an image dataset a transform such as ToTensor)"
        )
    if isinstance(label, torch.Tensor) and label.numel() == 1:
        label = label.item()
    if isinstance(label, bool) or not isinstance(label, (int, np.integer)):
        raise HookrunError(f"dataset: item {index} has label {label!r}; valid: an integer class")
    return item, int(label)


def wrap_dataset(data: Any, limit: int | None) -> Dataset:
    """The caller's map-style dataset or iterable as a hookrun dataset, first `limit` items.

    A map-style dataset is read lazily; any other iterable is read (up to `limit`) into a
    list first, since the run needs its length before the first batch.
    """
    if isinstance(data, TokenData):  # token rows made from a caller's ids (data/inline.py)
        return _limited(data, limit)
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        if not isinstance(data, Iterable):
            raise HookrunError(
                f"dataset: a {type(data).__name__} is neither a map-style dataset nor an "
                "iterable; valid: a torch Dataset, a list, or any iterable of tensors or "
                "(tensor, label) pairs"
            )
        data = list(itertools.islice(data, limit))
    if len(data) == 0:
        raise HookrunError("dataset: the dataset given to hookrun.run is empty")
    first = data[0]
    labelled = isinstance(first, (tuple, list)) and len(first) >= 2
    _split_item(first, 0)  # refuse a wrong item type before any work
    return _limited(_CallerData(data, labelled), limit)


def has_labels(data: Dataset) -> bool:
    """Whether the dataset's labels mean something (and go to /samples/label)."""
    if isinstance(data, Subset) and not hasattr(data, "has_labels"):
        return has_labels(data.dataset)
    return bool(getattr(data, "has_labels", False))


def _file_rows(data: Dataset) -> list[tuple[int, str, int]] | None:
    """(dataset index, source path, label or line) of every row, in row order, for datasets
    read from image files (an image folder); None for others."""
    rows, data = _run_rows(data)
    samples = getattr(data, "samples", None)
    if not isinstance(samples, list):
        return None
    return [(i, *samples[i]) for i in rows]


def files_fingerprint(data: Dataset) -> str:
    """sha256 over every source file's (path, size, label) in row order, for datasets read
    from files (an image folder); "" for others. A resumed run compares it, so a folder
    whose files were added, removed, renamed or rewritten is not continued."""
    tokens = token_rows(data)
    if tokens is not None:
        return tokens.fingerprint()  # the tokens themselves, not only the files' sizes
    rows = _file_rows(data)
    if rows is None:
        return ""
    digest = hashlib.sha256()
    for _, path, label in rows:
        try:
            size = os.stat(path).st_size
        except OSError:
            size = -1  # unreadable now: the read names it
        digest.update(f"{path}\t{size}\t{label}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class SourceFiles:
    """Each row's source file (absolute), for datasets read from files: /samples/path."""

    by_index: Mapping[int, str]  # token data: looked up when asked, not one entry a row
    # UTF-8 bytes of the longest path of the whole run, known before its first batch: one
    # width for every batch, every torchrun shard and every resumed run.
    width: int
    # Text: each row's 1-based line in its file (/samples/line); None for image files.
    lines: Mapping[int, int] | None = None

    def of(self, index: torch.Tensor) -> list[str]:
        """The source files of a batch's rows, by dataset index."""
        return [self.by_index[int(i)] for i in index]

    def lines_of(self, index: torch.Tensor) -> torch.Tensor:
        """The source lines of a batch's rows, by dataset index (int64)."""
        assert self.lines is not None
        return torch.tensor([self.lines[int(i)] for i in index], dtype=torch.int64)


def source_files(data: Dataset) -> SourceFiles | None:
    """The run's source files (every row, not one rank's share), or None when the dataset
    is not read from files."""
    tokens = token_rows(data)
    if tokens is not None:  # a corpus may have millions of rows: each looked up when asked
        sources = tokens.sources  # type: ignore[attr-defined]
        names = tokens.files_of(_run_rows(data)[0])  # type: ignore[attr-defined]
        where = os.path.abspath if tokens.from_files else str  # type: ignore[attr-defined]
        width = max((len(os.fsencode(where(p))) for p in names), default=1)
        paths = _Lookup(len(sources), lambda i: where(sources[i][0]))
        return SourceFiles(paths, width, _Lookup(len(sources), lambda i: int(sources[i][1])))
    rows = _file_rows(data)
    if rows is None:
        return None
    by_index = {i: os.path.abspath(path) for i, path, _ in rows}
    width = max((len(os.fsencode(p)) for p in set(by_index.values())), default=1)
    return SourceFiles(by_index, width)


def _run_rows(data: Dataset) -> tuple[Sequence[int], Dataset]:
    """The dataset indices of `data`'s rows under its Subsets (a range where they are: a
    corpus's `limit` lists no indices), and the dataset under the Subsets."""
    rows: Sequence[int] = range(len(data))  # type: ignore[arg-type]
    while isinstance(data, Subset):
        picked = data.indices
        if isinstance(rows, range) and isinstance(picked, range):
            rows = picked[rows.start : rows.stop : rows.step]
        else:
            rows = [picked[i] for i in rows]
        data = data.dataset
    return rows, data


class _Lookup(Mapping):
    """Dataset index → value, computed when asked (`get` and `[]` as a dict's)."""

    def __init__(self, size: int, value: Any) -> None:
        self._size, self._value = size, value

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self._size:
            raise KeyError(index)
        return self._value(index)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._size))


def worker_init(worker_id: int) -> None:
    """DataLoader worker: numpy and Python seeded from the worker's torch seed."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def make_loader(
    data: Dataset, batch_size: int, num_workers: int, seed: int, device: torch.device
) -> DataLoader:
    """Sequential batches (rows in dataset order); workers seeded from the run's seed;
    pinned batches on CUDA so the host → device copy can run asynchronously."""
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(
        data,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        generator=gen,
        worker_init_fn=worker_init,
        persistent_workers=False,
    )
