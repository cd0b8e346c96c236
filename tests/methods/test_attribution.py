"""Integrated gradients against Captum's IntegratedGradients, SmoothGrad against plain
autograd (sigma=0) and a Monte-Carlo average written here with the same seeded noise —
resnet18 with random weights saved to a file, three 32 px images in batches of two."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from captum.attr import IntegratedGradients
from conftest import resnet18_file, run_config
from torchvision.transforms.functional import gaussian_blur

from hookrun.errors import HookrunError

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    """(model, overrides) for resnet18 with seeded random weights, loaded without hookrun."""
    return resnet18_file(tmp_path_factory.mktemp("weights"), seed=3)


def run(tmp_path, overrides: list[str], name: str) -> dict[str, np.ndarray]:
    from conftest import read

    result = run_config(tmp_path, [f"experiment={name}", *overrides], experiment=name)
    return read(result.path)


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def captum_baseline(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "zeros":
        return torch.zeros_like(x)
    if name == "mean":
        return x.mean(dim=(2, 3), keepdim=True).expand_as(x)
    if name == "blur":  # hookrun's documented blur: sigma = 0.1 x the smaller side, 3 sigma wide
        sigma = 0.1 * 32
        return gaussian_blur(x, [2 * math.ceil(3 * sigma) + 1] * 2, [sigma, sigma])
    return torch.full_like(x, float(name))


@pytest.mark.parametrize(
    "method,baseline",
    [
        ("gausslegendre", "zeros"),
        ("riemann_trapezoid", "blur"),
        ("riemann_left", "mean"),
        ("riemann_middle", "0.5"),
        ("riemann_right", "zeros"),
    ],
)
def test_integrated_gradients_equal_captum(resnet, tmp_path, method, baseline):
    model, overrides = resnet
    args = [
        f"derive.integrated_gradients.method={method}",
        f"derive.integrated_gradients.baseline={baseline}",
        "derive.integrated_gradients.steps=16",
        # 5 rows per pass: passes cut across steps and samples, and steps x batch never fits.
        "derive.integrated_gradients.internal_batch_size=5",
    ]
    data = run(tmp_path, [*overrides, *args], "integrated_gradients")
    x = torch.from_numpy(data["captures/input/output"])
    target = torch.from_numpy(data["samples/target"])
    np.testing.assert_array_equal(target.numpy(), model(x).argmax(1).numpy())
    expected, delta = IntegratedGradients(model).attribute(
        x,
        baselines=captum_baseline(baseline, x),
        target=target,
        n_steps=16,
        method=method,
        return_convergence_delta=True,
    )
    got = data["derived/integrated_gradients/input"]
    assert got.shape == (3, 3, 32, 32)
    error = relative_error(got, expected.detach().numpy())
    print(f"IG {method}/{baseline}: max error relative to Captum {error:.2e}")
    assert error < 2e-3
    # The completeness gap is Captum's convergence delta (same definition, same sign).
    gap = data["derived/integrated_gradients/input.completeness_gap"]
    assert gap.shape == (3,)
    scale = float(expected.detach().flatten(1).sum(1).abs().max())
    np.testing.assert_allclose(gap, delta.detach().numpy(), rtol=0, atol=2e-3 * scale)


def plain_gradient(model, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    model(x).gather(1, target[:, None]).sum().backward()
    return x.grad


def monte_carlo_smoothgrad(model, x, target, args: dict, rows_per_call: int):
    """SmoothGrad by hand: per batch of 2 (the run's batches), the generator hookrun
    documents — seed 0 · 1000003 + crc32('smoothgrad|input|<first row>') — draw s one randn
    of the batch's shape, gradients (or their squares) averaged over the draws. Draws go
    through the model max(1, rows_per_call // batch) at a time, as internal_batch_size says
    hookrun does: a random-weight resnet's gradient changes in the 3rd digit with the batch
    it is computed in (float rounding near ReLU kinks), so the reference batches alike."""
    samples, sigma, squared = args["samples"], args["sigma"], args["squared"]
    out = []
    for start in range(0, len(x), 2):
        xb, tb = x[start : start + 2], target[start : start + 2]
        span = xb.flatten(1).max(1).values - xb.flatten(1).min(1).values
        sd = (sigma * span).view(-1, 1, 1, 1)
        salt = zlib.crc32(f"smoothgrad|input|{start}".encode())
        gen = torch.Generator().manual_seed(0 * 1_000_003 + salt)
        noisy = [xb + sd * torch.randn(xb.shape, generator=gen) for _ in range(samples)]
        per_call = max(1, rows_per_call // len(xb))
        grads = [
            plain_gradient(
                model, torch.cat(noisy[i : i + per_call]), tb.repeat(len(noisy[i : i + per_call]))
            )
            for i in range(0, samples, per_call)
        ]
        g = torch.cat(grads).view(samples, *xb.shape)
        out.append((g * g if squared else g).mean(0))
    return torch.cat(out).numpy()


@pytest.mark.parametrize("squared,rows", [(False, 1), (True, 4)])
def test_smoothgrad_is_a_seeded_monte_carlo_average(resnet, tmp_path, squared, rows):
    model, overrides = resnet
    args = {"samples": 6, "sigma": 0.2, "squared": squared, "internal_batch_size": rows}
    data = run(
        tmp_path,
        [*overrides, *(f"derive.smoothgrad.{k}={v}" for k, v in args.items())],
        "smoothgrad",
    )
    x = torch.from_numpy(data["captures/input/output"])
    target = torch.from_numpy(data["samples/target"])
    expected = monte_carlo_smoothgrad(model, x, target, args, rows)
    got = data["derived/smoothgrad/input"]
    error = relative_error(got, expected)
    print(f"SmoothGrad squared={squared}: max error relative to the reference {error:.2e}")
    assert error < 1e-4
    # The noise did something: the result is not the plain gradient.
    plain = plain_gradient(model, x, target).numpy()
    assert relative_error(got, plain * plain if squared else plain) > 0.05


def test_smoothgrad_at_sigma_zero_is_the_plain_gradient(resnet, tmp_path):
    model, overrides = resnet
    data = run(tmp_path, [*overrides, "derive.smoothgrad.sigma=0"], "smoothgrad")
    x = torch.from_numpy(data["captures/input/output"])
    expected = plain_gradient(model, x, torch.from_numpy(data["samples/target"])).numpy()
    got = data["derived/smoothgrad/input"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def test_capture_hooks_stand_aside_during_the_methods_passes(resnet, tmp_path):
    # A clamp on every ReLU's gradient changes the run's own backward pass (guided backprop)
    # but must not touch integrated gradients' passes; the captures keep one row per sample.
    model, overrides = resnet
    extra = [
        "++hooks.guided.select.type=ReLU",
        "++hooks.guided.at=grad_input",
        "++hooks.guided.action=clamp",
        "++hooks.guided.args.min=0.0",
        "++hooks.grad.select.name=input",
        "++hooks.grad.at=grad_output",
        "++hooks.grad.action=capture",
        "derive.integrated_gradients.steps=4",
    ]
    data = run(tmp_path, [*overrides, *extra], "integrated_gradients")
    x = torch.from_numpy(data["captures/input/output"])
    target = torch.from_numpy(data["samples/target"])
    expected = IntegratedGradients(model).attribute(x, target=target, n_steps=4)
    assert relative_error(data["derived/integrated_gradients/input"], expected.numpy()) < 2e-3
    plain = plain_gradient(model, x, target).numpy()
    assert relative_error(data["captures/input/grad_output"], plain) > 0.05  # clamp acted
    assert data["captures/input/grad_output"].shape == (3, 3, 32, 32)


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "derive.integrated_gradients.method=simpson",
            r"derive.integrated_gradients.method: 'simpson'; valid: gausslegendre",
        ),
        (
            "derive.integrated_gradients.baseline=grey",
            r"derive.integrated_gradients.baseline: 'grey'; valid: zeros, mean, blur, or a "
            r"finite number from -3\.403e\+38 to 3\.403e\+38",
        ),
        (
            "derive.integrated_gradients.steps=0",
            r"derive.integrated_gradients.steps: 0 is out of range",
        ),
        (
            "derive.integrated_gradients.internal_batch_size=0",
            r"internal_batch_size: 0 is out of range",
        ),
        ("target.kind=none", r"target.kind: 'none' gives integrated_gradients nothing to explain"),
    ],
)
def test_bad_integrated_gradients_arguments_are_refused(resnet, tmp_path, override, message):
    _, overrides = resnet
    with pytest.raises(HookrunError, match=message):
        run(tmp_path, [*overrides, override], "integrated_gradients")
    assert not (tmp_path / "captures.h5").exists()


def test_bad_smoothgrad_arguments_are_refused(resnet, tmp_path):
    _, overrides = resnet
    with pytest.raises(HookrunError, match=r"derive.smoothgrad.sigma: -0.1 is negative"):
        run(tmp_path, [*overrides, "derive.smoothgrad.sigma=-0.1"], "smoothgrad")
    with pytest.raises(HookrunError, match=r"derive.smoothgrad.samples: 0 is out of range"):
        run(tmp_path, [*overrides, "derive.smoothgrad.samples=0"], "smoothgrad")


def test_function_site_hooks_stand_aside_during_integrated_gradients_passes(run_hookrun):
    """IG explains the bare model: a clamp at every functional relu (a function-level site)
    changes the run's own backward pass but none of IG's interpolation passes."""
    small = [
        "experiment=integrated_gradients",
        "model=torchvision",
        "model.name=densenet121",  # its forward ends in F.relu: a function-level site
        "dataset=fake",
        "dataset.size=2",
        "dataset.image_size=32",
        "derive.integrated_gradients.steps=4",
        "render=false",
    ]
    clamp = ["++hooks.f.select.function=relu", "++hooks.f.at=grad_input"]
    clamp += ["++hooks.f.action=clamp", "++hooks.f.args.min=0"]
    _, plain = run_hookrun(small)
    _, hooked = run_hookrun([*small, *clamp])
    key = "derived/integrated_gradients/input"
    np.testing.assert_array_equal(hooked[key], plain[key])
