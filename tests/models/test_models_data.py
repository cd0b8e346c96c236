"""Models (torchvision, seed, the user's class + checkpoint) and datasets, end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import models_for_tests as m
import numpy as np
import pytest
import torch
from conftest import hook
from PIL import Image
from torchvision import transforms

from hookrun.models.config import ModelConfig
from hookrun.models.seeds import SeedConvNet, SeedMLP
from hookrun.models.sources import build_model

ROOT = Path(__file__).resolve().parents[2]


def test_seed_models_have_the_seed_weights():
    mlp = SeedMLP()
    assert mlp.fc1.weight.tolist() == [[1, 2, 3], [-4, -5, -6], [7, 8, 9], [-10, -11, -12]]
    assert mlp(torch.ones(1, 3)).item() == 89
    assert SeedConvNet()(torch.ones(1, 1, 4, 4)).flatten().tolist() == [9, 18]


def test_random_init_is_seeded():
    a = build_model(ModelConfig(name="resnet18"), seed=5).module.fc.weight
    b = build_model(ModelConfig(name="resnet18"), seed=5).module.fc.weight
    c = build_model(ModelConfig(name="resnet18"), seed=6).module.fc.weight
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_user_class_with_checkpoint(run_hookrun, tmp_path):
    torch.manual_seed(0)
    trained = m.TwiceNet(width=4)
    with torch.no_grad():
        trained.head.bias.fill_(5.0)  # something the class's own init would not give
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": trained.state_dict(), "epoch": 3}, path)
    overrides = [
        "model=custom",
        "model._target_=models_for_tests.TwiceNet",
        "+model.kwargs.width=4",
        f"model.weights={path}",
        "dataset=constant",
        "dataset.shape=[4]",
        "dataset.value=0",
        *hook("o", "head", "output", "capture"),
    ]
    _, data = run_hookrun(overrides)
    # Zero input: fc(0) = bias, relu, fc again, relu, head → computed with the checkpoint.
    np.testing.assert_allclose(
        data["captures/head/output"], trained(torch.zeros(1, 4)).detach().numpy(), rtol=1e-6
    )
    assert data["captures/head/output"].min() > 3  # the checkpoint's bias, not a fresh init


def _photos(root: Path) -> list[Path]:
    colours = {"cat": [(250, 120, 10), (240, 100, 30)], "dog": [(20, 40, 200)]}
    paths = []
    for cls, fills in colours.items():
        (root / cls).mkdir(parents=True)
        for i, fill in enumerate(fills):
            image = Image.new("RGB", (50 + 10 * i, 40), fill)
            image.putpixel((3, 3), (255, 255, 255))
            path = root / cls / f"{i}.jpg"
            image.save(path)
            paths.append(path)
    return paths


def test_image_folder_with_transforms_labels_and_order(run_hookrun, tmp_path):
    paths = _photos(tmp_path / "photos")
    overrides = [
        "dataset=image_folder",
        f"dataset.root={tmp_path / 'photos'}",
        "dataset.resize=36",
        "dataset.crop=32",
        "batch_size=2",
        "num_workers=2",
        "model.name=resnet18",
        "+model.kwargs.num_classes=2",
        "target.kind=label",
        *hook("x", "input", "output", "capture"),
    ]
    _, data = run_hookrun(overrides)
    np.testing.assert_array_equal(data["samples/label"], [0, 0, 1])  # cat, cat, dog
    np.testing.assert_array_equal(data["samples/index"], [0, 1, 2])
    reference = transforms.Compose(
        [
            transforms.Resize(36),
            transforms.CenterCrop(32),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    for row, path in enumerate(paths):
        expected = reference(Image.open(path).convert("RGB")).numpy()
        np.testing.assert_allclose(data["captures/input/output"][row], expected, rtol=1e-6)


def test_limit_takes_the_first_samples(run_hookrun):
    _, data = run_hookrun(
        [
            "dataset.size=10",
            "dataset.image_size=32",
            "limit=3",
            *hook("x", "input", "output", "capture"),
        ]
    )
    _, full = run_hookrun(
        ["dataset.size=10", "dataset.image_size=32", *hook("x", "input", "output", "capture")]
    )
    np.testing.assert_array_equal(data["samples/index"], [0, 1, 2])
    np.testing.assert_array_equal(data["captures/input/output"], full["captures/input/output"][:3])
    assert len(data["samples/label"]) == 3


@pytest.mark.slow
def test_cli_prints_the_seed_numbers(tmp_path):
    out = tmp_path / "c.h5"
    args = [
        "model=seed_mlp",
        "dataset=constant",
        "dataset.shape=[3]",
        "dataset.size=1",
        "target.kind=sum",
        *hook("o", '"*"', "output", "capture"),
        *hook("x", "input", "grad_output", "capture"),
        f"sink.path={out}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "hookrun", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "relu1" in proc.stdout + proc.stderr  # the plan is logged
    import h5py

    with h5py.File(out) as f:
        assert f["captures/fc1/output"][()].tolist() == [[7, -13, 27, -29]]
        assert f["captures/input/grad_output"][()].tolist() == [[22, 26, 30]]
        assert f.attrs["status"] == "complete"
    assert (tmp_path / "outputs").is_dir()  # Hydra's run directory, with .hydra/ and the log
