"""Stage 1 of a run — prepare: sink path and resume checks, data, model, plan, probe pass.

Everything that can be wrong with the input is found here, before the first batch and
before the captures file is created.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from hookrun.config.build import RunSpec, check_sizes
from hookrun.config.schema import TargetKind
from hookrun.data.loader import (
    SourceFiles,
    build_dataset,
    files_fingerprint,
    has_labels,
    source_files,
    wrap_dataset,
)
from hookrun.data.tokens import check_vocab, token_rows
from hookrun.errors import HookrunError
from hookrun.io.dimensions import AxisFacts
from hookrun.io.layout import SAMPLES_PATH, Provenance
from hookrun.io.lock import WriterLock
from hookrun.io.resume import Resumed, check_paths, check_sources, resume_point
from hookrun.io.sink import check_sink_path
from hookrun.io.stored import stored_record
from hookrun.models.hf import load_tokenizer
from hookrun.models.language import LanguageModel, explained_sample
from hookrun.models.sources import build_model, model_label
from hookrun.pipeline.camlayer import resolve_cam_layer
from hookrun.pipeline.plan_text import FileShape, describe_plan, describe_results
from hookrun.pipeline.tokencheck import check_token_model, check_token_run
from hookrun.runtime.hooks import run_mode
from hookrun.runtime.layouts import axis_facts
from hookrun.runtime.plan import HookPlan, check_reached, compile_plan
from hookrun.runtime.probe import probe_shapes
from hookrun.runtime.targets import check_target
from hookrun.scale import distributed
from hookrun.scale.distributed import World
from hookrun.scale.provenance import provenance
from hookrun.signals import interruptible
from hookrun.stages.derive.registry import Derivation, plan_derivations
from hookrun.stages.evaluate.faithfulness import Evaluation, attribution_shapes, plan_evaluation
from hookrun.stages.evaluate.registry import Stored
from hookrun.stages.patching.grid import PatchingGrid, plan_patching
from hookrun.stages.sanity.check import SanityCheck, prepare_sanity
from hookrun.timing import StageTimer

__all__ = ["CallerObjects", "Claim", "claim_file", "Prepared", "prepare", "STORE_DTYPES"]

log = logging.getLogger("hookrun")

STORE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CallerObjects:
    """What a Python caller handed to `hookrun.run` instead of the config's model / dataset."""

    model: nn.Module | None = None
    dataset: Any = None


@dataclass
class Prepared:
    """A run ready to stream: everything checked, the model built and probed."""

    spec: RunSpec
    run_dir: Path
    world: World
    device: torch.device
    model: nn.Module
    data: Dataset  # every row of the run (after `limit`)
    files: SourceFiles | None  # every row's source file, for file datasets
    plan: HookPlan
    derivations: list[Derivation]
    plan_text: str
    final_path: Path  # the captures.h5 users read
    sink_path: Path  # the file this process writes (a shard under torchrun)
    done: int  # rows already complete (resume)
    header: Provenance
    timer: StageTimer
    started: float
    # Captures not stored one row per sample: path → rows per sample (0: one row per batch).
    folds: dict[str, int] = field(default_factory=dict)
    # Captures stored in another float than sink.dtype (a hook's args.dtype): path → dtype.
    dtypes: dict[str, str] = field(default_factory=dict)
    axes: AxisFacts = field(default_factory=AxisFacts)  # for the file's dimension names
    evaluation: Evaluation | None = None  # evaluate: metrics × attributions, per batch
    sanity: SanityCheck | None = None  # the sanity check, per batch
    patching: PatchingGrid | None = None  # activation patching (hookrun/patching/), per batch
    # Attributes of the datasets and groups the run creates (evaluation's), by path.
    attrs: dict[str, dict] = field(default_factory=dict)


@dataclass
class Claim:
    """The file a run writes, claimed before anything else: its paths, the writer lock (held
    to the end of the run), and where a resumed run starts."""

    final_path: Path  # the captures.h5 users read
    sink_path: Path  # the file this process writes (a shard under torchrun)
    lock: WriterLock | None = None
    resumed: Resumed = field(default_factory=Resumed)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def claim_file(spec: RunSpec, run_dir: Path, world: World) -> Claim:
    """The run's file, locked and checked: a path that exists (unless resumed or
    overwritten) or cannot be written is refused, a resumed file's rows are counted."""
    if spec.sink.path and spec.sink.path.endswith(("/", os.sep)):
        raise HookrunError(
            f"sink.path: {spec.sink.path} ends with '/', which names a folder; valid: a file "
            f"path, e.g. {spec.sink.path}captures.h5"
        )
    final_path = Path(spec.sink.path).expanduser() if spec.sink.path else run_dir / "captures.h5"
    if final_path.is_symlink() and final_path.exists():
        # Through a link the file it names is the one written and locked: two names of one
        # file must not give two writers, and the link itself stays a link.
        final_path = Path(os.path.realpath(final_path))
    sink_path = distributed.shard_path(final_path, world) if world.parallel else final_path
    # The lock first: the checks below then cannot race another run on the same file.
    claim = Claim(final_path, sink_path, None if spec.dry_run else WriterLock(sink_path))
    try:
        with interruptible():  # a resume's damage check reads the whole file
            claim.resumed = _check_paths(spec, final_path, sink_path, world)
    except BaseException:
        claim.release()
        raise
    return claim


