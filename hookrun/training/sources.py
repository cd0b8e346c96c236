"""The activations a training job steps on: batches of token vectors, in an order that a
resumed job repeats exactly.

- `ModelActivations`: streamed from the model. The training rows are read in order, a model
  batch of `batch_size` rows at a time (the rows repeated as often as the tokens need); each
  batch's real tokens (the mask) at every site are taken by forward hooks, and the forward
  stops after the last site (the unembedding is never computed). They go into chunks of
  `chunk` tokens, and each chunk is shuffled on its own (seeded by the seed and the chunk's
  index) and cut into the steps' batches. Nothing is written to disk; memory is one chunk.
  A chunk starts at a `Position` (model batch, token offset in it), so a resumed job makes
  the chunk it stopped in again by running the same model batches: the same rows in the same
  batches give the same numbers. Under torchrun (`ranks`) every rank walks the chunk's
  model batches (their masks say how many real tokens each gives), runs the model on every
  `size`-th of them only, and the pieces are gathered into the whole chunk on every rank:
  the chunk one process makes, from a `size`-th of the forward passes each.
- `FileActivations`: read from an earlier run's captures.h5 through `TokenBatches`, epoch
  after epoch, the steps' batches in its shuffled order; a resume starts at a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from hookrun.data.batch import Batch
from hookrun.data.loader import make_loader
from hookrun.errors import HookrunError, Interrupted
from hookrun.io.activations import TokenBatches
from hookrun.io.layout import capture_key, open_readonly
from hookrun.runtime.sitevalues import SiteRead, modules_of, take_sites
from hookrun.signals import interruptible
from hookrun.training.parallel import Ranks

__all__ = ["Abandoned", "Position", "ModelActivations", "FileActivations", "Steps"]


class Abandoned(Exception):
    """A chunk given up while it was being made (its prefetch closed)."""


@dataclass(frozen=True)
class Position:
    """Where a chunk starts: a model batch (counted over repeated passes of the rows) and
    how many of its real tokens an earlier chunk took."""

    batch: int = 0
    offset: int = 0


class ModelActivations:
    """Token vectors at `sites` ((module, input|output) each), streamed from `model`.

    `widths()` gives each site's feature width from one row; `chunk(start, tokens)` gives the
    next `tokens` real tokens from `start` (one tensor per site, on the device, float32) and
    where the next chunk starts.
    """

    def __init__(
        self,
        model: nn.Module,
        rows: Dataset,
        sites: Sequence[tuple[str, str]],
        batch_size: int,
        device: torch.device,
        seed: int,
    ) -> None:
        self.model, self.rows, self.sites = model, rows, list(sites)
        self.batch_size, self.device, self.seed = batch_size, device, seed
        modules_of(model, [m for m, _ in self.sites], "sae.sites")  # each one there
        self.reads = [SiteRead(m, at) for m, at in self.sites]
        self.per_pass = -(-len(rows) // batch_size)  # model batches per pass over the rows
        self.batches_run = 0  # model batches run, for the summary

    def _batches(self, start: int) -> Iterator[list[torch.Tensor]]:
        """Each model batch's real tokens at every site, from model batch `start` on."""
        for batch in self._loaded(start):
            yield self._run(batch.to(self.device))

    def _loaded(self, start: int) -> Iterator[Batch]:
        """Each model batch as loaded (not yet run), from model batch `start` on."""
        index = start
        while True:
            first = (index % self.per_pass) * self.batch_size
            part = Subset(self.rows, range(first, len(self.rows)))
            loader = make_loader(part, self.batch_size, 0, self.seed, self.device)
            for loaded in loader:
                yield Batch.of(loaded, True)
                index += 1

    def _run(self, batch: Batch) -> list[torch.Tensor]:
        mask = batch.mask.bool()
        with torch.inference_mode():
            taken = take_sites(
                self.model,
                self.reads,
                lambda: self.model(batch.inputs),
                "sae.sites",
                keep=lambda value: value[mask].float(),  # a copy: the real tokens only
            )
        self.batches_run += 1
        return [value for value, _ in taken]

    def widths(self) -> list[int]:
        """Each site's feature width (one batch run)."""
        first = next(self._batches(0))
        for (module, at), vectors in zip(self.sites, first, strict=True):
            if vectors.dim() != 2:
                raise HookrunError(
                    f"sae.sites: {module}:{at} gives {list(vectors.shape[1:])} per token; "
                    "valid: a site of one vector per token"
                )
        self._widths = [int(v.shape[1]) for v in first]
        return list(self._widths)

    def chunk(
        self, start: Position, tokens: int, ranks: Ranks | None = None
    ) -> tuple[list[torch.Tensor], Position]:
        """The next `tokens` real tokens from `start`, one (tokens, D) tensor per site, and
        where the chunk after it starts (with `ranks`: the same on every rank, each having
        run the model on its share of the chunk's model batches).

        Interruptible: a signal stops it (with `ranks`: on every rank together).
        """
        if ranks is not None:
            return self._shared_chunk(start, tokens, ranks)
        with interruptible():
            return self.make_chunk(start, tokens)

    def make_chunk(
        self, start: Position, tokens: int, given_up: Callable[[], bool] | None = None
    ) -> tuple[list[torch.Tensor], Position]:
        """`chunk` in one process, outside the signal module's regions (a prefetch thread
        calls it): `given_up()`, asked before each model batch, stops it with Abandoned."""
        parts: list[list[torch.Tensor]] = [[] for _ in self.sites]
        have, index, offset = 0, start.batch, start.offset
        batches = self._batches(start.batch)
        while have < tokens:
            if given_up is not None and given_up():
                batches.close()
                raise Abandoned(f"the chunk from {start} was given up")
            per_site = next(batches)
            real = int(per_site[0].shape[0])
            take = min(real - offset, tokens - have)
            for site, vectors in enumerate(per_site):
                parts[site].append(vectors[offset : offset + take])
            have += take
            if offset + take < real:
                offset += take
            else:
                index, offset = index + 1, 0
        batches.close()
        return [torch.cat(p) for p in parts], Position(index, offset)

    def _shared_chunk(
        self, start: Position, tokens: int, ranks: Ranks
    ) -> tuple[list[torch.Tensor], Position]:
        """`chunk` over the ranks: model batch j of the chunk run by rank j % size, every
        rank's pieces gathered and laid out in the chunk's order."""
        plan: list[tuple[int, int]] = []  # each model batch of the chunk: (its rank, tokens)
        mine: list[list[torch.Tensor]] = [[] for _ in self.sites]
        have, index, offset = 0, start.batch, start.offset
        stopped = None
        loaded = self._loaded(start.batch)
        try:
            with interruptible():
                while have < tokens:
                    batch = next(loaded)
                    real = int(batch.mask.bool().sum())
                    take = min(real - offset, tokens - have)
                    owner = len(plan) % ranks.size
                    if owner == ranks.rank:
                        per_site = self._run(batch.to(self.device))
                        for site, vectors in enumerate(per_site):
                            mine[site].append(vectors[offset : offset + take])
                    plan.append((owner, take))
                    have += take
                    if offset + take < real:
                        offset += take
                    else:
                        index, offset = index + 1, 0
        except Interrupted as err:  # the others are told before they wait for this rank
            stopped = err
        finally:
            loaded.close()
        ranks.agreed_stop(stopped, self.device)
        chunk = []
        for site, width in enumerate(self._widths):
            local = torch.cat(mine[site]) if mine[site] else torch.empty(0, width)
            every = ranks.gather_uneven(local.to(self.device))
            at = [0] * ranks.size
            pieces = []
            for owner, take in plan:
                pieces.append(every[owner][at[owner] : at[owner] + take])
                at[owner] += take
            chunk.append(torch.cat(pieces))
        return chunk, Position(index, offset)


