"""Step 1 of a run — prepare: the data, the model, the hooks' plan and its probe, and each
stage's plan; the file's header, layout and the dry-run text.

Everything that can be wrong with the input is found here, before the first batch and
before the captures file is created (pipeline/claim.py claimed its path before).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from hookrun.config.build import RunSpec, check_batch
from hookrun.data import token_cache
from hookrun.data.batch import Batch
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
from hookrun.io.layout import (
    LISTED_POSITIONS,
    SAMPLES_PATH,
    Provenance,
    vocabulary_arrays,
)
from hookrun.io.resume import check_paths, check_sources
from hookrun.io.stored import stored_record
from hookrun.models.adapter import adapt
from hookrun.models.hf import load_tokenizer
from hookrun.models.language import vocabulary_texts
from hookrun.models.placement import is_placed
from hookrun.models.sources import build_model, model_label
from hookrun.pipeline.camlayer import resolve_cam_layer
from hookrun.pipeline.claim import Claim
from hookrun.pipeline.measure import measure_vectors
from hookrun.pipeline.plan_text import FileShape, describe_plan
from hookrun.pipeline.tokencheck import check_reads_tokens, check_token_model, check_token_run
from hookrun.runtime.actions import Output
from hookrun.runtime.hooks import Recorder, attach, prepare_input, run_mode
from hookrun.runtime.plan import CallShapes, HookPlan, check_reached, compile_plan
from hookrun.runtime.shape_probe import probe_shapes
from hookrun.runtime.spatial import axis_facts
from hookrun.runtime.step import RowFacts
from hookrun.runtime.targets import TargetKind, check_target
from hookrun.scale import distributed
from hookrun.scale.distributed import World
from hookrun.scale.provenance import provenance
from hookrun.signals import interruptible
from hookrun.stage import Plan, Setup, WholeRun, stages
from hookrun.timing import StageTimer

__all__ = ["CallerObjects", "Prepared", "prepare", "model_and_data", "STORE_DTYPES"]

log = logging.getLogger("hookrun")

# The floats a dataset is stored in: sink.dtype's and a capture's args.dtype's, and float64
# for a stage's sums (Stored.dtype).
STORE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class CallerObjects:
    """What a Python caller handed to `hookrun.run` instead of the config's model / dataset."""

    model: nn.Module | None = None
    dataset: Any = None
    # A job's own model lent to a run it starts (the training job's scoring runs): built
    # from the same config, so the run treats it as its own (the config's tokenizer, the
    # weights file it was loaded from, left where the config placed it), not as a caller's.
    lent_from: Path | None = None
    lent: bool = False


@dataclass
class Prepared:
    """A run ready to stream: everything checked, the model built and probed, every stage
    planned."""

    spec: RunSpec
    run_dir: Path
    world: World
    device: torch.device
    model: nn.Module
    data: Dataset  # every row of the run (after `limit`)
    files: SourceFiles | None  # every row's source file, for file datasets
    plan: HookPlan
    stages: dict[str, Plan]  # stage name → its plan, in the order they run
    plan_text: str
    claim: Claim  # the file: its paths, the writer lock, where a resume starts
    header: Provenance
    timer: StageTimer
    started: float
    facts: RowFacts = field(default_factory=RowFacts)  # what each row's records say
    # Captures not stored one row per sample: path → rows per sample (0: one row per batch).
    folds: dict[str, int] = field(default_factory=dict)
    # Captures stored in another float than sink.dtype (a hook's args.dtype): path → dtype.
    dtypes: dict[str, str] = field(default_factory=dict)
    axes: AxisFacts = field(default_factory=AxisFacts)  # for the file's dimension names
    # Records stored sparse (a dictionary's latents: Output.sparse), by path.
    sparse: dict[str, Output] = field(default_factory=dict)
    # Attributes of the datasets and groups the stages create, by path.
    attrs: dict[str, dict] = field(default_factory=dict)
    # The stages' datasets of the whole run, written once every row is in (io/whole_run.py).
    finishes: dict[str, WholeRun] = field(default_factory=dict)
    # Whole-run datasets known before any work: the vocabulary's texts of token data.
    constants: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def store_dtype(self) -> torch.dtype:
        return STORE_DTYPES[self.spec.sink.dtype.value]


