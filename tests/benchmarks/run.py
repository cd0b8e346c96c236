"""hookrun's benchmarks: every comparison side by side in one process, median of repetitions.

    python tests/benchmarks/run.py [--device cpu|cuda] [--size 224] [--reps 5] [--out FILE]
    python tests/benchmarks/run.py --only-ig | --only-eval   (one comparison, no file written)

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
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torchvision
from captum.attr import GuidedBackprop, LayerGradCam
from evaluation import evaluation_rows  # this folder, like loops
from loops import (  # this folder: run as a script, it is first on sys.path
    bare_loop,
    bare_then_tofile,
    captum_loop,
    compare,
    hand_hooks_loop,
    hookrun_loop,
    hooks_of,
)

from hookrun.io import appender
from hookrun.io.sink import HDF5Sink, SinkOptions
from hookrun.runtime.targets import TargetKind
from hookrun.stages.derive.cam import CamArgs
from hookrun.stages.derive.registry import METHODS, Derivation

ROOT = Path(__file__).resolve().parents[2]


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


def scales_row(model: torch.nn.Module, batches: list, what: str, folder: Path, reps: int) -> tuple:
    """The table row of capturing every Conv2d/Linear output of ResNet-18 (`batches`,
    described by `what`) into a new file, with every axis named (HDF5 dimension scales, made
    once per file before SWMR starts) and without."""
    capture = hooks_of(capture=({"type": ["Conv2d", "Linear"]}, "output", "capture", {}))
    device = torch.device("cpu")
    named = hookrun_loop(model, capture, batches, device, TargetKind.none, folder)

    def unnamed() -> None:
        real = appender.name_dimensions
        appender.name_dimensions = lambda *args: None
        try:
            named()
        finally:
            appender.name_dimensions = real

    t = compare({"named": named, "unnamed": unnamed}, reps, device)
    layers = sum(isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)) for m in model.modules())
    count = layers + 4  # and /samples/index, /samples/target, /model/output, /sample
    extra = (t["named"] - t["unnamed"]) * 1e3
    return (
        f"named dimensions: capture every conv/linear output ({what}) into a new file of "
        f"{count} datasets, with scales / without",
        f"{t['named'] / t['unnamed']:.2f}×",
        "≈ 1×",
        f"{t['named'] * 1e3:.0f} vs {t['unnamed'] * 1e3:.0f} ms (+{extra:.0f} ms)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=224, help="image side")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    parser.add_argument("--only-ig", action="store_true", help="only integrated gradients")
    parser.add_argument("--only-scales", action="store_true", help="only the dimension names")
    parser.add_argument(
        "--only-eval", action="store_true", help="only evaluation (deletion, insertion, ROAD)"
    )
    args = parser.parse_args()
    if args.only_eval:
        rows = evaluation_rows(args.size, args.batch, min(args.reps, 3))
        print("\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows))
        return
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

    small = [(torch.randn(8, 3, 32, 32), torch.zeros(8, dtype=torch.long), torch.arange(8))]
    for what, data in (("the batches above", batches), ("one batch of 8 images of 32 px", small)):
        rows.append(scales_row(model, data, what, folder, max(args.reps, 15)))
    if args.only_scales:
        print("\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows))
        return

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
            "floor": bare_then_tofile(model, layers, batches, device, folder),
        },
        args.reps,
        device,
    )
    rows.append(
        (
            "capture every conv/linear output → HDF5 vs bare forward: wall (CPU seconds)",
            f"{t['hookrun'] / t['bare']:.2f}× ({t.cpu['hookrun'] / t.cpu['bare']:.2f}×)",
            "≤ 1.15×",
            f"{images / t['hookrun']:.1f} img/s",
        )
    )
    rows.append(
        (
            "… the same without fletcher32 checksums, vs bare forward",
            f"{t['no checksum'] / t['bare']:.2f}× ({t.cpu['no checksum'] / t.cpu['bare']:.2f}×)",
            "—",
            f"{images / t['no checksum']:.1f} img/s",
        )
    )
    rows.append(
        (
            "… floor: a bare forward, then the same bytes written by numpy.tofile",
            f"{t['floor'] / t['bare']:.2f}× ({t.cpu['floor'] / t.cpu['bare']:.2f}×)",
            "—",
            f"{images / t['floor']:.1f} img/s",
        )
    )
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads > 1:
        # The writer thread overlaps the forward only on a core the forward leaves free.
        torch.set_num_threads(threads - 1)
        free = compare(
            {
                "bare": bare_loop(model, batches, device),
                "hookrun": hookrun_loop(model, capture, batches, device, TargetKind.none, folder),
                "no checksum": hookrun_loop(
                    model, capture, batches, device, TargetKind.none, folder, checksum=False
                ),
            },
            args.reps,
            device,
        )
        torch.set_num_threads(threads)
        with_sums, without = free["hookrun"] / free["bare"], free["no checksum"] / free["bare"]
        rows.append(
            (
                f"… the forward on {threads - 1} of {threads} threads (a core left to the "
                "writer): with / without checksums, vs bare forward on as many",
                f"{with_sums:.2f}× / {without:.2f}×",
                "≤ 1.15×",
                f"{images / free['hookrun']:.1f} img/s",
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

    # Evaluation: 3 repetitions at most (pytorch-grad-cam's ROAD takes a minute per batch).
    rows += evaluation_rows(args.size, args.batch, min(args.reps, 3))

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
