"""Timing and the loops the benchmarks compare: hookrun's per-batch path, hand-written hooks,
a bare forward, the write floor, Captum. Each loop is a function that runs once per call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import h5py
import numpy as np
import torch

from hookrun.data.batch import Batch
from hookrun.io.sink import HDF5Sink, SinkOptions
from hookrun.runtime.hooks import Recorder, attach, run_mode
from hookrun.runtime.hookspec import HookConfig, HookSpec
from hookrun.runtime.plan import compile_plan
from hookrun.runtime.selectors import SelectConfig
from hookrun.runtime.sites import Site
from hookrun.runtime.step import BatchStep, RowFacts
from hookrun.runtime.targets import TargetConfig
from hookrun.runtime.transfer import HostCopier
from hookrun.stages.derive.registry import derive


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """Wall seconds and CPU seconds (this process, every thread) of one call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu


class Medians(dict):
    """Median wall seconds by variant; `.cpu`: median CPU seconds, which a neighbour
    stealing the machine's cores changes far less than wall time."""

    cpu: dict[str, float]


def compare(variants: dict[str, Callable[[], object]], reps: int, device: torch.device) -> Medians:
    """Median seconds of each variant; repetitions interleaved, one warm-up each."""
    for fn in variants.values():
        fn()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(timed(fn, device))
    out = Medians({name: statistics.median(w for w, _ in t) for name, t in times.items()})
    out.cpu = {name: statistics.median(c for _, c in t) for name, t in times.items()}
    return out


def hooks_of(**specs: tuple) -> tuple[HookSpec, ...]:
    out = []
    for name, (select, at, action, args) in specs.items():
        cfg = HookConfig(select=SelectConfig(**select), at=Site(at), action=action, args=args)
        out.append(HookSpec.from_config(name, cfg))
    return tuple(out)


def hookrun_loop(model, hooks, batches, device, target_kind, folder, derivations=(), checksum=True):
    """What the runner does per batch (no data loading): step, derive, stream to HDF5
    (`checksum=False`: without fletcher32, to show what the checksums cost)."""
    plan = compile_plan(hooks, model)
    target = TargetConfig(kind=target_kind)
    counter = iter(range(10**6))

    def run() -> None:
        path = folder / f"h{next(counter)}.h5"
        copier = HostCopier()
        recorder = Recorder(0, torch.float32, copier)
        step = BatchStep(model, plan, recorder, target, device, RowFacts())
        rows = sum(len(b[0]) for b in batches)
        with (
            HDF5Sink(path, SinkOptions(expected_rows=rows, checksum=checksum)) as sink,
            run_mode(model),
            attach(plan, model, recorder),
        ):
            for batch in batches:
                records = step(Batch.of(batch, token_rows=False))
                if derivations:
                    records.update(derive(list(derivations), records))
                sink.write(records, recorder.events, copier.give_back)
        path.unlink()

    return run


def hand_hooks_loop(model, layers, batches, device, folder):
    """The tutorial way: forward hooks append outputs to lists; one write at the end."""
    modules = dict(model.named_modules())
    counter = iter(range(10**6))

    def run() -> None:
        store: dict[str, list] = {name: [] for name in layers}
        handles = [
            modules[name].register_forward_hook(
                lambda m, i, o, name=name: store[name].append(o.detach().cpu().clone())
            )
            for name in layers
        ]
        try:
            with torch.inference_mode():
                for x, _, _ in batches:
                    model(x.to(device))
        finally:
            for h in handles:
                h.remove()
        path = folder / f"hand{next(counter)}.h5"
        with h5py.File(path, "w") as f:
            for name, parts in store.items():
                f[name] = torch.cat(parts).numpy()
        path.unlink()

    return run


def bare_loop(model, batches, device):
    def run() -> None:
        with torch.inference_mode():
            for x, _, _ in batches:
                model(x.to(device))

    return run


def bare_then_tofile(model, layers, batches, device, folder):
    """A bare forward, then the bytes a capture of `layers` holds written with numpy.tofile:
    the floor for any design that writes them on the cores the forward uses."""
    modules = dict(model.named_modules())
    captured: list[np.ndarray] = []
    handles = [
        modules[name].register_forward_hook(
            lambda m, i, o: captured.append(o.detach().cpu().numpy().copy())
        )
        for name in layers
    ]
    try:
        bare_loop(model, batches, device)()
    finally:
        for h in handles:
            h.remove()
    forward = bare_loop(model, batches, device)

    def run() -> None:
        forward()
        path = folder / "floor.bin"
        with open(path, "wb") as fh:
            for array in captured:
                array.tofile(fh)
        path.unlink()

    return run


def captum_loop(model, method, batches, device):
    """Captum as its docs show it: a forward for the predicted class, then attribute()."""

    def run() -> None:
        for x, _, _ in batches:
            x = x.to(device)
            with torch.no_grad():
                target = model(x).argmax(dim=1)
            method.attribute(x, target=target)

    return run