@dataclass(frozen=True)
class _Probed:
    """The hooks compiled against the model and probed on one sample."""

    spec: RunSpec  # with an `auto` layer resolved
    plan: HookPlan
    shapes: dict[str, list[CallShapes]]
    output: tuple[int, ...]  # the model's output per sample
    never_ran: str  # 'hook: a, b; ...' of the matches that never ran


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
        started = time.perf_counter()
        if world.parallel and (caller.model is None or caller.lent) and is_placed(spec.model):
            raise HookrunError(
                f"model.device_map: {spec.model.device_map!r} under torchrun ({world.size} "
                "processes): each would map the whole model over the same devices; valid: "
                "model.device_map=null with torchrun, or one process with the map"
            )
        data = _data(spec, caller, run_dir)  # first: its checks are cheap, the weights may be large
        model, weights_file = _model(spec, caller, device)
        tokens = token_rows(data)
        check_reads_tokens(model, tokens)
        if tokens is not None:
            check_vocab(tokens, int(model.config.vocab_size))  # a LanguageModel (models/hf.py)
        check_token_model(spec, model, data, tokens)
        sample = data[0][0].to(device)
        probed = _probe(spec, model, sample)
        spec, plan = probed.spec, probed.plan
        check_token_run(spec, plan, probed.shapes, data, tokens)
        check_target(spec.target, probed.output, has_labels(data))
        # A vector from prompt sets: the model reads them now, before any work.
        measured = measure_vectors(plan, probed.shapes, model, spec, device)
        for hook, site, leaf in plan.sites(probed.shapes):  # a patch: its source file
            hook.action.prepare(leaf.shape, site, f"hooks.{hook.name}", len(data), measured)
        outputs = plan.outputs(probed.shapes)
        captures = plan.capture_shapes(probed.shapes)
        vocabulary = _vocabulary(model, tokens)
        setup = Setup(
            spec=spec,
            model=model,
            data=data,
            tokens=tokens,
            sample=sample,
            plan=plan,
            shapes=probed.shapes,
            captures=captures,
            store_dtype=STORE_DTYPES[spec.sink.dtype.value],
            device=device,
            vocabulary=vocabulary,
        )
        planned = _plan_stages(setup)
        sources = {f"hooks.{h.name}": s for h in plan.hooks if (s := h.action.sources())}
        sources |= {key: read for p in planned.values() for key, read in p.sources().items()}
        header = replace(
            provenance(spec, weights_file, device, world.size, sources),
            data_files_sha256=files_fingerprint(data),
            never_ran=probed.never_ran,
            device_map=_device_map(model),
        )
        if spec.resume:
            check_sources(claim.sink_path, header)
        files = _files(claim, data)
        folds = plan.folds(probed.shapes)
        shaped = {k: v for p in planned.values() for k, v in p.shaped().items()}
        run = Prepared(
            spec=spec,
            run_dir=run_dir,
            world=world,
            device=device,
            model=model,
            data=data,
            files=files,
            plan=plan,
            stages=planned,
            plan_text="",
            claim=claim,
            header=header,
            timer=StageTimer(spec.profile, device),
            started=started,
            facts=_row_facts(spec, data, files),
            folds=folds,
            dtypes=_capture_dtypes(plan, probed.shapes) | _stage_dtypes(planned),
            axes=_named(axis_facts(captures | shaped, folds, model, sample), outputs),
            sparse={path: o for path, o in outputs.items() if o.sparse},
            attrs=_stage_attrs(planned) | _listed_positions(plan, probed.shapes),
            finishes={k: v for p in planned.values() for k, v in p.finishes().items()},
            constants=vocabulary_arrays(vocabulary) if vocabulary else {},
        )
        run.plan_text = _plan_text(run, probed, setup.made)
        return run


def model_and_data(
    spec: RunSpec, caller: CallerObjects, device: torch.device, run_dir: Path
) -> tuple[nn.Module, Dataset, Path | None]:
    """The model on `device`, the run's rows and the weights file, as a run builds them (a
    stage's job of its own starts here: Stage.job); token ids checked against the vocabulary."""
    with interruptible():
        data = _data(spec, caller, run_dir)
        model, weights_file = _model(spec, caller, device)
        tokens = token_rows(data)
        check_reads_tokens(model, tokens)
        if tokens is not None:
            check_vocab(tokens, int(model.config.vocab_size))
    return model, data, weights_file


def _data(spec: RunSpec, caller: CallerObjects, run_dir: Path) -> Dataset:
    """The run's rows: the caller's dataset, or the config's, after `limit` (a corpus
    tokenized once for the run's ranks and resumes, in its token cache)."""
    if caller.dataset is None:
        tokenizer = _tokenizer(spec, None if caller.lent else caller.model)
        cache = run_dir / token_cache.FOLDER
        return build_dataset(spec.dataset, spec.seed, spec.limit, tokenizer, cache)
    data = wrap_dataset(caller.dataset, spec.limit)
    # The caller's samples exist already; a batch of them must fit.
    check_batch(spec.batch_size, spec.limit, tuple(data[0][0].shape), len(data))
    return data


