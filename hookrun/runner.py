"""One run: validate → build → plan → probe → batches (forward, target, backward) → sink.

Everything that can be wrong with the input is checked before the first batch; the sink
file is created only after that.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Subset
from tqdm import tqdm

from hookrun import distributed
from hookrun.config import DeviceConfig, StoreDtype, TargetConfig, ValidConfig, validate
from hookrun.data import build_dataset, has_labels, make_loader
from hookrun.derive import Derivation, derive, plan_derivations
from hookrun.distributed import World, world_from_env
from hookrun.errors import HookrunError
from hookrun.hooks import Recorder, attach, prepare_input, probe_shapes, run_mode
from hookrun.models import SEED_MODELS, build_model, class_names, model_label
from hookrun.plan import HookPlan, compile_plan
from hookrun.profile import StageTimer
from hookrun.provenance import reproducible, root_attrs
from hookrun.render import render
from hookrun.results import summary
from hookrun.sinks.hdf5 import HDF5Sink, check_sink_path, resume_point
from hookrun.targets import backward_seed, check_target, choose_targets
from hookrun.transfer import HostCopier

__all__ = ["RunResult", "resolve_device", "run", "step"]

log = logging.getLogger(__name__)

_TORCH_DTYPES = {StoreDtype.float32: torch.float32, StoreDtype.float16: torch.float16}


@dataclass
class RunResult:
    """What a run produced: the file (None for a dry run), rows, the plan, the pictures."""

    path: Path | None
    rows: int
    plan_text: str
    seconds: float
    images: Path | None = None
    profile: dict[str, float] | None = None  # seconds per stage, with profile=true


def resolve_device(cfg: DeviceConfig, world: World | None = None) -> torch.device:
    """`cpu`, `cuda`, `cuda:N` or `auto`, checked against this machine; under torchrun,
    `cuda` is each rank's local GPU."""
    name = cfg.name
    parallel = world is not None and world.parallel
    if parallel and name in ("cuda", "auto") and torch.cuda.is_available():
        name = f"cuda:{world.local_rank}"
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise HookrunError(
                f"device.name: {cfg.name!r} but CUDA is not available here (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda}); valid here: cpu, auto"
            )
        index = int(name.partition(":")[2] or torch.cuda.current_device())
        if index >= torch.cuda.device_count():
            raise HookrunError(
                f"device.name: {cfg.name!r} but this machine has {torch.cuda.device_count()} "
                f"CUDA device(s); valid: cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
        torch.backends.cuda.matmul.allow_tf32 = cfg.allow_tf32
        torch.backends.cudnn.allow_tf32 = cfg.allow_tf32
        return torch.device("cuda", index)
    return torch.device("cpu")


def step(
    model: torch.nn.Module,
    plan: HookPlan,
    recorder: Recorder,
    target: TargetConfig,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    device: torch.device,
    labelled: bool,
) -> dict[str, torch.Tensor]:
    """One forward pass (and the backward passes gradient hooks need) for one batch; the
    batch's records. The target class comes from this same forward pass."""
    inputs, labels, index = batch
    recorder.begin(int(index[0]))
    timer = recorder.timer
    inputs = inputs.to(device, non_blocking=True)
    if plan.needs_backward:
        with torch.enable_grad():
            with timer.stage("forward"):
                inputs = prepare_input(plan, recorder, inputs)
                output = _tensor_output(model(inputs))
                targets = choose_targets(output, target, labels)
                seed = backward_seed(output, targets, target.kind)
            passes = plan.backward_passes
            with timer.stage("backward"):
                for i, name in enumerate(passes):
                    recorder.current_pass = name
                    if recorder.edges[name]:
                        # Only the subgraph between the target and the hooked tensors runs.
                        torch.autograd.grad(
                            seed,
                            recorder.edges[name],
                            allow_unused=True,
                            retain_graph=i < len(passes) - 1,
                        )
            recorder.current_pass = None
    else:
        with torch.inference_mode(), timer.stage("forward"):
            inputs = prepare_input(plan, recorder, inputs)
            output = _tensor_output(model(inputs))
            targets = choose_targets(output, target, labels)
    recorder.record("model/output", output)
    records = dict(recorder.records)
    records["samples/index"] = index.to(torch.int64)
    records["samples/target"] = targets
    if labelled:
        records["samples/label"] = labels.to(torch.int64)
    return records


def _tensor_output(output: object) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise HookrunError(
            f"model: the model returned a {type(output).__name__}; hookrun needs a tensor "
            "output (N, ...)"
        )
    return output


def run(cfg: DictConfig, run_dir: Path, experiment: str | None = None) -> RunResult:
    """Run the experiment `cfg` describes; captures go to `run_dir`/captures.h5 by default,
    pictures to `run_dir`/images/<experiment>/ unless render=false. Under torchrun every rank
    runs its share of the batches and rank 0 joins the shards."""
    started = time.perf_counter()
    valid = validate(cfg)
    r = valid.run
    world = world_from_env()
    device = resolve_device(r.device, world)
    try:
        if world.parallel:
            run_dir = distributed.start(world, device, run_dir)
        with reproducible(r.seed, r.deterministic):
            return _run(cfg, valid, run_dir, experiment, world, device, started)
    finally:
        distributed.stop()


def _run(
    cfg: DictConfig,
    valid: ValidConfig,
    run_dir: Path,
    experiment: str | None,
    world: World,
    device: torch.device,
    started: float,
) -> RunResult:
    r = valid.run
    final_path = Path(r.sink.path).expanduser() if r.sink.path else run_dir / "captures.h5"
    sink_path = distributed.shard_path(final_path, world) if world.parallel else final_path
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    done = 0
    if r.resume:
        done = resume_point(sink_path, config_yaml)
    elif not r.dry_run:
        check_sink_path(sink_path, r.sink.overwrite)
        if world.parallel and world.rank == 0:
            check_sink_path(final_path, r.sink.overwrite)  # the file the shards will join in
    data = build_dataset(valid.dataset, r.seed, r.limit)  # cheap checks before the weights
    model, weights_file = build_model(valid.model, r.seed, r.weights_path)
    if valid.model.weights is None and valid.model.name not in SEED_MODELS:
        log.warning(
            "model.weights is null: %s has random (seeded) weights", model_label(valid.model)
        )
    plan = compile_plan(valid.hooks, model)
    model.to(device)

    sample = data[0][0].to(device)
    shapes, output_shape = probe_shapes(model, plan.layers, sample)
    check_target(r.target, output_shape, has_labels(data))
    with run_mode(model):
        derivations = plan_derivations(
            r.derive, set(plan.capture_shapes(shapes)), model, sample, r.target.kind.value
        )
    dtype = _TORCH_DTYPES[r.sink.dtype]
    plan_text = plan.describe(shapes, output_shape, len(data), dtype.itemsize, r.target.kind.value)
    if r.dry_run:
        print(plan_text)
        return RunResult(None, 0, plan_text, time.perf_counter() - started)
    if world.rank == 0:
        log.info("\n%s", plan_text)

    total = len(data)
    mine = distributed.batch_shard(total, r.batch_size, world)
    todo = Subset(data, range(mine.start + done, mine.stop))
    attrs = root_attrs(cfg, r.seed, experiment, weights_file, device, world.size)
    timer = StageTimer(r.profile, device)
    if len(mine):
        _stream(valid, plan, derivations, model, todo, sink_path, attrs, len(mine), device, timer)
    if world.parallel:
        torch.distributed.barrier()  # every shard is complete before rank 0 reads them
        if world.rank != 0:
            return RunResult(sink_path, len(mine), plan_text, time.perf_counter() - started)
        replace = r.sink.overwrite or r.resume  # a resumed run may redo an interrupted merge
        distributed.merge_shards(final_path, world, total, r.batch_size, attrs, replace)
    images = None
    if r.render:
        images = run_dir / "images" / (experiment or "run")
        tensorboard = run_dir / "tensorboard" if r.logger == "tensorboard" else None
        if not render(final_path, images, r.render_max, tensorboard, plan_text):
            images = None
    seconds = time.perf_counter() - started
    text = summary(final_path, seconds, class_names(valid.model), images)
    if r.profile:
        text += "\n" + timer.report(seconds)
    log.info("\n%s", text)
    return RunResult(final_path, total, plan_text, seconds, images, dict(timer.seconds))


def _stream(
    valid: ValidConfig,
    plan: HookPlan,
    derivations: list[Derivation],
    model: torch.nn.Module,
    data: Subset,
    path: Path,
    attrs: dict,
    expected_rows: int,
    device: torch.device,
    timer: StageTimer,
) -> None:
    """The batches of `data` through the hooked model into the HDF5 file at `path`."""
    r = valid.run
    dtype = _TORCH_DTYPES[r.sink.dtype]
    copier = HostCopier()
    recorder = Recorder(r.seed, dtype, copier, timer)
    loader = make_loader(data, r.batch_size, r.num_workers, r.seed, device)
    labelled = has_labels(data.dataset)
    sink = HDF5Sink(
        path,
        dtype=r.sink.dtype.value,
        compression=r.sink.compression.value if r.sink.compression else None,
        attrs=attrs,
        queue_depth=r.sink.queue_depth,
        overwrite=r.sink.overwrite,
        expected_rows=expected_rows,
        resume=r.resume,
        timer=timer,
    )
    batches = iter(tqdm(loader, desc="hookrun", unit="batch", disable=not r.progress))
    with sink, run_mode(model), attach(plan, model, recorder):
        while True:
            with timer.stage("data"):
                batch = next(batches, None)
            if batch is None:
                break
            records = step(model, plan, recorder, r.target, batch, device, labelled)
            if derivations:
                for event in recorder.events:
                    event.synchronize()  # derived results read the host copies now
                with timer.stage("derive"):
                    records.update(derive(derivations, records))
            sink.write(records, recorder.events, copier.give_back)
