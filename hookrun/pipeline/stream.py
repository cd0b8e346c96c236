"""Stage 2 of a run — stream: hooks attached, batches forward (and backward where a gradient
site is hooked), derived results per batch, records queued to the writer."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Subset
from tqdm import tqdm

from hookrun.config.schema import TargetConfig, TargetKind
from hookrun.data.loader import SourceFiles, has_labels, make_loader
from hookrun.data.tokens import token_rows
from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.io.encoding import path_rows
from hookrun.io.sink import HDF5Sink, SinkOptions
from hookrun.pipeline.prepare import STORE_DTYPES, Prepared
from hookrun.runtime.hooks import Recorder, attach, prepare_input, run_mode
from hookrun.runtime.leaves import model_logits
from hookrun.runtime.plan import HookPlan
from hookrun.runtime.targets import backward_seed, choose_targets, target_scores
from hookrun.runtime.transfer import HostCopier
from hookrun.scale import distributed
from hookrun.signals import interruptible, signal_blamed, until_signal
from hookrun.stages.derive.registry import BatchContext, derive
from hookrun.stages.sanity.check import PreparedMethod
from hookrun.stages.sanity.randomize import weights_kept
from hookrun.timing import StageTimer

__all__ = ["RowFacts", "BatchStep", "stream"]


@dataclass(frozen=True)
class RowFacts:
    """What the dataset says about each row beyond its tensor: whether its labels mean
    something (/samples/label) and, for file datasets, its source file (/samples/path)."""

    labelled: bool = False
    files: SourceFiles | None = None
    # Token data (data/tokens.py): ids to /samples/tokens, the attention mask to the hooks'
    # `args.positions` and, where rows are padded, to /samples/mask.
    tokens: bool = False
    padded: bool = False
    # target.kind=logit_diff: each dataset row's counterfactual answer token (by index).
    against: torch.Tensor | None = None


class BatchStep:
    """One batch through the hooked model: a forward pass, the backward passes gradient
    hooks need, and the batch's records keyed by their captures.h5 paths."""

    def __init__(
        self,
        model: nn.Module,
        plan: HookPlan,
        recorder: Recorder,
        target: TargetConfig,
        device: torch.device,
        facts: RowFacts,
    ) -> None:
        self.model, self.plan, self.recorder = model, plan, recorder
        self.target, self.device, self.facts = target, device, facts

    def __call__(
        self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor | np.ndarray]:
        """The batch's records; the target class comes from this same forward pass."""
        inputs, labels, index = batch
        recorder, plan = self.recorder, self.plan
        recorder.begin(int(index[0]))
        recorder.rows = index
        timer = recorder.timer
        host = inputs
        inputs = inputs.to(self.device, non_blocking=True)
        self.inputs = inputs  # before any hook changed it: what derived passes start from
        if self.facts.tokens:
            recorder.mask = inputs[:, 1]
        if plan.needs_backward:
            with torch.enable_grad():
                with timer.stage("forward"):
                    inputs = prepare_input(plan, recorder, inputs)
                    output = model_logits(self.model(inputs))
                    targets = choose_targets(output, self.target, labels, self._against(index))
                    seed = backward_seed(output, targets, self.target.kind)
                with timer.stage("backward"):
                    self._backward(seed)
        else:
            with torch.inference_mode(), timer.stage("forward"):
                inputs = prepare_input(plan, recorder, inputs)
                output = model_logits(self.model(inputs))
                targets = choose_targets(output, self.target, labels, self._against(index))
        recorder.record(layout.MODEL_OUTPUT, output)
        self.targets = targets
        records = dict(recorder.records)
        records[layout.SAMPLES_INDEX] = index.to(torch.int64)
        records[layout.SAMPLES_TARGET] = targets if targets.dim() == 1 else targets[:, 0]
        if targets.dim() == 2:  # logit_diff: the token whose logit is subtracted
            records[layout.SAMPLES_COUNTER_TARGET] = targets[:, 1]
        if self.facts.labelled:
            records[layout.SAMPLES_LABEL] = labels.to(torch.int64)
        files = self.facts.files
        if files is not None:
            records[layout.SAMPLES_PATH] = path_rows(files.of(index), files.width)
            if files.lines is not None:
                records[layout.SAMPLES_LINE] = files.lines_of(index)
        if self.facts.tokens:
            records[layout.SAMPLES_TOKENS] = host[:, 0].to(torch.int32)
            if self.facts.padded:
                records[layout.SAMPLES_MASK] = host[:, 1].to(torch.bool)
        return records

    def _against(self, index: torch.Tensor) -> torch.Tensor | None:
        """The batch's counterfactual answers (target.kind=logit_diff), None otherwise."""
        against = self.facts.against
        return None if against is None else against[index.cpu()]

    def context(self) -> BatchContext:
        """The last batch, as a derived method with passes of its own sees it."""
        kind, recorder, device = self.target.kind, self.recorder, self.device
        model, inputs = self.model, self.inputs
        points, forward = None, None
        embed = getattr(model, "embed", None)  # a LanguageModel: gradients explain embeddings
        if self.facts.tokens and callable(embed):
            with torch.no_grad():
                points = embed(inputs)
            forward = lambda p, sample: model.from_embeddings(p, inputs[sample])  # noqa: E731
        return BatchContext(
            model=model,
            inputs=inputs,
            # A clone: targets chosen under inference_mode cannot take part in autograd.
            targets=self.targets.clone().to(device),
            score=lambda output, targets: target_scores(output, targets, kind),
            generator=lambda name: recorder.generator(name, "input", device),
            points=points,
            forward=forward,
        )

    def _backward(self, seed: torch.Tensor) -> None:
        passes = self.plan.backward_passes
        recorder = self.recorder
        for i, name in enumerate(passes):
            recorder.current_pass = name
            if recorder.edges[name]:
                # Only the subgraph between the target and the hooked tensors runs.
                torch.autograd.grad(
                    seed, recorder.edges[name], allow_unused=True, retain_graph=i < len(passes) - 1
                )
        recorder.current_pass = None