def _model(spec: RunSpec, caller: CallerObjects, device: torch.device) -> tuple[nn.Module, Any]:
    """The model on the run's device and the weights file it was loaded from (None: random
    init, or the caller's module)."""
    if caller.model is not None:
        model, weights_file = caller.model, caller.lent_from
    else:
        built = build_model(spec.model, spec.seed, spec.weights_path)
        model, weights_file = built.module, built.weights_file
        if built.random_warning:
            log.warning(
                "model.weights is null: %s has random (seeded) weights", model_label(spec.model)
            )
    if (caller.model is None or caller.lent) and is_placed(spec.model):
        return model, weights_file  # each module where model.device_map put it
    return model.to(device), weights_file


def _vocabulary(model: nn.Module, tokens: Any) -> list[str]:
    """Token data read with a tokenizer: every id's text, decoded once for the stages and
    stored with the file, so the summary and the pictures label tokens from the file alone
    (a caller's tokenizer is in no config; `python -m hookrun.render` runs elsewhere)."""
    tokenizer = adapt(model).tokenizer
    if tokens is None or tokenizer is None:
        return []
    return vocabulary_texts(tokenizer, int(model.config.vocab_size))


def _device_map(model: nn.Module) -> str:
    """The map a model spread over devices ran with (Accelerate's `hf_device_map`: module →
    device, cpu or disk) as JSON; '' for a model on one device."""
    placed = getattr(adapt(model).transformers_model(), "hf_device_map", None)
    return json.dumps({k: str(v) for k, v in placed.items()}) if placed else ""


def _tokenizer(spec: RunSpec, caller_model: nn.Module | None) -> Any:
    """The tokenizer token data is read with (no weights loaded yet): the language model's —
    the caller's LanguageModel's own, or model=hf's — else None (image data)."""
    if caller_model is None:
        return load_tokenizer(spec.model) if spec.model.source == "hf" else None
    tokenizer = adapt(caller_model).tokenizer
    if tokenizer is not None or adapt(caller_model).language is not None:
        return tokenizer
    if type(caller_model).__module__.startswith("transformers."):
        raise HookrunError(
            f"model: a {type(caller_model).__name__} (a transformers model) needs its "
            "tokenizer; valid: hookrun.models.language.LanguageModel(model, tokenizer), or "
            "model=hf model.path=DIR of its save_pretrained folder"
        )
    return None


def _probe(spec: RunSpec, model: nn.Module, sample: torch.Tensor) -> _Probed:
    """The hooks compiled and probed on one sample (an `auto` layer picked first); a failure
    of the user's model there is bad input, in one line."""
    try:
        spec = resolve_cam_layer(spec, model, sample)
        plan = compile_plan(spec.hooks, model)
        shapes, output, plan = probe_shapes(model, plan, sample)
    except HookrunError:
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise HookrunError(
            f"model: {model_label(spec.model)} failed its probe forward pass on sample 0 "
            f"of shape {list(sample.shape)} ({type(err).__name__}: {first})"
        ) from None
    plan, idle = check_reached(plan, shapes)
    never_ran = "; ".join(f"{hook}: {', '.join(layers)}" for hook, layers in idle.items())
    if never_ran:
        log.warning("selected modules that never run (nothing captured there): %s", never_ran)
    return _Probed(spec, plan, shapes, output, never_ran)


def _plan_stages(setup: Setup) -> dict[str, Plan]:
    """Each stage's plan for the run, in order: a stage sees what those before it store."""
    planned: dict[str, Plan] = {}
    for stage in stages():
        config = setup.spec.stage(stage.node) if stage.node else None
        if stage.node and config is None:
            continue  # its node is empty: off
        plan = stage.plan(config, setup)
        if plan is not None:
            planned[stage.name] = plan
            setup.made.update({k: v.shape for k, v in plan.stored().items()})
    return planned


def _stage_attrs(planned: dict[str, Plan]) -> dict[str, dict]:
    """The attributes of the datasets and groups the stages create, by path."""
    out: dict[str, dict] = {}
    for plan in planned.values():
        out |= {k: dict(v.attrs) for k, v in plan.stored().items() if v.attrs}
        out |= {k: dict(v) for k, v in plan.attrs().items()}
    return out


