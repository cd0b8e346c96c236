"""Evaluation benchmarks, side by side on the same model, images and maps (Grad-CAM at
ResNet-18's layer4, upsampled: smooth maps, like the ones ROAD's masks are made from):

- deletion + insertion (20 steps each) against their floor — the same number of images
  (2 × 21 per sample) through the model in the same forward passes, built beforehand — and
  deletion alone against Quantus's `PixelFlipping` with the same 20 steps: a (N, 1, H, W)
  map on RGB images is a ranking of 3·H·W channel-pixels there, so features_in_step (which
  must divide H·W) is chosen to give it 21 forward passes, and hookrun as many (its default
  of 1 would run 150,528 of them per image at 224 px);
- ROAD (MoRF + LeRF, 9 fractions) against pytorch-grad-cam's `ROADCombined` (its forward of
  the unperturbed batch per threshold, one spsolve per image per threshold).

    python tests/benchmarks/evaluation.py [--size 224] [--batch 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import math
import zlib

import torch
import torchvision
from loops import compare  # this folder: run as a script, it is first on sys.path

from hookrun.stages.derive.gradients import rows_per_pass
from hookrun.stages.evaluate.registry import FAITHFULNESS_METRICS, EvalBatch
from hookrun.stages.evaluate.relevance import pixel_relevance

__all__ = ["evaluation_rows"]


def grad_cam_maps(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 7, 7) Grad-CAM at layer4 for the predicted class, and that class, by autograd."""
    store = {}
    handle = model.layer4.register_forward_hook(lambda m, a, out: store.update(a=out))
    try:
        logits = model(x)
    finally:
        handle.remove()
    target = logits.argmax(1)
    (grad,) = torch.autograd.grad(logits.gather(1, target[:, None]).sum(), store["a"])
    cam = torch.relu((grad.mean((2, 3), keepdim=True) * store["a"]).sum(1))
    return cam.detach(), target


def _batch(model, x, target, relevance) -> EvalBatch:
    return EvalBatch(
        inputs=x,
        targets=target,
        logits=model,
        generator=lambda name: torch.Generator().manual_seed(zlib.crc32(name.encode())),
        rows_per_pass=rows_per_pass(None, x),
        relevance={"cam": relevance},
    )


def _metric(name: str, model, x, target, relevance, **args):
    metric = FAITHFULNESS_METRICS.get(name, "bench")
    parsed = metric.Args(**args)
    return lambda: metric.evaluate(parsed, _batch(model, x, target, relevance), "cam")


def _floor(model, x: torch.Tensor, images: int):
    """`images` images through the model in passes of the size hookrun's metrics use."""
    rows = rows_per_pass(None, x)
    built = [torch.randn(min(rows, images - s), *x.shape[1:]) for s in range(0, images, rows)]

    def run() -> None:
        with torch.inference_mode():
            for chunk in built:
                torch.softmax(model(chunk), 1)

    return run


def quantus_step(pixels: int, forwards: int) -> int:
    """Quantus's features_in_step: it must divide H·W, and 3·H·W / it is its forward passes;
    the divisor that gives the number closest to `forwards`."""
    divisors = [d for d in range(1, pixels + 1) if pixels % d == 0]
    return min(divisors, key=lambda d: abs(math.ceil(3 * pixels / d) - forwards))


def _quantus(model, x, target, relevance, step: int):
    import quantus

    metric = quantus.PixelFlipping(
        features_in_step=step,
        perturb_baseline="black",
        normalise=False,
        disable_warnings=True,
        display_progressbar=False,
    )
    xs, ys = x.numpy(), target.numpy()
    maps = relevance[:, None].numpy()

    def run() -> None:
        metric(model=model, x_batch=xs, y_batch=ys, a_batch=maps, device="cpu", softmax=True)

    return run


def _grad_cam_road(model, x, target, relevance):
    from pytorch_grad_cam.metrics.road import ROADCombined
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputSoftmaxTarget

    road = ROADCombined(percentiles=[10, 20, 30, 40, 50, 60, 70, 80, 90])
    targets = [ClassifierOutputSoftmaxTarget(int(t)) for t in target]
    maps = relevance.numpy()
    return lambda: road(x, maps, targets, model)


def evaluation_rows(size: int, batch: int, reps: int) -> list[tuple[str, str, str, str]]:
    """The benchmark table's rows (comparison, ratio, goal, absolute)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(batch, 3, size, size)
    maps, target = grad_cam_maps(model, x)
    relevance = pixel_relevance(maps, (size, size), "abs_sum")
    for p in model.parameters():
        p.requires_grad_(False)
    steps = 20
    step = quantus_step(size * size, steps + 1)
    flips = math.ceil(3 * size * size / step)  # Quantus's forward passes; hookrun's: steps + 1
    rows = []
    t = compare(
        {
            "curves": lambda: (
                _metric("deletion", model, x, target, relevance, steps=steps)(),
                _metric("insertion", model, x, target, relevance, steps=steps)(),
            ),
            "floor": _floor(model, x, 2 * (steps + 1) * batch),
            "deletion": _metric("deletion", model, x, target, relevance, steps=flips - 1),
            "quantus": _quantus(model, x, target, relevance, step),
        },
        reps,
        torch.device("cpu"),
    )
    rows.append(
        (
            f"deletion + insertion ({steps} steps each) / their floor: the same "
            f"{2 * (steps + 1)} images per sample through the model",
            f"{t['curves'] / t['floor']:.2f}×",
            "≤ 1.25×",
            f"{batch / t['curves']:.1f} img/s",
        )
    )
    rows.append(
        (
            f"deletion: Quantus PixelFlipping seconds / hookrun seconds ({flips} forward "
            f"passes each: hookrun steps={flips - 1}, Quantus features_in_step={step} "
            "channel-pixels)",
            f"{t['quantus'] / t['deletion']:.2f}×",
            "> 1×",
            f"{t['deletion']:.2f} s vs {t['quantus']:.2f} s",
        )
    )
    r = compare(
        {
            "hookrun": _metric("road", model, x, target, relevance),
            "grad-cam": _grad_cam_road(model, x, target, relevance),
        },
        reps,
        torch.device("cpu"),
    )
    rows.append(
        (
            "ROAD (MoRF + LeRF, 9 fractions): hookrun throughput / pytorch-grad-cam ROADCombined",
            f"{r['grad-cam'] / r['hookrun']:.2f}×",
            "≥ 2×",
            f"{batch / r['hookrun']:.2f} vs {batch / r['grad-cam']:.2f} img/s",
        )
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    for row in evaluation_rows(args.size, args.batch, args.reps):
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
