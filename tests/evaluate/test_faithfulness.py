"""Deletion, insertion and ROAD against a straightforward implementation written here from
the definitions (issue 18 / README "Is the map right?"): resnet18 with random weights from a
file (32 px) and the ImageNet MobileNetV2 on the three photos (96 px: a 3 × 3 Grad-CAM),
for a Grad-CAM map and the input gradient; the imputer against a dense solve."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla
import torch
import torch.nn.functional as F
from conftest import read, resnet18_file, run_config
from references import mobilenet
from torchvision.transforms.functional import gaussian_blur

from hookrun.stages.evaluate.impute import impute

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

GRADIENT = ["++hooks.g.select.name=input", "++hooks.g.at=grad_output", "++hooks.g.action=capture"]
# Edge neighbours 1/6, corner ones 1/12 (Rong et al.): written out, not imported.
WEIGHTS = {(dr, dc): (1 / 12 if dr and dc else 1 / 6) for dr in (-1, 0, 1) for dc in (-1, 0, 1)}
WEIGHTS.pop((0, 0))


def dense_imputation(image: np.ndarray, removed: np.ndarray) -> np.ndarray:
    """Each removed pixel = the weighted mean of its neighbours inside the image (removed
    ones unknowns too), as a dense system solved by numpy."""
    c, h, w = image.shape
    pixels = [(r, q) for r in range(h) for q in range(w) if removed[r, q]]
    where = {p: i for i, p in enumerate(pixels)}
    a, b = np.zeros((len(pixels), len(pixels))), np.zeros((len(pixels), c))
    for i, (r, q) in enumerate(pixels):
        for (dr, dc), weight in WEIGHTS.items():
            rr, qq = r + dr, q + dc
            if 0 <= rr < h and 0 <= qq < w:
                a[i, i] += weight
                if removed[rr, qq]:
                    a[i, where[(rr, qq)]] -= weight
                else:
                    b[i] += weight * image[:, rr, qq]
    out = image.copy()
    solved = np.linalg.solve(a, b)
    for i, (r, q) in enumerate(pixels):
        out[:, r, q] = solved[i]
    return out


@pytest.mark.parametrize("shape,fraction", [((3, 5, 7), 0.4), ((2, 9, 6), 0.85), ((1, 1, 4), 0.5)])
def test_the_imputer_equals_a_dense_solve(shape, fraction):
    rng = np.random.default_rng(sum(shape))
    image = rng.standard_normal(shape)
    removed = rng.random(shape[1:]) < fraction
    removed[0, 0] = True  # a corner: its weights are renormalised over 3 neighbours
    got = impute(image, removed)
    np.testing.assert_allclose(got, dense_imputation(image, removed), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(got[:, ~removed], image[:, ~removed])


def sparse_imputation(image: np.ndarray, removed: np.ndarray) -> np.ndarray:
    """The same equations by a plain loop into scipy's default spsolve (larger images)."""
    c, h, w = image.shape
    index = -np.ones((h, w), dtype=int)
    index[removed] = np.arange(removed.sum())
    rows, cols, vals, b = [], [], [], np.zeros((removed.sum(), c))
    for r, q in zip(*np.nonzero(removed), strict=True):
        i, total = index[r, q], 0.0
        for (dr, dc), weight in WEIGHTS.items():
            rr, qq = r + dr, q + dc
            if 0 <= rr < h and 0 <= qq < w:
                total += weight
                if removed[rr, qq]:
                    rows.append(i), cols.append(index[rr, qq]), vals.append(-weight)
                else:
                    b[i] += weight * image[:, rr, qq]
        rows.append(i), cols.append(i), vals.append(total)
    a = sp.csc_matrix((vals, (rows, cols)), shape=(len(b), len(b)))
    out = image.copy()
    out[:, removed] = sla.spsolve(a, b).reshape(len(b), c).T
    return out