def _next_batch(batches: Iterator, shape: tuple[int, ...]) -> Any:
    """The next batch, or None at the end; HookrunError for samples whose shape is not the
    first sample's (the model was probed on it, and the file's rows have its shape)."""
    try:
        batch = next(batches, None)
    except RuntimeError as err:  # the loader could not stack samples of different shapes
        said = [line for line in str(err).splitlines() if "equal size" in line]
        if not said:
            raise
        raise HookrunError(
            f"dataset: samples of different shapes ({said[0].strip()}); valid: samples of one "
            f"shape, {list(shape)} as the first (resize or crop them)"
        ) from None
    if batch is not None and tuple(batch[0].shape[1:]) != shape:
        raise HookrunError(
            f"dataset: sample {int(batch[2][0])} has shape {list(batch[0].shape[1:])}, the first "
            f"{list(shape)}; valid: samples of one shape (resize or crop them)"
        )
    return batch


# The sanity check's methods explain the original model's targets, handed in as labels.
_GIVEN_TARGETS = TargetConfig(kind=TargetKind.label)


def _method_records(run: Prepared, method: PreparedMethod, batch: tuple) -> Mapping:
    """One sanity-check method on one batch, on the model as it is now: its own hooks
    attached (the run's stand aside, paused), a forward pass, its backward passes, then its
    derived results; `batch` = (inputs, targets, dataset indices)."""
    dtype = STORE_DTYPES[run.spec.sink.dtype.value]
    recorder = Recorder(run.spec.seed, dtype, HostCopier(), StageTimer(False), dict(method.folds))
    step = BatchStep(run.model, method.plan, recorder, _GIVEN_TARGETS, run.device, RowFacts())
    with attach(method.plan, run.model, recorder):
        records = step(batch)
    for event in recorder.events:
        event.synchronize()
    if method.derivations:
        records.update(derive(method.derivations, records, step.context()))
    return records


def _evaluate(run: Prepared, step: BatchStep, batch: tuple, records: Mapping) -> dict:
    """The evaluation and sanity-check rows of the batch `step` has just run."""
    out: dict = {}
    targets = step.targets.clone().to(run.device)
    if run.evaluation is not None:
        out.update(
            run.evaluation.batch(
                records,
                step.inputs,
                targets,
                lambda x: model_logits(run.model(x)),
                lambda name: step.recorder.generator(name, "input", torch.device("cpu")),
            )
        )
    if run.sanity is not None:
        given = (step.inputs, targets.cpu(), batch[2])
        out.update(run.sanity.batch(given, lambda m, b: _method_records(run, m, b)))
    return out