def _check_paths(spec: RunSpec, final_path: Path, sink_path: Path, world: World) -> Resumed:
    """Where a resumed run starts, after refusing paths that exist or cannot be written."""
    if spec.resume and world.parallel and final_path.exists():
        joined = resume_point(final_path, spec.config_yaml)
        if joined.complete:  # every shard was complete and joined: nothing to compute
            return joined
    if spec.resume and sink_path.exists():
        found = resume_point(sink_path, spec.config_yaml)
        # Under torchrun a shard may have finished before another rank was killed: its rows
        # are done, and the join still to come.
        return replace(found, complete=False) if world.parallel else found
    if spec.resume:
        sizes = distributed.shard_world_sizes(final_path) - {world.size}
        if sizes:
            raise HookrunError(
                f"resume refused: the number of processes changed ({min(sizes)} → "
                f"{world.size}) since {final_path} was started; resume with the same "
                "torchrun --nproc_per_node, or start a new run"
            )
        resume_point(sink_path, spec.config_yaml)  # says it starts the missing file
    if not spec.dry_run:
        check_sink_path(sink_path, spec.sink.overwrite)
        if world.parallel and world.rank == 0:
            check_sink_path(final_path, spec.sink.overwrite)  # the file the shards will join in
    return Resumed()


def _tokenizer(spec: RunSpec, caller_model: nn.Module | None) -> Any:
    """The tokenizer token data is read with (no weights loaded yet): the language model's —
    the caller's LanguageModel's own, or model=hf's — else None (image data)."""
    if caller_model is None:
        return load_tokenizer(spec.model) if spec.model.source == "hf" else None
    if isinstance(caller_model, LanguageModel):
        return caller_model.tokenizer
    if type(caller_model).__module__.startswith("transformers."):
        raise HookrunError(
            f"model: a {type(caller_model).__name__} (a transformers model) needs its "
            "tokenizer; valid: hookrun.models.language.LanguageModel(model, tokenizer), or "
            "model=hf model.path=DIR of its save_pretrained folder"
        )
    return None


def prepare(
    spec: RunSpec,
    run_dir: Path,
    world: World,
    device: torch.device,
    caller: CallerObjects,
    claim: Claim,
) -> Prepared:
    """Check, build and probe everything a run needs; HookrunError before any work."""
    # Nothing is written before the first batch: a signal stops any of this at once.
    with interruptible():
        return _prepare(spec, run_dir, world, device, caller, claim)