def relevance(attribution: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """Pixel relevance: a map upsampled bilinearly (align_corners=False), an input-shaped
    attribution summed |a| over channels; (N, H·W)."""
    if attribution.ndim == 4:
        return np.abs(attribution).sum(1).reshape(len(attribution), -1)
    up = F.interpolate(torch.from_numpy(attribution)[:, None], size=hw, mode="bilinear")
    return up[:, 0].numpy().reshape(len(attribution), -1)


def probability(model, images: torch.Tensor, target: int) -> np.ndarray:
    with torch.no_grad():
        return torch.softmax(model(images), 1)[:, target].numpy()


def reference_curve(model, x, rel, target, steps, baseline, deletion=True):
    """Petsiuk et al.: at step k the round(k·H·W/steps) most relevant pixels (all channels)
    come from the baseline (deletion) or from the photo onto the baseline (insertion)."""
    c, h, w = x.shape
    base = {
        "zeros": torch.zeros_like(x),
        "blur": gaussian_blur(x[None], [11, 11], [5.0, 5.0])[0],
        "mean": x.mean(dim=(1, 2), keepdim=True).expand_as(x),
    }[baseline]
    order = np.argsort(-rel, kind="stable")
    counts = [round(k * h * w / steps) for k in range(steps + 1)]
    images = []
    for n in counts:
        img = (x if deletion else base).clone().reshape(c, -1)
        img[:, order[:n]] = (base if deletion else x).reshape(c, -1)[:, order[:n]]
        images.append(img.reshape(c, h, w))
    curve = probability(model, torch.stack(images), target)
    return curve, np.trapezoid(curve.astype(np.float64), np.array(counts) / (h * w))


def road_noise(seed: int, attribution: str, start: int, shape: tuple, blocks: int) -> list:
    """The documented draws: a CPU generator seeded by (seed, 'road|<attribution>', the
    batch's first row), one standard normal of the batch's shape per (direction, fraction)."""
    salt = zlib.crc32(f"road|{attribution}|input|{start}".encode())
    gen = torch.Generator().manual_seed(seed * 1_000_003 + salt)
    return [torch.randn(shape, generator=gen) for _ in range(blocks)]


def reference_road(model, x, rel, target, fractions, noise):
    """MoRF removes the round(r·H·W) most relevant pixels, LeRF the least relevant; imputed,
    plus noise · draw at the removed pixels; `noise(direction, j)` gives the draw."""
    c, h, w = x.shape
    order = np.argsort(-rel, kind="stable")
    scores = []
    for d, most in enumerate((True, False)):
        images = []
        for j, r in enumerate(fractions):
            n = round(r * h * w)
            gone = order[:n] if most else order[h * w - n :]
            removed = np.zeros(h * w, bool)
            removed[gone] = True
            removed = removed.reshape(h, w)
            img = torch.from_numpy(sparse_imputation(x.double().numpy(), removed))
            img += 0.01 * noise(d, j).double() * torch.from_numpy(removed)
            images.append(img.float())
        scores.append(probability(model, torch.stack(images), target))
    return scores[0], scores[1], (scores[1].mean() - scores[0].mean()) / 2


def check_against_reference(data, model, cam, batch_size, args):
    """Every evaluation dataset of the run `data` equals the reference, to 1e-5."""
    deletion, insertion, fractions = args
    x = torch.from_numpy(data["captures/input/output"])
    targets = data["samples/target"]
    hw = tuple(x.shape[-2:])
    for attribution in (cam, "captures/input/grad_output"):
        rel = relevance(data[attribution], hw)
        for i in range(len(x)):
            for metric, (steps, baseline) in (("deletion", deletion), ("insertion", insertion)):
                curve, auc = reference_curve(
                    model, x[i], rel[i], targets[i], steps, baseline, metric == "deletion"
                )
                np.testing.assert_allclose(
                    data[f"evaluate/{metric}/{attribution}"][i], curve, atol=1e-5
                )
                np.testing.assert_allclose(
                    data[f"evaluate/{metric}/{attribution}.auc"][i], auc, atol=1e-5
                )
            start = i - i % batch_size
            n = min(batch_size, len(x) - start)
            draws = road_noise(0, attribution, start, (n, *x.shape[1:]), 2 * len(fractions))
            morf, lerf, score = reference_road(
                model,
                x[i],
                rel[i],
                targets[i],
                fractions,
                lambda d, j, i=i, s=start, draws=draws: draws[d * len(fractions) + j][i - s],
            )
            np.testing.assert_allclose(
                data[f"evaluate/road_morf/{attribution}"][i], morf, atol=1e-5
            )
            np.testing.assert_allclose(
                data[f"evaluate/road_lerf/{attribution}"][i], lerf, atol=1e-5
            )
            np.testing.assert_allclose(
                data[f"evaluate/road/{attribution}.score"][i], score, atol=1e-5
            )


def evaluate_args(deletion, insertion, fractions, rows):
    return [
        "evaluate=faithfulness",
        f"evaluate.deletion.steps={deletion[0]}",
        f"evaluate.deletion.baseline={deletion[1]}",
        f"evaluate.insertion.steps={insertion[0]}",
        f"evaluate.insertion.baseline={insertion[1]}",
        f"evaluate.road.fractions=[{','.join(map(str, fractions))}]",
        f"evaluate.batch_size={rows}",  # forward passes cut across samples and steps
    ]


def test_resnet18_from_a_file_equals_the_reference(tmp_path):
    model, overrides = resnet18_file(tmp_path, seed=5)
    args = ((6, "mean"), (5, "blur"), (0.1, 0.45, 0.8))
    run = [*overrides, "experiment=grad_cam", "model.cam_layer=layer3", *GRADIENT]
    data = read(run_config(tmp_path / "run", [*run, *evaluate_args(*args, rows=7)]).path)
    assert data["evaluate/deletion/derived/grad_cam/layer3"].shape == (3, 7)
    check_against_reference(data, model, "derived/grad_cam/layer3", 2, args)


def test_mobilenet_v2_on_the_photos_equals_the_reference(tmp_path):
    args = ((4, "zeros"), (4, "blur"), (0.3, 0.7))
    run = ["experiment=grad_cam", "dataset.resize=96", "dataset.crop=96", "render=false"]
    run += ["batch_size=2", *GRADIENT]
    data = read(run_config(tmp_path, [*run, *evaluate_args(*args, rows=5)]).path)
    assert data["derived/grad_cam/features.18"].shape == (3, 3, 3)
    check_against_reference(data, mobilenet(), "derived/grad_cam/features.18", 2, args)
    # A faithful map on a trained model: deleting its pixels hurts more than inserting them.
    deletion = data["evaluate/deletion/derived/grad_cam/features.18.auc"]
    insertion = data["evaluate/insertion/derived/grad_cam/features.18.auc"]
    assert deletion.mean() < insertion.mean()
