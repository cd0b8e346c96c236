"""The stage interface: every capability of a run beyond capturing is a `Stage`.

Derived methods, the faithfulness evaluation, the sanity check, the patching grid,
induction scores, and what comes next: each is a `Stage`, registered with
`@register_stage` in its own folder under hookrun/stages/. The pipeline loops over the
registered stages and names none of them.

A stage's life in a run:

1. `parse(raw, ctx)`, at config time (no model, no data): its node of the config (`node`,
   e.g. `evaluate:`) typed, checked and frozen; None turns the stage off. The config's
   schema gets one free-form key per stage node (config/schema.py); `schema()` names the
   dataclasses `parse` merges the node into, which the configuration reference lists.
2. `plan(config, setup)`, before any work, once the model is built, the data read and the
   hooks probed: every check that needs them (HookrunError naming the key); the stage's
   `Plan` for this run, or None (nothing to do here).
3. The plan's `stored()` — its datasets: path → `Stored` (per-row shape, attributes) — and
   `attrs()` (its groups' attributes): the dry run, the file's layout, resume, verify and the
   torchrun join learn them from there; `describe(itemsize)`: its lines in the dry run.
4. `batch(work)`, per batch, with the run's hooks standing aside: its records (path →
   tensor or array), beside the hooked passes' own; `guard(model)` is held around the
   batches (what the stage changes in the model comes back).
5. At the end: `Stage.complete(f, rows, shards)` writes what the file says of all its rows
   (the sanity verdicts); `Plan.finish(f)` computes the datasets of the whole run that
   `Plan.finishes()` declared (the induction scores, the circuits' faithfulness) once every
   row is in the file, which is marked complete only once they are in it too (a resume
   computes those still pending, and only those); `Stage.summary(f, rows)`,
   `Stage.draw(f, out_dir, rows, config)` and `Stage.damage(f, complete)` read the file
   alone, so the summary, `python -m hookrun.render` and `python -m hookrun.verify` work
   without the run.
6. At a sweep's end, `Stage.columns(f, rows)` gave each job's numbers to sweep_summary.csv
   and `Stage.rank(sweep_dir, jobs)` writes the stage's ranking of the jobs.

Adding a stage is its folder, one line in hookrun/stages/__init__.py, and its conf group
(and, for the wheel, its package in pyproject.toml).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import h5py
import torch
from torch import nn

from hookrun.data.batch import Batch
from hookrun.errors import HookrunError
from hookrun.io.dimensions import name_axes
from hookrun.io.whole_run import WholeRun
from hookrun.memory import format_bytes
from hookrun.registry import Registry

if TYPE_CHECKING:
    from hookrun.runtime.plan import CallShapes, HookPlan
    from hookrun.runtime.step import BatchContext, BatchStep, Recorder

__all__ = [
    "Stored",
    "WholeRun",
    "describe_stored",
    "ParseContext",
    "Setup",
    "Work",
    "Plan",
    "JobContext",
    "JobResult",
    "Stage",
    "STAGES",
    "register_stage",
    "stages",
    "stage_nodes",
    "drawn_by_stages",
    "summarised",
    "stage_columns",
    "completed",
]


@dataclass(frozen=True)
class Stored:
    """One dataset a stage writes.

    Attributes:
        shape: The shape of one row (per sample, or per batch where its rows say so).
        attrs: The dataset's attributes.
        dtype: The float it is stored in (None: sink.dtype); float64 for sums a whole-run
            result is made of, which sink.dtype's rounding would spoil.
    """

    shape: tuple[int, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    dtype: str | None = None


def describe_stored(stored: Mapping[str, Stored], itemsize: int, title: str) -> str:
    """The dry-run lines of a stage's datasets: each one's shape and bytes per sample.

    Args:
        stored: The datasets, path → `Stored`.
        itemsize: Bytes per stored element (sink.dtype's).
        title: The first line's name for them.

    Returns:
        The lines, joined; their total is in the dry run's estimated file size.
    """
    lines = [f"{title}: {len(stored)} dataset(s)"]
    for key, value in stored.items():
        size = format_bytes(math.prod(value.shape) * itemsize)
        lines.append(f"    {str(list(value.shape)):<20} {size:>11}/sample  /{key}")
    return "\n".join(lines)


@dataclass(frozen=True)
class ParseContext:
    """What a stage's node may be checked against at config time (no model, no data)."""

    cfg: Any  # the composed config (a DictConfig): a stage may read other experiments' nodes
    target: Any  # the parsed target (runtime.targets.TargetConfig)
    dataset: Any  # the parsed dataset kind's config
    batch_size: int
    limit: int | None


@dataclass
class Setup:
    """What a stage plans against, before any work.

    The run's spec, the model, its data and the shape probe of the hooks on one sample;
    `made` grows as the stages before it plan (what each stored: path → per-row shape).
    """

    spec: Any  # the RunSpec (config/build.py, which imports this module to parse stage nodes)
    model: nn.Module
    data: Any  # the run's rows (a torch Dataset, after `limit`)
    tokens: Any  # its token rows (data/tokens.py), or None for other data
    sample: torch.Tensor  # row 0 on the device, as the probe saw it
    plan: HookPlan
    shapes: Mapping[str, list[CallShapes]]  # the probe's calls and leaves
    captures: Mapping[str, tuple[int, ...]]  # every capture of the hooks: path → row shape
    store_dtype: torch.dtype
    device: torch.device
    made: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Token data read with a tokenizer: each id's text, decoded alone ([] otherwise).
    vocabulary: list[str] = field(default_factory=list)

    def causal_language(self, key: str) -> Any:
        """The run's causal language model, for a stage that runs it on token data itself.

        Args:
            key: The config key that asks for it, named in the error.

        Returns:
            The LanguageModel (models/language.py) of a causal_lm on token data.

        Raises:
            HookrunError: Another model, or data that is not tokens.
        """
        from hookrun.models.adapter import adapt

        language = adapt(self.model).language
        if language is None or language.kind != "causal_lm" or self.tokens is None:
            what = getattr(language, "kind", type(self.model).__name__)
            raise HookrunError(
                f"{key}: the model is {what} on {'token' if self.tokens else 'image'} data; "
                "valid: a causal language model (model.class=causal_lm) on token data"
            )
        return language


@dataclass
class Work:
    """One batch as a stage sees it, after the hooked passes (and the stages before it)."""

    step: BatchStep  # the batch's hooked step: its inputs, targets, model and recorder
    batch: Batch  # as the data loader gave it (on the host)
    records: Mapping[str, Any]  # what the hooked passes and the stages before stored
    seed: int
    store_dtype: torch.dtype

    @property
    def model(self) -> nn.Module:
        """The run's model, on the device."""
        return self.step.model

    @property
    def inputs(self) -> torch.Tensor:
        """The batch on the device, as the data loader gave it (before any hook changed it)."""
        return self.step.inputs

    @property
    def on_device(self) -> Batch:
        """The whole batch on the device (its token parts too), before any hook changed it."""
        return self.step.batch

    @property
    def targets(self) -> torch.Tensor:
        """The run's target of each row, on the device: (N,) or (N, 2) for logit_diff."""
        return self.step.targets.clone().to(self.step.device)

    @property
    def tensors(self) -> Mapping[str, Any]:
        """The records, with the captures the stage reads (Plan.reads) as the run made them.

        Those are on the run's device, in the run's dtype: not rounded to sink.dtype on the
        host.
        """
        return {**self.records, **self.step.recorder.kept}

    def context(self) -> BatchContext:
        """The batch as a method with passes of its own sees it (runtime/step.py)."""
        return self.step.context()

    def generator(self, name: str, device: torch.device | None = None) -> torch.Generator:
        """A generator seeded by (run seed, `name`, the batch's first row).

        Args:
            name: What draws from it, so two draws of one batch differ.
            device: Where it draws; default: the CPU.

        Returns:
            The seeded generator: the same numbers for the same row in any batching.
        """
        return self.step.recorder.generator(name, "input", device or torch.device("cpu"))

    def recorder(self, folds: Mapping[str, int]) -> Recorder:
        """A fresh recorder for hooked passes of the stage's own (the sanity check's).

        Args:
            folds: How many passes each capture's rows fold together, by path.

        Returns:
            A Recorder in the run's seed and store dtype.
        """
        from hookrun.runtime.hooks import Recorder
        from hookrun.runtime.transfer import HostCopier
        from hookrun.timing import StageTimer

        return Recorder(self.seed, self.store_dtype, HostCopier(), StageTimer(False), dict(folds))


class Plan:
    """One stage's work in one run: what `Stage.plan` returns.

    Subclass it and override what the stage does; every method's default does nothing
    (stores nothing, reads nothing, changes nothing).
    """

    def stored(self) -> Mapping[str, Stored]:
        """Every dataset this stage writes.

        Returns:
            Path in the file (`derived/<method>/<layer>`) → its per-row `Stored`.
        """
        return {}

    def attrs(self) -> Mapping[str, Mapping[str, Any]]:
        """Attributes of its groups, set when they are made.

        Returns:
            Group path → {attribute name: value}.
        """
        return {}

    def shaped(self) -> Mapping[str, tuple[int, ...]]:
        """Datasets whose axes are named by their shape as a capture's are.

        For where the stage's registered names (Stage.axes) cannot say: a method that
        explains a language model's input embeddings stores (tokens, features).

        Returns:
            Path → per-row shape.
        """
        return {}

    def describe(self, itemsize: int) -> str:
        """Its lines in the dry run; by default each dataset it stores.

        Args:
            itemsize: Bytes per stored element (sink.dtype's).

        Returns:
            The lines, joined; '' for none.
        """
        stored = self.stored()
        groups = sorted({key.split("/")[0] for key in stored})
        return describe_stored(stored, itemsize, "/" + ", /".join(groups)) if stored else ""

    def reads(self) -> frozenset[str]:
        """Captures its `batch` computes from (Work.tensors).

        The run keeps them for the batch as it made them, on its device and in its dtype (a
        stage computes from those, and its result is rounded once, when stored).

        Returns:
            The captures' paths.
        """
        return frozenset()

    def sources(self) -> dict[str, dict[str, str]]:
        """Files its work reads, which join the run's provenance.

        They are stored in the root attribute patch_sources, so resume refuses once one
        changed.

        Returns:
            Config key → {"file": path, "sha256": digest}.
        """
        return {}

    def guard(self, model: nn.Module) -> AbstractContextManager:
        """Held around the batches: what the stage changes in the model comes back.

        Args:
            model: The run's model (the sanity check randomises its weights).

        Returns:
            A context manager that puts the model back on exit, whatever ends the run.
        """
        return nullcontext()

    def gives_output(self) -> bool:
        """Whether its `batch` forwards the batch as the model does and takes the targets.

        Its first pass's output is the model's own, value for value, and it takes the targets
        from it (BatchContext.choose). As the run's first stage, where the run's hooks act on
        no forward, it then spares the step its own forward (runtime/step.py): that pass's
        output is the batch's.

        Returns:
            False by default.
        """
        return False

    def batch(self, work: Work) -> Mapping[str, Any]:
        """Its records of one batch.

        Args:
            work: The batch, after the hooked passes and the stages before this one.

        Returns:
            Path → host tensor or array, one row per sample (as `stored()` declared).
        """
        return {}

    def finishes(self) -> Mapping[str, WholeRun]:
        """The datasets of the whole run its `finish` writes once every row is in the file.

        They are made with the file and pending until then; the file is complete only once
        each holds its values.

        Returns:
            Path → `WholeRun` (shape, dtype, attributes).
        """
        return {}

    def finish(self, f: h5py.File) -> Mapping[str, Any]:
        """Whole-run work, once every row is in the file.

        Called on rank 0, after the torchrun join. A resume calls it only when one of its
        datasets is still pending, and writes them all again.

        Args:
            f: The file, open for reading; its rows are final.

        Returns:
            The values of every dataset `finishes()` names: path → array of its shape.
        """
        return {}


@dataclass(frozen=True)
class JobContext:
    """What the pipeline lends a stage that runs a job of its own (`Stage.job`).

    `load(spec)` builds the model (on `device`) and the rows as a run of `spec` would:
    (model, rows, weights file); `execute(spec, run_dir, model=None, weights_file=None)`
    runs another spec through the rows' pipeline and returns its Result (`model`: the model
    `load` gave, lent to that run instead of building it again, with the file it was loaded
    from); `header(spec, weights_file)` is the provenance a run's file starts with;
    `images` the run's pictures folder (`images/<experiment>/` in the run folder).
    """

    run_dir: Path
    device: torch.device
    caller_model: nn.Module | None
    load: Any
    execute: Any
    header: Any
    images: Path


@dataclass(frozen=True)
class JobResult:
    """What a stage's job made.

    Its file, the rows it holds (0: none), its summary lines, its pictures' folder.
    """

    path: Path | None
    summary: str
    images: Path | None = None
    rows: int = 0


class Stage:
    """Base class of a registered stage; the module docstring tells its life in a run.

    Subclass it, set `name` (and `node`, the config node it reads), override the
    classmethods the stage needs and decorate it with `@register_stage`. Every default
    does nothing: no node, no plan, no lines, no pictures.
    """

    name: ClassVar[str]
    # Its node of the config (None: the stage reads none and plans from the run itself).
    node: ClassVar[str | None] = None
    # The run config's key its node follows (the stored config's key order is part of the
    # file: one written before a stage moved reads the same after).
    node_after: ClassVar[str] = "logger"
    # Stages plan and run in this order: a stage reads what the ones before it stored.
    order: ClassVar[int] = 100
    # Names of the axes of its datasets (fnmatch pattern → words, io/dimensions.py).
    axes: ClassVar[Mapping[str, str]] = {}
    # Datasets it draws itself (fnmatch patterns), which the pictures of every derived map
    # leave out (a table is no map).
    draws: ClassVar[tuple[str, ...]] = ()
    # Whether its work changes the model's weights (and puts them back): a caller's model
    # is then kept whole around the run, whatever ends it.
    changes_weights: ClassVar[bool] = False

    @classmethod
    def schema(cls) -> Mapping[str, type]:
        """The dataclasses its `parse` merges its node into, by the key each one reads.

        Returns:
            Key prefix (`circuit`, `derive.integrated_gradients`) → the dataclass whose
            fields are that node's keys; the configuration reference lists them from here.
        """
        return {}

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> Any:
        """Its config node typed, checked and frozen, at config time (no model, no data).

        Args:
            raw: The node as composed (a DictConfig, or None where the config has none).
            ctx: What the node may be checked against (the config, target, dataset).

        Returns:
            The stage's config (a frozen dataclass), or None: off (an empty node turns it
            off).

        Raises:
            HookrunError: A bad key or value, named in full (`circuit.k: ...; valid: ...`).
        """
        return None

    @classmethod
    def resolve_layer(cls, config: Any, layer: str) -> Any:
        """Its config with every `auto` layer (model.cam_layer=auto) set to `layer`.

        Args:
            config: What `parse` returned.
            layer: The layer the run picked.

        Returns:
            The config, `auto` replaced.
        """
        return config

    @classmethod
    def says_auto(cls, config: Any) -> bool:
        """Whether its config asks for the auto-picked layer.

        Args:
            config: What `parse` returned.

        Returns:
            True where a layer of it is `auto`.
        """
        return False

    @classmethod
    def needs_input_gradient(cls, config: Any) -> str | None:
        """The key whose work needs the gradient of the model's input.

        On token data, which has none, it is refused before the model runs.

        Args:
            config: What `parse` returned.

        Returns:
            The key in full (`derive.methods`), or None: nothing does.
        """
        return None

    @classmethod
    def job(cls, config: Any, spec: Any, ctx: JobContext) -> JobResult | None:
        """The whole job instead of the rows' pipeline.

        For a stage whose work is no batch of rows (training a dictionary: steps over a
        stream of tokens).

        Args:
            config: What `parse` returned.
            spec: The run's RunSpec.
            ctx: What the pipeline lends a job: the run folder, the model and data as a run
                builds them, and runs of other specs (what the job scores with).

        Returns:
            What the job made, or None (the default): the run is the rows' pipeline.

        Raises:
            HookrunError: Bad input, before any work; Interrupted: a signal stopped it.
        """
        return None

    @classmethod
    def plan(cls, config: Any, setup: Setup) -> Plan | None:
        """Every check that needs the model and data, and the stage's work in this run.

        Args:
            config: What `parse` returned (its `auto` layers resolved).
            setup: The run's spec, model, data and shape probe.

        Returns:
            Its Plan, or None: nothing to do in this run.

        Raises:
            HookrunError: A check failed; the message names the key.
        """
        return None

    @classmethod
    def complete(cls, f: h5py.File, rows: int, shards: list[h5py.File] | None) -> None:
        """Before a file is marked complete: what it says of all its rows.

        Args:
            f: The file, open for writing.
            rows: How many rows it holds.
            shards: The shards a torchrun join reads, or None.
        """

    @classmethod
    def damage(cls, f: h5py.File, complete: bool) -> list[str]:
        """What is wrong with its part of a file, for python -m hookrun.verify.

        Args:
            f: The file, open for reading.
            complete: Whether the file says it is complete.

        Returns:
            One line per fault; [] for none.
        """
        return []

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        """Its lines in the end-of-run summary, from the file alone.

        Args:
            f: The file, open for reading.
            rows: How many rows it holds.

        Returns:
            The lines; [] for none.
        """
        return []

    @classmethod
    def columns(cls, f: h5py.File, rows: int) -> dict[str, float]:
        """Its columns of a sweep's summary (sweep_summary.csv).

        Args:
            f: The job's file, open for reading.
            rows: How many rows it holds.

        Returns:
            Column name → the job's number.
        """
        return {}

    @classmethod
    def draw(cls, f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
        """Its pictures of the file.

        Args:
            f: The file, open for reading.
            out_dir: Where the pictures go.
            rows: How many rows to draw at most.
            config: The run's resolved config.

        Returns:
            The files written.
        """
        return []

    @classmethod
    def rank(cls, sweep_dir: Path, jobs: list[dict[str, Any]]) -> list[Path]:
        """At a sweep's end: its ranking of the jobs.

        Args:
            sweep_dir: The sweep's folder, where the ranking goes.
            jobs: One row per job: job, overrides, status, file and `evaluation` with the
                columns' `means`.

        Returns:
            The files written.
        """
        return []


STAGES: Registry[type[Stage]] = Registry("a stage")


def register_stage(cls: type[Stage]) -> type[Stage]:
    """Class decorator: register a Stage under its `name`.

    The names of its datasets' axes join the file's (io/dimensions.py).

    Args:
        cls: The Stage subclass.

    Returns:
        The class itself.

    Raises:
        ValueError: Another stage has that name already.
    """
    STAGES.register(cls.name)(cls)
    name_axes(cls.axes)
    return cls


def stages() -> list[type[Stage]]:
    """Every registered stage, in the order they plan and run."""
    return sorted((STAGES.get(n, "stage") for n in STAGES.choices()), key=lambda s: s.order)


def drawn_by_stages(path: str) -> bool:
    """Whether a stage draws the dataset at `path` itself."""
    return any(fnmatchcase(path, pattern) for stage in stages() for pattern in stage.draws)


def summarised(f: h5py.File, rows: int) -> list[str]:
    """Every stage's lines in the end-of-run summary of the open file `f`."""
    return [line for stage in stages() for line in stage.summary(f, rows)]


def stage_columns(f: h5py.File, rows: int) -> dict[str, float]:
    """Every stage's columns of a sweep's summary, from the open file `f`."""
    return {k: v for stage in stages() for k, v in stage.columns(f, rows).items()}


def completed(f: h5py.File, rows: int, shards: list[h5py.File] | None) -> None:
    """What every stage writes of all a file's rows before it is marked complete."""
    for stage in stages():
        stage.complete(f, rows, shards)


def stage_nodes() -> list[tuple[str, str]]:
    """The config nodes the stages read, each with the key it follows.

    Returns:
        (node, the key it follows) pairs; each node a key of the config's schema.
    """
    return [(s.node, s.node_after) for s in stages() if s.node]
