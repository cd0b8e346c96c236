"""Perturbation methods against the libraries people compare them with: images per second of
hookrun's occlusion, feature ablation, Score-CAM and Ablation-CAM against Captum's
`Occlusion` and `FeatureAblation` and pytorch-grad-cam's `ScoreCAM` and `AblationCAM`, on the
same ImageNet MobileNetV2 (the shipped weights), the same images and the same settings, and
the largest difference between the maps. hookrun is timed as whole in-process runs less a
run with no derived method (its fixed part: data, model, file); the others as the method's
call on tensors already made, with their default batching (Captum: one perturbation of the
batch per forward; pytorch-grad-cam: 16 or 32 channels per forward) and, for Captum, with
`perturbations_per_eval` as large as hookrun's pass. Then the peak memory of an occlusion run
at a batch of 2 and of 8 (each its own process): flat when passes are sized by memory.

    python tests/benchmarks/perturbation.py [--images 8] [--reps 2]

Settings: occlusion window 32, stride 32 (49 windows); feature ablation on an 8 × 8 grid
(64 segments); KernelSHAP on the same grid with 256 samples (each library draws its own,
so its maps agree only roughly); Score-CAM and Ablation-CAM at features.18 (1280 channels;
a ReLU6 output, so pytorch-grad-cam's ablation is hookrun's 0) — hookrun's Ablation-CAM runs
only what follows features.18 (the pooling and the classifier) per ablated channel, from the
captured output; pytorch-grad-cam runs the whole network per channel. Peak memory is GNU time's
%M of each child, measured first (a child forked from a large parent would report the
parent's size). Not part of the test run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # references
from references import mobilenet  # noqa: E402

import hookrun  # noqa: E402

BASE = [
    "model=mobilenet_v2",
    "dataset=fake",
    "dataset.image_size=224",
    "target.kind=predicted",
    "render=false",
    "progress=false",
]
METHODS = {
    "occlusion": ["derive.occlusion.window=32", "derive.occlusion.stride=32"],
    "feature_ablation": [
        "derive.feature_ablation.segments=grid",
        "derive.feature_ablation.cells=8",
    ],
    "kernel_shap": [
        "derive.kernel_shap.segments=grid",
        "derive.kernel_shap.cells=8",
        "derive.kernel_shap.samples=256",
    ],
    "score_cam": [],  # features.18: 1280 channels
    "ablation_cam": [],
}


def _hookrun(name: str, images: int, batch: int, out: Path) -> tuple[float, Path]:
    args = [f"experiment={name}", *BASE, f"dataset.size={images}", f"batch_size={batch}"]
    start = time.perf_counter()
    result = hookrun.run([*args, *METHODS.get(name, [])], run_dir=out)
    return time.perf_counter() - start, result.path


def _reference(
    name: str, model, x: torch.Tensor, target: torch.Tensor, per_eval: int
) -> np.ndarray:
    if name == "occlusion":
        from captum.attr import Occlusion

        return (
            Occlusion(model)
            .attribute(
                x,
                sliding_window_shapes=(3, 32, 32),
                strides=(3, 32, 32),
                baselines=0.0,
                target=target,
                perturbations_per_eval=per_eval,
            )
            .numpy()
        )
    if name == "feature_ablation":
        from captum.attr import FeatureAblation

        cells = torch.arange(224) * 8 // 224
        mask = (cells[:, None] * 8 + cells[None, :]).expand(1, 3, 224, 224)
        return (
            FeatureAblation(model)
            .attribute(
                x, baselines=0.0, target=target, feature_mask=mask, perturbations_per_eval=per_eval
            )
            .numpy()
        )
    if name == "kernel_shap":  # the same 64 segments and sample count; its draws are its own
        from captum.attr import KernelShap

        cells = torch.arange(224) * 8 // 224
        mask = (cells[:, None] * 8 + cells[None, :]).expand(1, 3, 224, 224)
        torch.manual_seed(0)
        return (
            KernelShap(model)
            .attribute(
                x,
                baselines=0.0,
                target=target,
                feature_mask=mask,
                n_samples=256,
                perturbations_per_eval=per_eval,
            )
            .numpy()
        )
    from pytorch_grad_cam import AblationCAM, ScoreCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    layer = model.features[18]
    seen = []
    handle = layer.register_forward_hook(lambda m, a, o: seen.append(o.detach()))
    with torch.no_grad():
        model(x)
    handle.remove()
    cam = (ScoreCAM if name == "score_cam" else AblationCAM)(model, [layer])
    targets = [ClassifierOutputTarget(int(t)) for t in target]
    a = seen[0].numpy()
    weights = cam.get_cam_weights(x, layer, targets, a, None)
    return np.maximum((weights[:, :, None, None] * a).sum(1), 0)


CHILD = """
import sys
import hookrun
hookrun.run(["experiment=occlusion", *sys.argv[3:], "dataset.size=8", f"batch_size={sys.argv[1]}"],
            run_dir=sys.argv[2])
"""


def _peak_mib(batch: int, out: Path) -> float:
    """GNU time's maximum resident size of an occlusion run at `batch`, in MiB."""
    args = [str(batch), str(out), *BASE, *METHODS["occlusion"]]
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%M", sys.executable, "-c", CHILD, *args],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return float(done.stderr.strip().splitlines()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=list(METHODS), help="methods to time")
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="perturbation_bench_"))
    peaks = {batch: _peak_mib(batch, work / f"mem{batch}") for batch in (2, 8)}
    model = mobilenet()
    print(
        f"MobileNetV2 (ImageNet), {args.images} images of 224 px, batch {args.images}; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, cpu; medians of {args.reps}"
    )
    fixed = statistics.median(
        _hookrun("saliency", args.images, args.images, work / f"fixed{r}")[0]
        for r in range(args.reps)
    )
    print(f"  hookrun's fixed part (a saliency run): {fixed:.2f} s")
    for name in args.only:
        runs = [
            _hookrun(name, args.images, args.images, work / f"{name}{r}") for r in range(args.reps)
        ]
        ours = statistics.median(t for t, _ in runs) - fixed
        with h5py.File(runs[0][1]) as f:
            x = torch.from_numpy(f["captures/input/output"][()])
            target = torch.from_numpy(f["samples/target"][()])
            got = f[
                [
                    f"derived/{name}/{k}"
                    for k in f[f"derived/{name}"]
                    if k in ("input", "features.18")
                ][0]
            ][()]
        settings = [1] if "cam" in name else [1, 64]
        for per_eval in settings:
            times, want = [], None
            for _ in range(args.reps):
                start = time.perf_counter()
                want = _reference(name, model, x, target, per_eval)
                times.append(time.perf_counter() - start)
            theirs = statistics.median(times)
            # KernelSHAP's samples are each library's own draws: close, not equal.
            error = float(np.abs(got - want).max() / np.abs(want).max())
            who = (
                "pytorch-grad-cam"
                if "cam" in name
                else f"Captum, perturbations_per_eval={per_eval}"
            )
            print(
                f"  {name:17s} hookrun {args.images / ours:7.2f} images/s ({ours:.1f} s); "
                f"{who}: {args.images / theirs:7.2f} images/s ({theirs:.1f} s); "
                f"hookrun / them {theirs / ours:.2f}x; max difference {error:.1e} of the max"
            )
    print(
        f"  occlusion peak resident memory: batch 2 {peaks[2]:.0f} MiB, batch 8 {peaks[8]:.0f} "
        f"MiB ({peaks[8] / peaks[2]:.2f}x at 4x the batch)"
    )


if __name__ == "__main__":
    main()
