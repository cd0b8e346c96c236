"""One run: validate → build → plan → probe → batches (forward, target, backward) → sink.

Everything that can be wrong with the input is checked before the first batch; the sink
file is created only after that.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import torch
import torchvision
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from hookrun import __version__
from hookrun.config import DeviceConfig, StoreDtype, TargetConfig, validate
from hookrun.data import build_dataset, has_labels, make_loader
from hookrun.derive import derive, plan_derivations
from hookrun.errors import HookrunError
from hookrun.hooks import Recorder, attach, prepare_input, probe_shapes, run_mode
from hookrun.models import SEED_MODELS, build_model, class_names, model_label
from hookrun.plan import HookPlan, compile_plan
from hookrun.render import render
from hookrun.results import summary
from hookrun.sinks.hdf5 import HDF5Sink, check_sink_path
from hookrun.targets import backward_seed, check_target, choose_targets

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


def resolve_device(cfg: DeviceConfig) -> torch.device:
    """`cpu`, `cuda`, `cuda:N` or `auto`, checked against this machine."""
    name = cfg.name
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
    """Forward (and backward where a hook needs it) for one batch; the batch's records."""
    inputs, labels, index = batch
    recorder.begin(int(index[0]))
    inputs = inputs.to(device, non_blocking=True)
    if plan.needs_backward:
        with torch.enable_grad():
            inputs = prepare_input(plan, recorder, inputs)
            output = _tensor_output(model(inputs))
            targets = choose_targets(output, target, labels)
            seed = backward_seed(output, targets, target.kind)
            passes = plan.backward_passes
            for i, name in enumerate(passes):
                recorder.current_pass = name
                if recorder.edges[name]:
                    # Only the subgraph between the target and the hooked tensors is computed.
                    torch.autograd.grad(
                        seed,
                        recorder.edges[name],
                        allow_unused=True,
                        retain_graph=i < len(passes) - 1,
                    )
            recorder.current_pass = None
    else:
        with torch.inference_mode():
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


def _root_attrs(cfg: DictConfig, seed: int, experiment: str | None) -> dict[str, object]:
    return {
        "config": OmegaConf.to_yaml(cfg, resolve=True),
        "experiment": experiment or "",
        "hookrun_version": __version__,
        "torch_version": str(torch.__version__),
        "torchvision_version": str(torchvision.__version__),
        "h5py_version": h5py.__version__,
        "seed": seed,
    }


def run(cfg: DictConfig, run_dir: Path, experiment: str | None = None) -> RunResult:
    """Run the experiment `cfg` describes; captures go to `run_dir`/captures.h5 by default,
    pictures to `run_dir`/images/<experiment>/ unless render=false."""
    started = time.perf_counter()
    valid = validate(cfg)
    r = valid.run
    sink_path = Path(r.sink.path).expanduser() if r.sink.path else run_dir / "captures.h5"
    if not r.dry_run:
        check_sink_path(sink_path, r.sink.overwrite)
    device = resolve_device(r.device)
    model = build_model(valid.model, r.seed, r.weights_path)
    if valid.model.weights is None and valid.model.name not in SEED_MODELS:
        log.warning(
            "model.weights is null: %s has random (seeded) weights", model_label(valid.model)
        )
    data = build_dataset(valid.dataset, r.seed, r.limit)
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
    log.info("\n%s", plan_text)

    recorder = Recorder(r.seed, dtype)
    loader = make_loader(data, r.batch_size, r.num_workers, r.seed)
    labelled = has_labels(data)
    compression = r.sink.compression.value if r.sink.compression else None
    sink = HDF5Sink(
        sink_path,
        dtype=r.sink.dtype.value,
        compression=compression,
        attrs=_root_attrs(cfg, r.seed, experiment),
        queue_depth=r.sink.queue_depth,
        overwrite=r.sink.overwrite,
        expected_rows=len(data),
    )
    with sink, run_mode(model), attach(plan, model, recorder):
        for batch in tqdm(loader, desc="hookrun", unit="batch", disable=not r.progress):
            records = step(model, plan, recorder, r.target, batch, device, labelled)
            records.update(derive(derivations, records))
            sink.write(records)
    images = None
    if r.render:
        images = run_dir / "images" / (experiment or "run")
        tensorboard = run_dir / "tensorboard" if r.logger == "tensorboard" else None
        render(sink_path, images, r.render_max, tensorboard, plan_text)
    seconds = time.perf_counter() - started
    log.info("\n%s", summary(sink_path, seconds, class_names(valid.model), images))
    return RunResult(sink_path, sink.rows, plan_text, seconds, images)
