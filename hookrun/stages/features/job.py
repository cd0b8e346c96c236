"""The features job (experiment=features): every unit of every site the `hooks:` name — each
latent of a dictionary (`action: sae | transcoder`: the site's clean activations encoded by
the hook's dictionary, nothing spliced), each unit of a captured site (`action: capture`:
the last axis of a (N, T, D) site, a conv layer's channels at every position of (N, C, H, W))
— streamed over the rows once, its dashboard kept exact in bounded memory (state.py).

1. Claim: the run's file locked (rank 0); one that exists is refused unless resumed or
   overwritten. Under torchrun each rank takes a contiguous run of whole batches
   (scale/distributed.py: the batches one process would run).
2. Before any work: the model and rows built, the hooks compiled against the model, each
   site's shape from one row, the state's bytes checked against the machine's memory.
3. Batches: each batch's site tensors taken by forward hooks (the forward stopped after
   the last site: runtime/sitevalues.py) and added to each site's state. A batch is whole:
   a signal is acted on between batches.
4. Every `features.checkpoint_rows` rows and when a signal stops it: a checkpoint (every
   site's state and the next row, <run dir>/checkpoints/features_state[.rank<r>-of-<w>].pt,
   replaced whole). A resume starts at that row: the same batches, the same numbers.
5. The end: each rank's final state saved; rank 0 merges them (exactly: state.py), adds the
   logit effects and image patches, and writes the file whole, marked complete.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Subset

from hookrun.data.batch import Batch
from hookrun.data.loader import make_loader
from hookrun.data.shards import World, batch_shard, world_from_env
from hookrun.data.tokens import token_rows
from hookrun.errors import HookrunError, Interrupted
from hookrun.io.layout import capture_key
from hookrun.io.lock import WriterLock
from hookrun.io.sink import check_sink_path
from hookrun.memory import check_fits
from hookrun.models.adapter import adapt
from hookrun.models.language import vocabulary_texts
from hookrun.runtime.hooks import run_mode
from hookrun.runtime.plan import compile_plan
from hookrun.runtime.sitevalues import SiteRead, take_sites
from hookrun.runtime.splice import Splice
from hookrun.signals import deferred, interruptible, stop_if_signalled
from hookrun.stage import JobContext
from hookrun.stages.features.config import FeaturesConfig
from hookrun.stages.features.extras import logit_effects, receptive_fields, residual_stream
from hookrun.stages.features.runfile import Written, write
from hookrun.stages.features.state import SiteState
from hookrun.training import checkpoint

__all__ = ["run_features", "Done", "KINDS"]

log = logging.getLogger("hookrun")

KINDS = ("sae", "transcoder", "capture")


@dataclass(frozen=True)
class Done:
    """What the job left: its file and how fast it went."""

    path: Path
    rows: int
    seconds: float
    rank: int = 0


@dataclass
class _Site:
    """One site of the job: where it reads, and what its units are."""

    hook: str
    module: str
    at: str
    action: Any  # the hook's action (a Splice for a dictionary)
    units: int = 0
    shape: tuple[int, ...] = ()  # the site's tensor per row

    @property
    def dictionary(self) -> Any:
        return self.action.by_layer[self.module] if isinstance(self.action, Splice) else None

    @property
    def read(self) -> SiteRead:
        transcoder = isinstance(self.action, Splice) and self.action.transcoder
        return SiteRead(self.module, self.at, with_input=transcoder)


def check_hooks(spec: Any) -> None:
    """Refuse, before any work, hooks the job cannot read: none of sae, transcoder, capture;
    any other action (the job reads the model as it is); a site that is no module's input
    or output."""
    hooks = list(spec.hooks)
    readable = [h for h in hooks if h.action.name in KINDS]
    if not readable:
        named = ", ".join(f"{h.name}: {h.action.name}" for h in hooks) or "none"
        raise HookrunError(
            f"hooks: {named}; valid: a hook with action sae, transcoder or capture (features "
            "reads every unit of its site)"
        )
    for h in hooks:
        if h.action.name not in KINDS:
            raise HookrunError(
                f"hooks.{h.name}.action: {h.action.name!r} with features (it reads the model "
                f"as it is); valid: {', '.join(KINDS)}"
            )
        if h.at.value not in ("input", "output") or h.select.function:
            raise HookrunError(
                f"hooks.{h.name}.at: {h.at.value!r}; valid: input, output (a module's, "
                "select by name, regex or type)"
            )


class _Job:
    def __init__(self, spec: Any, config: FeaturesConfig, ctx: JobContext) -> None:
        self.spec, self.config, self.ctx = spec, config, ctx
        self.run_dir = ctx.run_dir
        self.path = (
            Path(spec.sink.path).expanduser() if spec.sink.path else self.run_dir / "captures.h5"
        )
        self.world: World = world_from_env()
        self.device = ctx.device
        self.lock: WriterLock | None = None

    @property
    def checkpoint_name(self) -> str:
        w = self.world
        return (
            "features_state.pt" if not w.parallel else f"features_state.rank{w.rank}-of-{w.size}.pt"
        )

    # ------------------------------------------------------------------ before any work
    def claim(self) -> None:
        if self.world.rank == 0:
            self.lock = WriterLock(self.path)
        try:
            if not self.spec.resume:
                check_sink_path(self.path, self.spec.sink.overwrite)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def prepare(self) -> None:
        with interruptible():
            self.model, self.rows, weights_file = self.ctx.load(self.spec)
            self.header = self.ctx.header(self.spec, weights_file)
            self.tokens = token_rows(self.rows)
            self.text = self.tokens is not None
            plan = compile_plan(tuple(self.spec.hooks), self.model)
            self.sites = [
                _Site(h.name, layer, h.site.value, h.action)
                for h in plan.hooks
                for layer in h.layers
            ]
            if any(s.module == "input" for s in self.sites):
                raise HookrunError(
                    "hooks: a features site at the model's input; valid: a module's input or output"
                )
            self._probe()
            window = tuple(self.config.window) if self.text else None
            width = 0 if window is None else sum(window) + 1
            need = sum(
                SiteState.nbytes(
                    s.units, self.config.k, width, self.config.bins, self.config.per_group
                )
                for s in self.sites
            )
            check_fits("features.k", self.config.k, need, "every unit's dashboard state")
            self.states = [
                SiteState(
                    s.units,
                    self.config.k,
                    window,
                    self.config.bins,
                    self.config.per_group,
                    self.device,
                )
                for s in self.sites
            ]
            self.shard = batch_shard(len(self.rows), self.spec.batch_size, self.world)

    def _probe(self) -> None:
        """Each site's tensor per row, from row 0 (checks a dictionary's width)."""
        loader = make_loader(Subset(self.rows, range(1)), 1, 0, self.spec.seed, self.device)
        batch = Batch.of(next(iter(loader)), self.text).to(self.device)
        values = self._take(batch)
        for s, (value, _) in zip(self.sites, values, strict=True):
            s.shape = tuple(value.shape[1:])
            key = f"hooks.{s.hook}"
            if value.dim() not in (2, 3, 4):
                raise HookrunError(
                    f"{key}: {s.module}:{s.at} is {list(s.shape)} per row; valid: a site of "
                    "(T, D) tokens, (D,) one vector, or (C, H, W) maps"
                )
            if isinstance(s.action, Splice):
                s.action.prepare(s.shape, capture_key(s.module, s.at), key, len(self.rows))
                s.units = int(s.dictionary.d_sae)
            else:
                s.units = int(s.shape[0] if value.dim() == 4 else s.shape[-1])

    def _take(self, batch: Batch) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        with torch.inference_mode():
            return take_sites(
                self.model,
                [s.read for s in self.sites],
                lambda: self.model(batch.inputs),
                "hooks",
            )

    # ------------------------------------------------------------------ the batches
    def _acts(self, s: _Site, value: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor:
        """A site's batch as (n, positions, units) float32: a dictionary's latents, or the
        site's own units (a conv map's channels at each y*W+x)."""
        if isinstance(s.action, Splice):
            with torch.inference_mode():
                value = s.action.read(capture_key(s.module, s.at), value, given).latents
        value = value.float()
        if value.dim() == 4:
            n, c, h, w = value.shape
            return value.permute(0, 2, 3, 1).reshape(n, h * w, c)
        return value[:, None, :] if value.dim() == 2 else value

    def batches(self, start: int) -> int:
        """Every batch of the shard from its row `start`; returns the rows done."""
        bs, shard = self.spec.batch_size, self.shard
        done, since = start, 0
        part = Subset(self.rows, range(shard.start + start, shard.stop))
        loader = make_loader(part, bs, 0, self.spec.seed, self.device)
        for loaded in loader:
            batch = Batch.of(loaded, self.text).to(self.device)
            n = batch.rows
            values = self._take(batch)
            rows = torch.arange(shard.start + done, shard.start + done + n)
            with deferred():  # a batch is whole: a signal waits for its end
                for s, state, (value, given) in zip(self.sites, self.states, values, strict=True):
                    acts = self._acts(s, value, given)
                    if self.text:
                        mask, ids = batch.mask.bool(), batch.tokens.long()
                    else:
                        mask = torch.ones(acts.shape[:2], dtype=torch.bool, device=acts.device)
                        ids = None
                    state.update(acts, rows, mask, ids)
                done += n
                since += n
            if since >= self.config.checkpoint_rows and done < len(shard):
                with deferred():
                    self.save(done, False)
                since = 0
            stop_if_signalled()
        return done

    # ------------------------------------------------------------------ checkpoints
    def save(self, done: int, finished: bool) -> None:
        checkpoint.save(
            self.run_dir,
            {
                "config": self.spec.config_yaml,
                "world": self.world.size,
                "done": done,
                "finished": finished,
                "states": [state.state_dict() for state in self.states],
            },
            self.checkpoint_name,
        )

    def resume_from(self) -> dict | None:
        if not self.spec.resume:
            return None
        if self.path.exists() and _complete(self.path):
            return {"complete": True}
        return checkpoint.resumed(self.run_dir, self.spec.config_yaml, self.checkpoint_name)

    # ------------------------------------------------------------------ the end
    def merged(self) -> list[SiteState]:
        """Rank 0: every rank's final state merged, in rank order (the same as one process)."""
        if not self.world.parallel:
            return self.states
        states = self.states
        for rank in range(1, self.world.size):
            if not batch_shard(len(self.rows), self.spec.batch_size, World(rank, self.world.size)):
                continue
            name = f"features_state.rank{rank}-of-{self.world.size}.pt"
            saved = checkpoint.load(self.run_dir, name)
            if saved is None or not saved["finished"]:
                raise HookrunError(f"merge: rank {rank}'s state {name} is missing or unfinished")
            for state, theirs in zip(states, saved["states"], strict=True):
                other = SiteState(
                    state.units, state.k, state.window, state.bins, state.per_group, self.device
                )
                other.load_state_dict(theirs)
                state.merge(other)
        return states

    def written(self, states: list[SiteState]) -> list[Written]:
        out = []
        c = self.config
        for s, state in zip(self.sites, states, strict=True):
            finished = state.finish(c.groups, c.grouping)
            arrays = dict(finished.arrays)
            d = s.dictionary
            attrs = {
                "kind": "sae" if d is not None else "units",
                "units": s.units,
                "modality": "text" if self.text else "image",
                "dictionary": d.name if d is not None else "",
                "hook_name": (d.hook_name or "") if d is not None else "",
                "hook": s.hook,
                "k": c.k,
                "window_before": int(c.window[0]) if self.text else 0,
                "window_after": int(c.window[1]) if self.text else 0,
                "tokens": finished.tokens,
                "rows": finished.rows,
                "groups": c.groups,
                "per_group": c.per_group,
                "grouping": c.grouping,
                "bins": c.bins,
                "action": s.action.name,
            }
            residual = residual_stream(self.model, s.module, s.at)
            if d is not None and c.logits and self.text and not d.transcoder and residual:
                effects = None if s.action.affine else logit_effects(self.model, d, c.logits)
                if effects is not None:
                    arrays |= {f"logits/{k}": v for k, v in effects.items()}
            if not self.text:
                arrays |= self._patches(s, arrays)
            out.append(Written(s.module, s.at, attrs, arrays))
        return out

    def _patches(self, s: _Site, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A conv site's top contexts' receptive fields (extras.receptive_fields); a site of
        one vector per row (or tokens of an image model): the whole image."""
        rows, tokens = arrays["top/row"], arrays["top/token"]

        def image_of(row: int) -> torch.Tensor:
            return self.rows[row][0].to(self.device).float()

        if len(s.shape) == 3 and not isinstance(s.action, Splice):
            boxes, patches = receptive_fields(
                self.model, s.read, image_of, rows, tokens, int(s.shape[2]), self.config.patch
            )
            return {"top/box": boxes, "top/patch": patches}
        first = image_of(0)
        h, w = int(first.shape[-2]), int(first.shape[-1])
        boxes = np.where(rows[..., None] >= 0, np.array([0, 0, h, w]), -1).astype(np.int64)
        return {"top/box": boxes}

    def vocab(self) -> list[str] | None:
        if not self.text:
            return None
        tokenizer = adapt(self.model).tokenizer
        if tokenizer is None:
            return None
        return vocabulary_texts(tokenizer, int(self.model.config.vocab_size))

    def write(self, status: str, error: str = "", sites: list | None = None) -> None:
        write(
            self.path,
            self.header,
            sites or [],
            self.vocab() if sites else None,
            status=status,
            error=error,
            rows=len(self.rows),
        )


def _complete(path: Path) -> bool:
    from hookrun.io.layout import open_readonly, read_state

    try:
        with open_readonly(path) as f:
            return read_state(f).status == "complete"
    except OSError:
        return False


def _barrier(world: World) -> None:
    if world.parallel:
        torch.distributed.barrier()


def run_features(spec: Any, config: FeaturesConfig, ctx: JobContext) -> Done:
    """Run the features job of `spec` (see the module docstring).

    Raises:
        HookrunError: bad input, before any work.
        Interrupted: a signal stopped it; its checkpoint says where.
    """
    check_hooks(spec)
    run = _Job(spec, config, ctx)
    started = time.perf_counter()
    run.claim()
    try:
        saved = run.resume_from()
        if saved is not None and saved.get("complete"):
            return Done(run.path, 0, 0.0, run.world.rank)
        run.prepare()
        start = 0
        if saved is not None:
            if int(saved["world"]) != run.world.size:
                raise HookrunError(
                    f"resume: the checkpoint was made by {saved['world']} processes, this run "
                    f"has {run.world.size}; valid: resume with the same number"
                )
            for state, theirs in zip(run.states, saved["states"], strict=True):
                state.load_state_dict(theirs)
            start = int(saved["done"])
        _barrier(run.world)  # every rank's checks passed before rank 0 writes
        model: nn.Module = run.model
        with run_mode(model):
            try:
                if run.world.rank == 0:
                    run.write("running")
                done = start
                if not (saved is not None and saved.get("finished")):
                    done = run.batches(start)
                with deferred():
                    run.save(done, True)
            except Interrupted as err:
                with deferred():
                    run.save(_done_of(run, err), False)
                    if run.world.rank == 0:
                        run.write("interrupted", str(err))
                raise
            _barrier(run.world)
            if run.world.rank == 0:
                with deferred():
                    sites = run.written(run.merged())
                    run.write("complete", sites=sites)
                    for rank in range(run.world.size):
                        name = (
                            run.checkpoint_name
                            if not run.world.parallel
                            else f"features_state.rank{rank}-of-{run.world.size}.pt"
                        )
                        checkpoint.path_of(run.run_dir, name).unlink(missing_ok=True)
        return Done(run.path, len(run.rows), time.perf_counter() - started, run.world.rank)
    finally:
        run.release()


def _done_of(run: _Job, err: Interrupted) -> int:
    """The rows of the shard in the states when a signal stopped the batches (a batch is
    added whole or not at all)."""
    return run.states[0].rows if run.states else 0