def _on_bare_model(recorder: Recorder, stage: str, work: Callable[[], Mapping]) -> Mapping:
    """`work()` timed as `stage`, once the batch's host copies are ready (it reads them),
    with the run's hooks standing aside: derived methods' and the evaluation's own passes
    run on the bare model (or on hooks of their own)."""
    for event in recorder.events:
        event.synchronize()
    with recorder.timer.stage(stage):
        recorder.paused = True
        try:
            return work()
        finally:
            recorder.paused = False


def stream(run: Prepared) -> int:
    """The run's batches (this rank's share, from the resume point) into its file; the
    number of rows this process computed."""
    spec, timer = run.spec, run.timer
    mine = distributed.batch_shard(len(run.data), spec.batch_size, run.world)
    if not len(mine):
        return 0
    todo = Subset(run.data, range(mine.start + run.done, mine.stop))
    copier = HostCopier()
    recorder = Recorder(spec.seed, STORE_DTYPES[spec.sink.dtype.value], copier, timer, run.folds)
    recorder.dtypes = {key: STORE_DTYPES[dtype] for key, dtype in run.dtypes.items()}
    tokens = token_rows(run.data)
    padded = bool(getattr(tokens, "padded", False))
    # logit_diff: every row of the run has one (pipeline/tokencheck.py)
    logit_diff = spec.target.kind == TargetKind.logit_diff
    against = tokens.counterfactual_answers() if logit_diff else None
    facts = RowFacts(has_labels(run.data), run.files, tokens is not None, padded, against)
    step = BatchStep(run.model, run.plan, recorder, spec.target, run.device, facts)
    loader = make_loader(todo, spec.batch_size, spec.num_workers, spec.seed, run.device)
    options = SinkOptions(
        dtype=spec.sink.dtype.value,
        compression=spec.sink.compression.value if spec.sink.compression else None,
        queue_depth=spec.sink.queue_depth,
        overwrite=spec.sink.overwrite,
        expected_rows=len(mine),
        checksum=spec.sink.checksum,
        folds=run.folds,
        dtypes=run.dtypes,
        batch_size=spec.batch_size,
        axes=run.axes,
        attrs=run.attrs,
    )
    sink = HDF5Sink(run.sink_path, options, header=run.header, resume=spec.resume, timer=timer)
    batches = until_signal(tqdm(loader, desc="hookrun", unit="batch", disable=not spec.progress))
    shape = tuple(run.data[0][0].shape)  # the probe's sample: every sample has its shape
    # The sanity check randomises the model's weights: they are the caller's again at the end.
    kept = weights_kept(run.model) if run.sanity is not None else nullcontext()
    with sink, run_mode(run.model), kept, attach(run.plan, run.model, recorder):
        while True:
            # A signal stops the batch in flight at once (it is not in the file yet); the
            # queue to the writer is left only once a batch is whole in it.
            with interruptible(), signal_blamed():
                with timer.stage("data"):
                    batch = _next_batch(batches, shape)
                if batch is None:
                    break
                records = _batch_records(run, step, batch)
            sink.write(records, recorder.events, copier.give_back)
    return len(todo)


def _batch_records(run: Prepared, step: BatchStep, batch: tuple) -> dict:
    """Everything the run stores of one batch: the hooked passes' records, then what the
    derived methods, the evaluation, the sanity check and patching make of the batch."""
    recorder = step.recorder
    records = step(batch)
    if run.derivations:
        # The context inside: a language model's embeddings are computed with the run's
        # hooks standing aside, like the derived passes themselves.
        def work(records=records):
            return derive(run.derivations, records, step.context())

        records.update(_on_bare_model(recorder, "derive", work))
    if run.evaluation is not None or run.sanity is not None:
        work = partial(_evaluate, run, step, batch, records)
        records.update(_on_bare_model(recorder, "evaluate", work))
    if run.patching is not None:  # the layers × positions grids (hookrun/patching/)
        work = partial(run.patching.batch, run.model, step.inputs, batch[1], batch[2])
        records.update(_on_bare_model(recorder, "patching", work))
    return records
