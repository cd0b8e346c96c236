"""hookrun's benchmarks: every comparison side by side in one process, median of repetitions.

    python tests/benchmarks/run.py [--device cpu|cuda] [--size 224] [--reps 5] [--out FILE]

Not part of the test run (pytest collects test_*.py only). Writes a markdown table (default
tests/benchmarks/RESULTS.md) that README's "Performance" section shows. Every variant sees the
same model (ResNet-18, seeded random weights: speed does not depend on the values) and the
same batches; repetitions are interleaved so a noisy neighbour hits every variant alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch
import torchvision
from captum.attr import GuidedBackprop, LayerGradCam

from hookrun.engine.hooks import Recorder, attach, run_mode
from hookrun.engine.plan import compile_plan
from hookrun.engine.stream import BatchStep, RowFacts
from hookrun.engine.transfer import HostCopier
from hookrun.io.sink import HDF5Sink, SinkOptions
from hookrun.methods.cam import CamArgs
from hookrun.methods.registry import METHODS, Derivation, derive
from hookrun.spec.build import HookSpec
from hookrun.spec.schema import HookConfig, SelectConfig, Site, TargetConfig, TargetKind

ROOT = Path(__file__).resolve().parents[2]


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def compare(variants: dict[str, Callable[[], object]], reps: int, device: torch.device) -> dict:
    """Median seconds of each variant; repetitions interleaved, one warm-up each."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(timed(fn, device))
    return {name: statistics.median(t) for name, t in times.items()}


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
                records = step(batch)
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


def captum_loop(model, method, batches, device):
    """Captum as its docs show it: a forward for the predicted class, then attribute()."""

    def run() -> None:
        for x, _, _ in batches:
            x = x.to(device)
            with torch.no_grad():
                target = model(x).argmax(dim=1)
            method.attribute(x, target=target)

    return run


def sink_vs_tofile(folder: Path, mib: int, reps: int) -> tuple[float, float]:
    """MiB/s of HDF5Sink and of numpy.tofile writing the same float32 batches."""
    batch = np.random.default_rng(0).standard_normal((16, 64, 32, 32), dtype=np.float32)
    count = max(1, mib * 2**20 // batch.nbytes)
    total = count * batch.nbytes / 2**20

    def on_disk(path: Path) -> None:
        # Both variants end with fsync: the rate is what reached the disk, not the page cache.
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        path.unlink()

    def sink_run() -> None:
        with HDF5Sink(folder / "s.h5", SinkOptions(expected_rows=16 * count)) as sink:
            for _ in range(count):
                sink.write({"x": batch})
        on_disk(folder / "s.h5")

    def tofile_run() -> None:
        with open(folder / "t.bin", "wb") as f:
            for _ in range(count):
                batch.tofile(f)
        on_disk(folder / "t.bin")

    t = compare({"sink": sink_run, "tofile": tofile_run}, reps, torch.device("cpu"))
    return total / t["sink"], total / t["tofile"]


def peak_rss_mib(samples: int, size: int, folder: Path) -> float:
    """Peak RSS of a whole `python -m hookrun experiment=capture` run, in MiB."""
    args = [
        "/usr/bin/time",
        "-f",
        "maxrss_kib=%M",
        sys.executable,
        "-m",
        "hookrun",
        "experiment=capture",
        "model=resnet18",
        "model.weights=null",
        "dataset=fake",
        f"dataset.size={samples}",
        f"dataset.image_size={size}",
        "batch_size=8",
        "progress=false",
        f"hydra.run.dir={folder / f'rss{samples}'}",
    ]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, check=True)
    return int(re.findall(r"maxrss_kib=(\d+)", proc.stderr)[-1]) / 1024


def grad_cam_at_layer4(model: torch.nn.Module, sample: torch.Tensor) -> Derivation:
    """Grad-CAM at layer4 with its layout decided on one sample, as a run prepares it."""
    method, args = METHODS.get("grad_cam", "derive"), CamArgs(layer="layer4")
    return Derivation(method, args, method.prepare(args, model, sample))