def _prepare(
    spec: RunSpec,
    run_dir: Path,
    world: World,
    device: torch.device,
    caller: CallerObjects,
    claim: Claim,
) -> Prepared:
    final_path, sink_path, done = claim.final_path, claim.sink_path, claim.resumed.rows
    started = time.perf_counter()
    # The data first: its checks are cheap, the weights may be large.
    if caller.dataset is not None:
        data = wrap_dataset(caller.dataset, spec.limit)
        # The caller's samples exist already; the batches and extra passes of them must fit.
        shape = tuple(data[0][0].shape)
        check_sizes(spec.batch_size, spec.limit, spec.derive, shape, len(data))
    else:
        data = build_dataset(spec.dataset, spec.seed, spec.limit, _tokenizer(spec, caller.model))
    if caller.model is not None:
        model, weights_file = caller.model, None
    else:
        built = build_model(spec.model, spec.seed, spec.weights_path)
        model, weights_file = built.module, built.weights_file
        if built.random_warning:
            log.warning(
                "model.weights is null: %s has random (seeded) weights", model_label(spec.model)
            )
    model.to(device)
    tokens = token_rows(data)
    if tokens is not None:
        check_vocab(tokens, int(model.config.vocab_size))  # a LanguageModel (models/hf.py)
        check_token_model(spec, model, data, tokens)  # before the probe's forward pass
    sample = data[0][0].to(device)
    try:  # the first forward passes of the user's model: a failure there is bad input
        spec = resolve_cam_layer(spec, model, sample)
        plan = compile_plan(spec.hooks, model)
        shapes, output_shape, plan = probe_shapes(model, plan, sample)
    except HookrunError:
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise HookrunError(
            f"model: {model_label(spec.model)} failed its probe forward pass on sample 0 "
            f"of shape {list(sample.shape)} ({type(err).__name__}: {first})"
        ) from None
    check_token_run(spec, plan, shapes, data, tokens)
    patching = plan_patching(spec.patching, model, tokens, len(data))
    plan, idle = check_reached(plan, shapes)
    never_ran = "; ".join(f"{hook}: {', '.join(layers)}" for hook, layers in idle.items())
    if never_ran:
        log.warning("selected modules that never run (nothing captured there): %s", never_ran)
    check_target(spec.target, output_shape, has_labels(data))
    for hook, site, leaf in plan.sites(shapes):  # e.g. patch: its source file against the site
        hook.action.prepare(leaf.shape, site, f"hooks.{hook.name}", len(data))
    sources = {f"hooks.{h.name}": h.action.sources() for h in plan.hooks if h.action.sources()}
    with run_mode(model):
        explained = explained_sample(model, sample)
        derivations = plan_derivations(
            spec.derive, set(plan.capture_shapes(shapes)), model, sample, explained
        )
    itemsize = STORE_DTYPES[spec.sink.dtype.value].itemsize
    kind = spec.target.kind.value
    header = replace(
        provenance(spec, weights_file, device, world.size, sources),
        data_files_sha256=files_fingerprint(data),
        never_ran=never_ran,
    )
    if spec.resume:
        check_sources(sink_path, header)
    files = source_files(data)
    if files is not None and done and stored_record(sink_path, SAMPLES_PATH)[1] is None:
        # Started by a hookrun before /samples/path: continued as it began, so its rows
        # keep one layout (a dataset added half-way would have no rows for the first part).
        log.warning("resume: %s was started without /samples/path; continuing without", sink_path)
        files = None
    if files is not None and done:
        check_paths(sink_path, files.by_index)
    path_bytes = files.width if files is not None else 0
    derived = {k: v for d in derivations for k, v in d.stored_shapes(tuple(sample.shape)).items()}
    store_dtype = STORE_DTYPES[spec.sink.dtype.value]
    made = attribution_shapes(derived, plan.capture_shapes(shapes))
    evaluation = plan_evaluation(spec.evaluate, made, tuple(sample.shape), store_dtype)
    sanity = prepare_sanity(spec.sanity, model, sample, spec.seed, store_dtype)
    evaluated: dict[str, Stored] = {
        **(evaluation.stored() if evaluation else {}),
        **(sanity.stored() if sanity else {}),
    }
    patched = patching.stored() if patching else {}
    derived.update({k: v.shape for k, v in (evaluated | patched).items()})
    new_attrs = {k: dict(v.attrs) for k, v in (evaluated | patched).items() if v.attrs}
    new_attrs |= sanity.attrs() if sanity else {}
    new_attrs |= patching.attrs() if patching else {}
    shards = tuple(
        len(distributed.batch_shard(len(data), spec.batch_size, replace(world, rank=rank)))
        for rank in range(world.size)
    )
    dtypes = {
        key: hook.action.dtype
        for hook, key, _ in plan.sites(shapes)
        if hook.action.captures and hook.action.dtype
    }
    file = FileShape(
        len(data),
        spec.batch_size,
        itemsize,
        output_shape,
        path_bytes,
        has_labels(data),
        derived,
        shards if world.parallel else (),
        {key: STORE_DTYPES[dtype].itemsize for key, dtype in dtypes.items()},
        spec.target.kind == TargetKind.logit_diff,
    )
    plan_text = describe_plan(plan, shapes, kind, file)
    if evaluated:
        plan_text += "\n" + describe_results({k: v.shape for k, v in evaluated.items()}, itemsize)
    if sanity is not None:
        plan_text += f"\nSanity check ({sanity.config.mode}) randomises: {', '.join(sanity.layers)}"
    if patching is not None:
        plan_text += "\n" + patching.describe(itemsize)
    return Prepared(
        spec=spec,
        run_dir=run_dir,
        world=world,
        device=device,
        model=model,
        data=data,
        files=files,
        plan=plan,
        derivations=derivations,
        plan_text=plan_text,
        final_path=final_path,
        sink_path=sink_path,
        done=done,
        header=header,
        timer=StageTimer(spec.profile, device),
        started=started,
        folds=plan.folds(shapes),
        dtypes=dtypes,
        axes=axis_facts(
            # a gradient method's results on token data: the embeddings' (T, D) per sample
            plan.capture_shapes(shapes) | {d.key: d.explained for d in derivations if d.explained},
            plan.folds(shapes),
            model,
            sample,
        ),
        evaluation=evaluation,
        sanity=sanity,
        patching=patching,
        attrs=new_attrs,
    )
