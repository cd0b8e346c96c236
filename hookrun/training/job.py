"""A training job (experiment=train_sae): every dictionary of the `sae:` node trained from the
same activations, checkpointed, resumed, saved in SAELens's format and scored.

The job, in order:

1. Claim: the run's file (`sink.path`, default <run dir>/captures.h5) locked; one that
   exists is refused unless resumed (`resume=true`) or overwritten.
2. Before any work: the model and rows built, the sites checked against the model (each
   site's width from one batch), each dictionary's width and k checked against it, the
   cache's keys checked (`sae.from`).
3. Steps: each step's batch of token vectors (sources.py) goes to every dictionary's
   `Trainer.step`. Making a chunk of activations is interruptible (a signal stops it at
   once: nothing of it is kept); a step is not cut (its update is whole), and a signal is
   acted on between steps.
4. Every `sae.checkpoint_tokens`, and when a signal stops the job: a checkpoint
   (checkpoint.py: every trainer's state, the data's position, the curves) and the run's
   file written again from it (runfile.py), both replaced whole. A job killed in between
   resumes from the last checkpoint and repeats the steps after it exactly: the weights it
   ends with are those of a job never stopped.
5. The end: each dictionary saved to <run dir>/sae/<name>/ (SAELens's folder), scored on the
   held-out rows by a run of the scores stage (<run dir>/scores/<name>/captures.h5), its
   scores copied into the run's file, which is only then marked complete.

Under torchrun (WORLD_SIZE > 1: data parallel, training/parallel.py) every rank trains the
same dictionaries on its contiguous slice of each step's global batch `sae.batch` (which
the ranks must divide), the step being the one-process step on the whole batch: streamed,
each rank runs the model on its share of each chunk's model batches and the chunk is
gathered whole on every rank before its seeded shuffle; from a file, every rank reads each
step's batch and keeps its slice. Rank 0 alone claims the file, writes the checkpoints, the
run's file and the saved folders; every rank resumes from the same checkpoint; the ranks
stop together on a signal; the scoring runs are torchrun runs of the rows' pipeline, every
rank scoring its share of the held-out rows.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Subset
from tqdm import tqdm

from hookrun.dictionaries.sites import hook_name_of
from hookrun.errors import HookrunError, Interrupted
from hookrun.io.lock import WriterLock
from hookrun.io.sink import check_sink_path
from hookrun.runtime.hooks import run_mode
from hookrun.signals import deferred, interruptible, stop_if_signalled
from hookrun.stage import JobContext
from hookrun.training import checkpoint, parallel, prefetch, runfile
from hookrun.training.config import Dictionary, TrainJob, check_width
from hookrun.training.dictionary import Hyper, Trainer
from hookrun.training.sources import FileActivations, ModelActivations, Position, Steps

__all__ = ["train", "Trained"]

log = logging.getLogger("hookrun")

# A saved dictionary scored: (its folder, the dictionary, the scoring run's folder, the
# job's model and the file it was loaded from) → its scores {"fields", "values", "file"},
# or None.
Scorer = Callable[[Path, Dictionary, Path, torch.nn.Module, Path | None], dict | None]

CURVE_FIELDS = ("step", "tokens", "loss", "mse", "explained_variance", "l0", "dead", "lr")


@dataclass
class Trained:
    """What the job left: the run's file, each dictionary's folder and scores."""

    path: Path
    folders: dict[str, Path] = field(default_factory=dict)
    scores: dict[str, dict] = field(default_factory=dict)
    steps: int = 0
    tokens_per_second: float = 0.0  # over every rank: global batch tokens per second
    main: bool = True  # the process that wrote it (rank 0, or the only one)


@dataclass
class _State:
    """Everything a resumed job continues from (the checkpoint's contents)."""

    step: int = 0
    chunk: int = 0  # the chunk the next step reads (streamed)
    chunk_start: Position = field(default_factory=Position)
    scales: dict[str, float] = field(default_factory=dict)
    curves: dict[str, list[list[float]]] = field(default_factory=dict)


def _sites(job: TrainJob) -> list[tuple[str, str]]:
    """Every site read, once each, in the order the dictionaries first name them."""
    seen: list[tuple[str, str]] = []
    for d in job.dictionaries:
        for site in (d.site.source, d.site.target):
            if site not in seen:
                seen.append(site)
    return seen


def _hyper(d: Dictionary, d_in: int, d_out: int, steps: int, scale: float) -> Hyper:
    width = d.resolved_width(d_in)
    nested = d.matryoshka_widths
    check_width(f"sae ({d.name})", width, d.k, nested)  # a width from expansion: checked now
    if d.architecture == "matryoshka_batchtopk" and (not nested or nested[-1] != width):
        nested = (*nested, width)
    return Hyper(
        architecture=d.architecture,
        d_in=d_in,
        d_out=d_out,
        width=width,
        k=d.k,
        l1_coefficient=d.l1_coefficient,
        l1_warmup_steps=d.l1_warmup_steps,
        l0_coefficient=d.l0_coefficient,
        jumprelu_bandwidth=d.jumprelu_bandwidth,
        jumprelu_init_threshold=d.jumprelu_init_threshold,
        aux_k_coefficient=d.aux_k_coefficient,
        matryoshka_widths=tuple(nested),
        lr=d.lr,
        lr_warmup_steps=d.lr_warmup_steps,
        lr_decay_steps=d.lr_decay_steps,
        total_steps=steps,
        skip=d.site.skip,
        transcoder=d.site.transcoder,
        scale=scale,
    )


def _generator(seed: int, name: str) -> torch.Generator:
    """A dictionary's own initialisation: from the run's seed and its name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _scale(vectors: torch.Tensor) -> float:
    """SAELens's expected_average_only_in factor: sqrt(d_in) over the mean norm."""
    norm = float(vectors.double().norm(dim=1).mean())
    if not math.isfinite(norm) or norm == 0:
        raise HookrunError(
            "sae.normalize: expected_average_only_in, but the site's vectors have mean norm "
            f"{norm}; valid: none"
        )
    return math.sqrt(vectors.shape[1]) / norm


class _Job:
    def __init__(self, spec: Any, job: TrainJob, ctx: JobContext) -> None:
        self.spec, self.job, self.ctx, self.config = spec, job, ctx, job.config
        self.sites = _sites(job)
        self.run_dir = ctx.run_dir
        self.path = (
            Path(spec.sink.path).expanduser() if spec.sink.path else self.run_dir / "captures.h5"
        )
        self.state = _State()
        self.device = ctx.device
        self.writer: Any = None  # logger=tensorboard: the curves there too
        self.ranks = parallel.joined()  # None: one process
        self._stopped: Interrupted | None = None  # this rank's signal, under torchrun
        self._pending: Any = None  # the ranks' stop flags being reduced
        self._first_chunk: Any = None  # (vectors, after), made for the first scales
        self.main = self.ranks is None or self.ranks.main

    # ------------------------------------------------------------------ before any work
    def claim(self) -> WriterLock | None:
        """The writer's lock (rank 0's; None on the other ranks), the path checked."""
        ranks = self.ranks
        if ranks is None:
            return self._claim()
        batch = self.config.batch
        if batch % ranks.size:
            raise HookrunError(
                f"sae.batch: {batch} under torchrun with {ranks.size} processes; valid: a "
                f"multiple of {ranks.size} (each process steps on an equal slice of it)"
            )
        if self.config.prefetch == "true":
            raise HookrunError(
                f"sae.prefetch: true under torchrun with {ranks.size} processes; valid: auto "
                "or false (the prefetch thread's gathers would interleave with the steps')"
            )
        # Rank 0 checks and claims, then tells the others (its refusal too): checking for
        # themselves, they could see the file it is about to write.
        lock: list[WriterLock] = []
        ranks.from_main(lambda: lock.append(self._claim()))
        return lock[0] if lock else None

    def _claim(self) -> WriterLock:
        lock = WriterLock(self.path)
        try:
            if not self.spec.resume:
                check_sink_path(self.path, self.spec.sink.overwrite)
                if self.spec.sink.overwrite:
                    checkpoint.remove(self.run_dir)
        except BaseException:
            lock.release()
            raise
        return lock

    def prepare(self) -> None:
        with interruptible():
            self.model, rows, self.weights_file = self.ctx.load(self.spec)
            held = self.config.heldout.rows
            if held >= len(rows):
                raise HookrunError(
                    f"sae.heldout.rows: {held} of the dataset's {len(rows)} rows leaves none "
                    f"to train on; valid: 0 to {len(rows) - 1}"
                )
            self.rows = Subset(rows, range(held, len(rows)))
            self.header = self.ctx.header(self.spec, self.weights_file)
            streamed = ModelActivations(
                self.model, self.rows, self.sites, self.spec.batch_size, self.device, self.spec.seed
            )
            if self.config.from_ is None:
                self.source: Any = streamed
                widths = streamed.widths()
            else:
                self.source = FileActivations(
                    Path(self.config.from_).expanduser(),
                    self.sites,
                    self.config.batch,
                    self.config.buffer,
                    self.spec.seed,
                )
                widths = self.source.widths
            self.width = dict(zip(self.sites, widths, strict=True))
            self.steps = Steps(self.spec.seed, self.config.chunk, self.config.batch)
            # Widths and k checked for every dictionary before any is made.
            for d in self.job.dictionaries:
                _hyper(d, self.width[d.site.source], self.width[d.site.target], 1, 1.0)

    def resume_from(self) -> dict | None:
        if not self.spec.resume:
            return None
        if self.path.exists() and runfile.is_complete(self.path):
            return {"complete": True}
        return checkpoint.resumed(self.run_dir, self.spec.config_yaml)

    # ------------------------------------------------------------------ the steps
    @property
    def _autocast(self) -> torch.dtype | None:
        """sae.dtype as torch.autocast's dtype; float32: no autocast."""
        return None if self.config.dtype == "float32" else getattr(torch, self.config.dtype)

    def _trainers(self, saved: dict | None) -> list[Trainer]:
        trainers = []
        for d in self.job.dictionaries:
            scale = self.state.scales.get(d.name, 1.0)
            hyper = _hyper(
                d,
                self.width[d.site.source],
                self.width[d.site.target],
                self.config.steps,
                scale,
            )
            trainer = Trainer(
                hyper,
                _generator(self.spec.seed, d.name),
                self.device,
                autocast=self._autocast,
                ranks=self.ranks,
            )
            if saved is not None:
                trainer.load_state_dict(saved["trainers"][d.name])
            trainers.append(trainer)
        return trainers

    def _first_scales(self) -> None:
        """expected_average_only_in: each dictionary's factor from the first chunk (or the
        first batches of the file), before the first step."""
        if self.config.normalize == "none":
            return
        if isinstance(self.source, ModelActivations):
            vectors, after = self.source.chunk(Position(), self.config.chunk, self.ranks)
            self._first_chunk = (vectors, after)  # the first steps' chunk: not made twice
            by_site = dict(zip(self.sites, vectors, strict=True))
        else:
            batches = self.source.batches(0)
            first = [next(batches) for _ in range(min(10, self.source.per_epoch))]
            batches.close()
            by_site = {site: torch.cat([b[i] for b in first]) for i, site in enumerate(self.sites)}
        for d in self.job.dictionaries:
            self.state.scales[d.name] = _scale(by_site[d.site.source])

    def _batches(self):
        """(step, [vectors per site]) from the state's step to the last.

        Streamed, the state names the chunk the next step reads and where it starts; it is
        moved on before the last step of a chunk is handed out, so the checkpoint after
        that step names the next chunk. Under torchrun: this rank's slice of each batch.
        """
        config, step = self.config, self.state.step
        mine = slice(None) if self.ranks is None else self.ranks.part(config.batch)
        if isinstance(self.source, FileActivations):
            for got in self.source.batches(step):
                if step >= config.steps:
                    return
                yield step, [v[mine].to(self.device) for v in got]
                step += 1
            return
        per_chunk, loaded = self.steps.per_chunk, None
        ahead = None
        if prefetch.wanted(config.prefetch, self.device, self.ranks is not None):
            ahead = prefetch.Prefetch(self.source, self.device)
        try:
            while step < config.steps:
                index = step // per_chunk
                if loaded != index:
                    start = self.state.chunk_start
                    if self._first_chunk is not None and start == Position():
                        (vectors, after), self._first_chunk = self._first_chunk, None
                    elif ahead is not None and ahead.holds(start):
                        vectors, after = ahead.take()
                    else:
                        vectors, after = self.source.chunk(start, config.chunk, self.ranks)
                    order, loaded = self.steps.order(index, self.device), index
                    if ahead is not None and (index + 1) * per_chunk < config.steps:
                        ahead.start(after, config.chunk)  # the next chunk, while this one steps
                at = (step % per_chunk) * config.batch
                batch = [v.index_select(0, order[at : at + config.batch][mine]) for v in vectors]
                if (step + 1) % per_chunk == 0:
                    self.state.chunk, self.state.chunk_start = index + 1, after
                yield step, batch
                step += 1
        finally:
            if ahead is not None:
                ahead.close()

    def run(self, trainers: list[Trainer]) -> float:
        config = self.config
        index = {site: i for i, site in enumerate(self.sites)}
        names = [d.name for d in self.job.dictionaries]
        for name in names:
            self.state.curves.setdefault(name, [])
        started, done = time.perf_counter(), 0
        # One bar on the main rank (`progress`), the first dictionary's last logged loss
        # beside it: a long streamed job says where it is.
        bar = tqdm(
            total=config.steps,
            initial=self.state.step,
            desc="train_sae",
            unit="step",
            disable=not (self.spec.progress and self.main),
        )
        with closing(self._batches()) as batches, bar:  # closed on every exit
            for step, vectors in batches:
                with deferred():  # a step's update is whole: a signal waits for its end
                    for d, trainer in zip(self.job.dictionaries, trainers, strict=True):
                        x = vectors[index[d.site.source]]
                        target = vectors[index[d.site.target]] if d.site.transcoder else None
                        logged = (step + 1) % config.log_steps == 0 or step + 1 == config.steps
                        # the metrics only where a row is logged (under torchrun: collectives)
                        metrics = trainer.step(x, target, metrics=logged)
                        if logged:
                            row = [float(step + 1), float((step + 1) * config.batch)]
                            row += [float(metrics.get(f, math.nan)) for f in CURVE_FIELDS[2:]]
                            self.state.curves[d.name].append(row)
                            self._tensorboard(d.name, step + 1, metrics)
                    self.state.step = step + 1
                    done += 1
                bar.update(1)
                if logged and self.state.curves[names[0]]:
                    last = self.state.curves[names[0]][-1]
                    bar.set_postfix_str(_postfix(last), refresh=False)
                if (
                    self.state.step % config.checkpoint_steps == 0
                    and self.state.step < config.steps
                ):
                    with deferred():
                        self.checkpoint(trainers, "running")
                self._stop_if_signalled()
        self._stop_if_signalled(last=True)
        seconds = time.perf_counter() - started
        return done * config.batch / seconds if seconds > 0 and done else 0.0

    def _stop_if_signalled(self, last: bool = False) -> None:
        """Between steps: stop on a signal. Under torchrun every rank stops at the same
        step, when any one was signalled: the ranks' flags after a step are reduced while
        the next step computes (a collective's latency, a millisecond here, is not waited
        for), and acted on after it; `last`: after the last step, the one in flight ended."""
        if self.ranks is None:
            stop_if_signalled()
            return
        try:
            stop_if_signalled()
        except Interrupted as err:
            self._stopped = self._stopped or err
        if self._pending is not None:
            work, flag = self._pending
            self._pending = None
            work.wait()
            if flag.item():  # the same on every rank: every rank stops here
                raise self._stopped or parallel.told()
        if not last:
            self._pending = self.ranks.any_async(self._stopped is not None, self.device)

    def _tensorboard(self, name: str, step: int, metrics: dict[str, float]) -> None:
        if self.writer is None:
            return
        for key, value in metrics.items():
            self.writer.add_scalar(f"{name}/{key}", value, step)

    def checkpoint(self, trainers: list[Trainer], status: str, error: str = "") -> None:
        if not self.main:  # every rank holds the same state: rank 0 writes it
            return
        state = {
            "config": self.spec.config_yaml,
            "step": self.state.step,
            "chunk": self.state.chunk,
            "chunk_start": (self.state.chunk_start.batch, self.state.chunk_start.offset),
            "scales": dict(self.state.scales),
            "curves": {k: [list(r) for r in v] for k, v in self.state.curves.items()},
            "trainers": {
                d.name: t.state_dict() for d, t in zip(self.job.dictionaries, trainers, strict=True)
            },
        }
        checkpoint.save(self.run_dir, state)
        self.write_file(status, error)

    def restore(self, saved: dict) -> None:
        self.state = _State(
            step=int(saved["step"]),
            chunk=int(saved["chunk"]),
            chunk_start=Position(*saved["chunk_start"]),
            scales=dict(saved["scales"]),
            curves={k: [list(r) for r in v] for k, v in saved["curves"].items()},
        )

    def write_file(self, status: str, error: str = "", trained: Trained | None = None) -> None:
        if not self.main:
            return
        dictionaries = []
        for d in self.job.dictionaries:
            width = d.resolved_width(self.width[d.site.source])
            attrs = {
                "name": d.name,
                "architecture": d.architecture,
                "site": d.site.label,
                "width": width,
                "k": -1 if d.k is None else d.k,
                "hook_name": self.hook_names[d.name],
                "folder": "",
                "sha256": "",
                "scale": self.state.scales.get(d.name, 1.0),
            }
            if trained is not None and d.name in trained.folders:
                folder = trained.folders[d.name]
                attrs["folder"] = str(folder)
                attrs["sha256"] = runfile.sha256_of(folder / "sae_weights.safetensors")
            curves = np.asarray(self.state.curves.get(d.name, []), dtype=np.float64)
            scores = trained.scores.get(d.name) if trained is not None else None
            dictionaries.append(
                runfile.Written(attrs, curves.reshape(-1, len(CURVE_FIELDS)), scores)
            )
        runfile.write(
            self.path,
            self.header,
            dictionaries,
            CURVE_FIELDS,
            status=status,
            error=error,
            step=self.state.step,
            steps=self.config.steps,
        )

    # ------------------------------------------------------------------ the end
    def save(self, trainers: list[Trainer]) -> dict[str, Path]:
        """Each dictionary's folder (rank 0 writes them; every rank is told where)."""
        folders = {}
        for d, trainer in zip(self.job.dictionaries, trainers, strict=True):
            folder = self.run_dir / "sae" / d.name
            folders[d.name] = folder
            if not self.main:
                continue
            trainer.save(
                folder,
                self.hook_names[d.name],
                {
                    "hookrun_site": d.site.label,
                    "model_name": self.model_label,
                },
            )
        return folders


def train(spec: Any, job: TrainJob, ctx: JobContext, score: Scorer | None = None) -> Trained:
    """Run the training job `job` of `spec` (see the module docstring); `score(folder, d,
    scores_dir, model, weights_file)` scores a saved dictionary on the held-out rows with the
    job's model ({"fields", "values", "file"}, or None where it cannot be scored).

    Raises:
        HookrunError: bad input, before any work.
        Interrupted: a signal stopped it; a checkpoint and the file say where.
    """
    run = _Job(spec, job, ctx)
    lock = run.claim()
    try:
        saved = run.resume_from()
        if saved is not None and saved.get("complete"):
            return Trained(run.path, steps=job.config.steps, main=run.main)
        run.prepare()
        # The model's folder name (a path would tie the folder to this machine).
        run.model_label = Path(str(spec.model.path)).name if spec.model.path else ""
        # What SAELens's cfg.json names as the dictionary's input: a TransformerLens hook
        # name where one carries the tensor, else hookrun's own (module:site), which
        # `action: sae` places as it places the other.
        run.hook_names = {d.name: hook_name_of(*d.site.source, run.model) for d in job.dictionaries}
        if saved is not None:
            run.restore(saved)
            if run.main:
                log.info("resume=true: continuing from the checkpoint at step %d", run.state.step)
        else:
            if spec.resume and run.main:
                log.info("resume=true: no checkpoint in %s yet; training from step 0", run.run_dir)
            run._first_scales()
        trainers = run._trainers(saved)
        if spec.logger == "tensorboard" and run.main:
            from torch.utils.tensorboard import SummaryWriter  # the tensorboard extra

            # purge_step: a resumed job's events after its checkpoint are written again.
            run.writer = SummaryWriter(run.run_dir / "tensorboard", purge_step=run.state.step)
        with run_mode(run.model):
            try:
                run.write_file("running")
                speed = run.run(trainers)
            except Interrupted as err:
                with deferred():
                    run.checkpoint(trainers, "interrupted", str(err))
                raise
        if run.writer is not None:
            run.writer.close()
        trained = Trained(run.path, steps=run.state.step, tokens_per_second=speed)
        trained.main = run.main
        with deferred():
            trained.folders = run.save(trainers)
            run.checkpoint(trainers, "running")
        if run.ranks is not None:
            run.ranks.barrier()  # the folders written before any rank's scoring run reads them
        if score is not None and job.config.heldout.rows:
            for d in job.dictionaries:
                scores_dir = run.run_dir / "scores" / d.name
                got = score(trained.folders[d.name], d, scores_dir, run.model, run.weights_file)
                if got is not None:
                    trained.scores[d.name] = got
        run.write_file("complete", trained=trained)
        if run.main:
            checkpoint.remove(run.run_dir)
        if run.ranks is not None:
            run.ranks.barrier()  # every rank returns once the file is complete
        return trained
    finally:
        if lock is not None:
            lock.release()


def _postfix(row: list[float]) -> str:
    """A logged curve row's loss, explained variance, L0 and dead latents, for the bar."""
    shown = {"loss": "loss", "explained_variance": "ev", "l0": "L0", "dead": "dead"}
    figures = dict(zip(CURVE_FIELDS, row, strict=True))
    return ", ".join(
        f"{short} {figures[name]:.4g}"
        for name, short in shown.items()
        if not math.isnan(figures[name])
    )