def _named(facts: AxisFacts, outputs: dict[str, Output]) -> AxisFacts:
    """The axes of each record whose action named them (Output.dims) over what the shapes
    say."""
    named = {path: o.dims for path, o in outputs.items() if o.dims is not None and not o.sparse}
    return replace(facts, tensors={**facts.tensors, **named})


def _capture_dtypes(plan: HookPlan, shapes: dict[str, list[CallShapes]]) -> dict[str, str]:
    """Captures stored in another float than sink.dtype (a hook's args.dtype): path → dtype."""
    return {path: o.dtype for path, o in plan.outputs(shapes).items() if o.dtype}


def _stage_dtypes(planned: dict[str, Plan]) -> dict[str, str]:
    """The stages' datasets stored in another float than sink.dtype: path → dtype."""
    return {k: v.dtype for p in planned.values() for k, v in p.stored().items() if v.dtype}


def _listed_positions(plan: HookPlan, shapes: dict[str, list[CallShapes]]) -> dict[str, dict]:
    """Captures of listed positions (`args.positions: [0, -1]`, (N, P, ...)) say which, as
    the attribute `positions`: a reader cannot tell P listed positions from T tokens by the
    shape alone when P equals T."""
    return {
        key: {LISTED_POSITIONS: list(hook.action.positions.items)}
        for hook, key, _, outputs in plan.site_outputs(shapes)
        if key in outputs
        and not hook.action.changes
        and hook.action.positions is not None
        and hook.action.positions.kind == "list"
    }


def _files(claim: Claim, data: Dataset) -> SourceFiles | None:
    """Every row's source file (/samples/path), checked against a resumed file's."""
    files = source_files(data)
    done, path = claim.resumed.rows, claim.sink_path
    if files is not None and done and stored_record(path, SAMPLES_PATH)[1] is None:
        # Started by a hookrun before /samples/path: continued as it began, so its rows
        # keep one layout (a dataset added half-way would have no rows for the first part).
        log.warning("resume: %s was started without /samples/path; continuing without", path)
        return None
    if files is not None and done:
        check_paths(path, files.by_index)
    return files


def _row_facts(spec: RunSpec, data: Dataset, files: SourceFiles | None) -> RowFacts:
    """What the records of each row say beside its tensors."""
    tokens = token_rows(data)
    # logit_diff: every row of the run has one (pipeline/tokencheck.py)
    logit_diff = spec.target.kind == TargetKind.logit_diff
    return RowFacts(
        labelled=has_labels(data),
        files=files,
        tokens=tokens is not None,
        padded=bool(getattr(tokens, "padded", False)),
        against=tokens.counterfactual_answers() if logit_diff else None,
    )


def _probe_entries(run: Prepared) -> dict[str, float]:
    """The non-zeros of each sparse record on the probe's sample (row 0), under the plan's
    hooks: one more forward pass, only for a run with sparse records (the dry run sizes them
    by the L0 it sees, not by the dictionary's width)."""
    if not run.sparse:
        return {}
    recorder = Recorder(run.spec.seed, run.store_dtype)
    recorder.sparse = frozenset(run.sparse)
    sample = run.data[0][0][None].to(run.device)
    with run_mode(run.model), attach(run.plan, run.model, recorder), torch.inference_mode():
        recorder.mask = Batch.of((sample, torch.zeros(1), torch.zeros(1)), run.facts.tokens).mask
        run.model(prepare_input(run.plan, recorder, sample))
    return {p: float(recorder.records[p].nnz) for p in run.sparse if p in recorder.records}


def _plan_text(run: Prepared, probed: _Probed, made: dict[str, tuple[int, ...]]) -> str:
    """The dry-run text: the plan with its shapes, the file's estimated size, and each
    stage's lines."""
    spec, world = run.spec, run.world
    itemsize = run.store_dtype.itemsize
    shards = tuple(
        len(distributed.batch_shard(len(run.data), spec.batch_size, replace(world, rank=rank)))
        for rank in range(world.size)
    )
    file = FileShape(
        samples=len(run.data),
        batch_size=spec.batch_size,
        itemsize=itemsize,
        output=probed.output,
        path_bytes=run.files.width if run.files is not None else 0,
        labelled=has_labels(run.data),
        derived=made,
        shards=shards if world.parallel else (),
        itemsizes={key: STORE_DTYPES[dtype].itemsize for key, dtype in run.dtypes.items()},
        counter_target=spec.target.kind == TargetKind.logit_diff,
        entries=_probe_entries(run),
    )
    lines = [describe_plan(run.plan, probed.shapes, spec.target.kind.value, file)]
    lines += [text for plan in run.stages.values() if (text := plan.describe(itemsize))]
    return "\n".join(lines)
