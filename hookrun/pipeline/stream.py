"""Step 2 of a run — stream: hooks attached, batches forward (and backward where a gradient
site is hooked), then each stage's work on the batch, records queued to the writer."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

from torch.utils.data import Subset
from tqdm import tqdm

from hookrun.data.batch import Batch
from hookrun.data.loader import make_loader
from hookrun.errors import HookrunError
from hookrun.io.sink import HDF5Sink, SinkOptions
from hookrun.pipeline.prepare import STORE_DTYPES, Prepared
from hookrun.runtime.hooks import Recorder, attach, run_mode
from hookrun.runtime.step import BatchStep
from hookrun.runtime.transfer import HostCopier
from hookrun.scale import distributed
from hookrun.signals import interruptible, signal_blamed, until_signal
from hookrun.stage import Work, completed

__all__ = ["stream"]


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


def _on_bare_model(recorder: Recorder, stage: str, work: Callable[[], Mapping]) -> Mapping:
    """`work()` timed as `stage`, once the batch's host copies are ready (it reads them),
    with the run's hooks standing aside: a stage's own passes run on the bare model (or on
    hooks of their own)."""
    for event in recorder.events:
        event.synchronize()
    with recorder.timer.stage(stage):
        recorder.paused = True
        try:
            return work()
        finally:
            recorder.paused = False


def _sink(run: Prepared, rows: int) -> HDF5Sink:
    """The writer of this process's file (`rows`: the rows it will hold)."""
    spec = run.spec
    options = SinkOptions(
        dtype=spec.sink.dtype.value,
        compression=spec.sink.compression.value if spec.sink.compression else None,
        queue_depth=spec.sink.queue_depth,
        overwrite=spec.sink.overwrite,
        expected_rows=rows,
        checksum=spec.sink.checksum,
        folds=run.folds,
        dtypes=run.dtypes,
        # A dictionary's latents: only their non-zeros (io/sparse.py), by path.
        sparse={path: (o.shape, ("sample", *(o.dims or ()))) for path, o in run.sparse.items()},
        batch_size=spec.batch_size,
        axes=run.axes,
        attrs=run.attrs,
        summaries=completed,  # what the stages write of all the rows, before `complete`
        # A shard holds rows only: the torchrun join makes the whole-run datasets.
        finishes={} if run.world.parallel else run.finishes,
        constants=run.constants,
    )
    claim = run.claim
    return HDF5Sink(
        claim.sink_path, options, header=run.header, resume=spec.resume, timer=run.timer
    )


@contextmanager
def _guarded(run: Prepared) -> Iterator[None]:
    """Every stage's guard held: what a stage changes in the model comes back."""
    with ExitStack() as stack:
        for plan in run.stages.values():
            stack.enter_context(plan.guard(run.model))
        yield


def stream(run: Prepared) -> int:
    """The run's batches (this rank's share, from the resume point) into its file; the
    number of rows this process computed."""
    spec, timer = run.spec, run.timer
    mine = distributed.batch_shard(len(run.data), spec.batch_size, run.world)
    if not len(mine):
        return 0
    todo = Subset(run.data, range(mine.start + run.claim.resumed.rows, mine.stop))
    copier = HostCopier()
    recorder = Recorder(spec.seed, run.store_dtype, copier, timer, run.folds)
    recorder.dtypes = {key: STORE_DTYPES[dtype] for key, dtype in run.dtypes.items()}
    recorder.sparse = frozenset(run.sparse)
    recorder.keep = frozenset().union(*(plan.reads() for plan in run.stages.values()))
    # A first stage whose pass forwards the batch as the model does (AttnLRP's) gives the
    # batch's output and targets: the step makes no forward of its own where no hook acts.
    first = next(iter(run.stages.values()), None)
    given = first is not None and first.gives_output()
    step = BatchStep(run.model, run.plan, recorder, spec.target, run.device, run.facts, given)
    loader = make_loader(todo, spec.batch_size, spec.num_workers, spec.seed, run.device)
    batches = until_signal(tqdm(loader, desc="hookrun", unit="batch", disable=not spec.progress))
    shape = tuple(run.data[0][0].shape)  # the probe's sample: every sample has its shape
    with (
        _sink(run, len(mine)) as sink,
        run_mode(run.model),
        _guarded(run),
        attach(run.plan, run.model, recorder),
    ):
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


def _batch_records(run: Prepared, step: BatchStep, loaded: tuple) -> dict:
    """Everything the run stores of one batch: the hooked passes' records, then what each
    stage makes of the batch (each sees what those before it stored)."""
    batch = Batch.of(loaded, run.facts.tokens)
    records = step(batch)
    for name, plan in run.stages.items():
        work = Work(step, batch, records, run.spec.seed, run.store_dtype)
        records.update(_on_bare_model(step.recorder, name, lambda p=plan, w=work: p.batch(w)))
    return records