class Steps:
    """The steps' batches of a chunked stream: chunk c shuffled by its own generator."""

    def __init__(self, seed: int, chunk: int, batch: int) -> None:
        self.seed, self.chunk, self.batch = seed, chunk, batch
        self.per_chunk = chunk // batch

    def order(self, index: int, device: torch.device) -> torch.Tensor:
        """Chunk `index`'s shuffle."""
        state = np.random.SeedSequence([self.seed, index]).generate_state(1)[0]
        generator = torch.Generator().manual_seed(int(state))
        return torch.randperm(self.chunk, generator=generator).to(device)


class FileActivations:
    """Token vectors of an earlier run's captures at `sites`, read through TokenBatches.

    Each site's key is its capture's path (`captures/<module>/<site>`); a transcoder's two
    sites are read together, token by token.
    """

    def __init__(
        self, path: Path, sites: Sequence[tuple[str, str]], batch: int, buffer: int, seed: int
    ) -> None:
        self.path = path
        self.keys = [capture_key(module, at) for module, at in sites]
        if not path.is_file():
            raise HookrunError(f"sae.from: {path} does not exist; valid: a run's captures.h5")
        try:
            with open_readonly(path) as f:
                for key, (module, at) in zip(self.keys, sites, strict=True):
                    _check_key(f, key, f"{module}:{at}", path)
        except OSError as err:
            raise HookrunError(f"sae.from: {path} cannot be read ({err})") from None
        try:
            self.reader = TokenBatches(
                path, self.keys, batch_size=batch, buffer=buffer, seed=seed, drop_last=True
            )
        except (KeyError, ValueError) as err:
            raise HookrunError(f"sae.from: {path}: {err}") from None
        self.per_epoch = len(self.reader)
        if self.per_epoch < 1:
            raise HookrunError(
                f"sae.from: {path} holds fewer real tokens than one batch (sae.batch: "
                f"{batch}); valid: a file of at least one batch of tokens"
            )
        self.widths = list(self.reader.widths)

    def batches(self, step: int) -> Iterator[list[torch.Tensor]]:
        """The steps' batches from step `step` on, epoch after epoch."""
        epoch, skip = divmod(step, self.per_epoch)
        while True:
            self.reader.set_epoch(epoch)
            for got in self.reader.batches(skip):  # a resume: the epoch's from `skip`
                yield list(got) if isinstance(got, tuple) else [got]
            epoch, skip = epoch + 1, 0


def _check_key(f: h5py.File, key: str, site: str, path: Path) -> None:
    """A capture that is one row per token: every row a sample's tokens, not folded, not one
    per batch, not listed positions."""
    if key not in f:
        held = sorted(
            f"{layer}:{s}"
            for layer in f.get("captures", {})
            for s in f["captures"][layer]
            if isinstance(f["captures"][layer][s], h5py.Dataset)
        )
        raise HookrunError(
            f"sae.from: {path} has no capture of {site} ({key}); valid: {', '.join(held) or 'none'}"
        )
    ds = f[key]
    attrs = ds.attrs
    if "per_batch" in attrs or "folded_rows" in attrs or ds.ndim not in (2, 3):
        what = (
            "one row per batch"
            if "per_batch" in attrs
            else "several rows per sample"
            if "folded_rows" in attrs
            else f"shape {list(ds.shape)}"
        )
        raise HookrunError(
            f"sae.from: {key} in {path} is {what}, not one vector per token ((N, T, D) or "
            "(N, D)); valid: a capture at every token, as experiment=lm_cache makes"
        )