def ig_vs_captum(folder: Path, reps: int, device: str) -> tuple[float, float]:
    """Median wall seconds of two whole processes: `python -m hookrun
    experiment=integrated_gradients` and captum_ig.py (resnet18, 32 images of 64 px, 32 steps,
    batch 8, both writing HDF5; hookrun draws no pictures)."""
    hookrun = [
        sys.executable,
        "-m",
        "hookrun",
        "experiment=integrated_gradients",
        "model=resnet18",
        "model.weights=null",
        "dataset=fake",
        "dataset.size=32",
        "dataset.image_size=64",
        "batch_size=8",
        "derive.integrated_gradients.steps=32",
        f"device.name={device}",
        "render=false",
        "progress=false",
    ]
    captum = [sys.executable, str(Path(__file__).with_name("captum_ig.py")), "--device", device]
    counter = iter(range(10**6))

    def process(argv: list[str], hydra: bool) -> Callable[[], None]:
        def run() -> None:
            where = folder / f"ig{next(counter)}"
            extra = [f"hydra.run.dir={where}"] if hydra else [str(where) + ".h5"]
            subprocess.run([*argv, *extra], cwd=ROOT, check=True, capture_output=True)

        return run

    t = compare(
        {"hookrun": process(hookrun, True), "captum": process(captum, False)},
        reps,
        torch.device("cpu"),
    )
    return t["hookrun"], t["captum"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=224, help="image side")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    parser.add_argument("--only-ig", action="store_true", help="only integrated gradients")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval().to(device)
    batches = [
        (
            torch.randn(args.batch, 3, args.size, args.size),
            torch.zeros(args.batch, dtype=torch.long),
            torch.arange(i * args.batch, (i + 1) * args.batch),
        )
        for i in range(args.batches)
    ]
    images = args.batch * args.batches
    rows: list[tuple[str, str, str, str]] = []
    folder = Path(tempfile.mkdtemp(prefix="hookrun-bench-"))

    ours, theirs = ig_vs_captum(folder, args.reps, args.device)
    rows.append(
        (
            "integrated gradients, whole process: Captum seconds / hookrun seconds (32 images "
            "of 64 px, 32 steps, batch 8, both → HDF5)",
            f"{theirs / ours:.2f}×",
            "≥ 1×",
            f"{ours:.1f} s vs {theirs:.1f} s",
        )
    )
    if args.only_ig:
        print("\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows))
        return

    layers = [
        n for n, m in model.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
    ]
    capture = hooks_of(capture=({"type": ["Conv2d", "Linear"]}, "output", "capture", {}))
    t = compare(
        {
            "bare": bare_loop(model, batches, device),
            "hookrun": hookrun_loop(model, capture, batches, device, TargetKind.none, folder),
            "no checksum": hookrun_loop(
                model, capture, batches, device, TargetKind.none, folder, checksum=False
            ),
            "hand": hand_hooks_loop(model, layers, batches, device, folder),
        },
        args.reps,
        device,
    )
    rows.append(
        (
            "capture every conv/linear output → HDF5 vs bare forward",
            f"{t['hookrun'] / t['bare']:.2f}×",
            "≤ 1.15×",
            f"{images / t['hookrun']:.1f} img/s",
        )
    )
    rows.append(
        (
            "… the same without fletcher32 checksums, vs bare forward",
            f"{t['no checksum'] / t['bare']:.2f}×",
            "—",
            f"{images / t['no checksum']:.1f} img/s",
        )
    )
    rows.append(
        (
            "… vs hand-written hooks (lists, one write at the end)",
            f"{t['hookrun'] / t['hand']:.2f}×",
            "—",
            f"{images / t['hand']:.1f} img/s (hand)",
        )
    )

    guided = hooks_of(
        guided_relu=({"type": ["ReLU"]}, "grad_input", "clamp", {"min": 0.0}),
        input_grad=({"name": "input"}, "grad_output", "capture", {}),
    )
    t = compare(
        {
            "hookrun": hookrun_loop(model, guided, batches, device, TargetKind.predicted, folder),
            "captum": captum_loop(model, GuidedBackprop(model), batches, device),
        },
        args.reps,
        device,
    )
    rows.append(
        (
            "guided backprop: hookrun throughput / Captum GuidedBackprop",
            f"{t['captum'] / t['hookrun']:.2f}×",
            "≥ 1.2×",
            f"{images / t['hookrun']:.1f} img/s",
        )
    )

    gradcam = hooks_of(
        act=({"name": "layer4"}, "output", "capture", {}),
        grad=({"name": "layer4"}, "grad_output", "capture", {}),
    )
    t = compare(
        {
            "hookrun": hookrun_loop(
                model,
                gradcam,
                batches,
                device,
                TargetKind.predicted,
                folder,
                [grad_cam_at_layer4(model, batches[0][0][0].to(device))],
            ),
            "captum": captum_loop(model, LayerGradCam(model, model.layer4), batches, device),
        },
        args.reps,
        device,
    )
    rows.append(
        (
            "Grad-CAM: hookrun throughput / Captum LayerGradCam",
            f"{t['captum'] / t['hookrun']:.2f}×",
            "—",
            f"{images / t['hookrun']:.1f} img/s",
        )
    )

    sink_rate, tofile_rate = sink_vs_tofile(folder, 256, args.reps)
    rows.append(
        (
            "HDF5 sink write rate / numpy.tofile (256 MiB, fsync'd, same disk)",
            f"{sink_rate / tofile_rate:.2f}×",
            "≥ 0.8×",
            f"{sink_rate:.0f} vs {tofile_rate:.0f} MiB/s",
        )
    )

    small, large = peak_rss_mib(16, 112, folder), peak_rss_mib(128, 112, folder)
    rows.append(
        (
            "peak RSS, 8× the samples / 1× (experiment=capture, 112 px)",
            f"{large / small:.2f}×",
            "≤ 1.1×",
            f"{small:.0f} → {large:.0f} MiB",
        )
    )

    machine = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, device {device}"
    )
    table = [
        f"ResNet-18, {args.batches} batches of {args.batch} images of {args.size}x{args.size}, "
        f"median of {args.reps}; {machine}.",
        "",
        "| comparison | ratio | goal | absolute |",
        "|---|---|---|---|",
        *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows],
    ]
    text = "\n".join(table) + "\n"
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
