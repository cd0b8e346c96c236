"""Offline weights, digits, the results reader, re-rendering, TensorBoard, the summary."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import hook, read, run_config

import hookrun
from hookrun.errors import HookrunError
from hookrun.models.weights import find_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["dataset.size=3", "dataset.image_size=32"]


def test_find_checkpoint_checks_the_hash_in_the_name(tmp_path):
    payload = b"pretend weights"
    prefix = hashlib.sha256(payload).hexdigest()[:8]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    good = tmp_path / "b" / f"net-{prefix}.pth"
    good.write_bytes(payload)
    assert find_checkpoint(good.name, [str(tmp_path / "a"), str(tmp_path / "b")]) == good
    assert find_checkpoint("other-12345678.pth", [str(tmp_path / "b")]) is None
    (tmp_path / "a" / good.name).write_bytes(b"truncated")
    with pytest.raises(HookrunError, match=r"weights_path: .*a/net-.* SHA-256 prefix"):
        find_checkpoint(good.name, [str(tmp_path / "a"), str(tmp_path / "b")])


@pytest.mark.slow
def test_weights_by_name_come_from_the_search_path_offline(tmp_path, monkeypatch):
    import torch.hub

    def refuse(*args, **kwargs):
        raise AssertionError("hookrun tried to download")

    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty_torch_home"))
    # conf/config.yaml's weights_path names the folder of the offline MobileNetV2 package.
    result = run_config(
        tmp_path,
        [
            "model=mobilenet_v2",
            "model.weights=IMAGENET1K_V1",
            "dataset=samples",
            "limit=1",
            "render=false",
        ],
    )
    data = read(result.path)
    assert data["samples/target"][0] in range(281, 286)  # a cat


def test_missing_weights_say_which_file_goes_where(tmp_path, monkeypatch):
    import torch.hub

    def refuse(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    folder = tmp_path / "my_weights"
    with pytest.raises(HookrunError) as info:
        run_config(
            tmp_path,
            ["model=resnet50", "model.weights=IMAGENET1K_V2", f"weights_path=[{folder}]", *SMALL],
        )
    message = str(info.value)
    assert f"put the file at {folder}/resnet50-11ad3fa6.pth" in message
    assert "https://download.pytorch.org/models/resnet50-11ad3fa6.pth" in message


def test_digits_cnn_is_at_least_95_percent_accurate(run_hookrun):
    _, data = run_hookrun(["model=digits_cnn", "dataset=digits", "batch_size=128", "render=false"])
    assert len(data["samples/label"]) == 360
    accuracy = (data["model/output"].argmax(1) == data["samples/label"]).mean()
    assert accuracy >= 0.95


@pytest.mark.slow
def test_digits_training_script_reaches_95_percent():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import train_digits
    finally:
        sys.path.pop(0)
    _, accuracy = train_digits.train(epochs=30)
    assert accuracy >= 0.95


def test_cam_on_digits_draws_small_images_large(run_hookrun):
    result, data = run_hookrun(
        ["experiment=cam", "model=digits_cnn", "dataset=digits", "limit=4", "render_max=2"]
    )
    assert data["derived/cam/features"].shape == (4, 8, 8)
    from PIL import Image

    size = Image.open(result.images / "00000_cam_features.png").size
    assert min(size) >= 128  # 8x8 scaled up to be seen
    drawn = {p.name.split("_")[0] for p in result.images.glob("0*.png")}
    assert drawn == {"00000", "00001"}  # render_max=2 of the 4 samples


@pytest.mark.slow
def test_open_lists_layers_and_reads_lazily(run_hookrun):
    result, data = run_hookrun(
        [
            *SMALL,
            *hook("a", "layer1", "output", "capture"),
            *hook("g", "fc", "grad_output", "capture"),
        ]
    )
    with hookrun.open(result.path) as res:
        assert res.layers == {"layer1": {"output": (3, 64, 8, 8)}, "fc": {"grad_output": (3, 1000)}}
        assert isinstance(res.capture("layer1", "output"), h5py.Dataset)
        np.testing.assert_array_equal(
            res["captures/layer1/output"][1:2], data["captures/layer1/output"][1:2]
        )
        assert res.config.dataset.size == 3 and res.config.hooks.a.select.name == "layer1"
        assert res.status == "complete" and res.completed == 3
        assert "  captures/layer1/output: (3, 64, 8, 8)" in repr(res)
        # Every dataset of every group, read with plain h5py (scales that only name an axis
        # hold no data and are left out), listed by the key that opens it.
        with h5py.File(result.path) as f:
            stored = []
            f.visititems(lambda n, o: stored.append(n) if isinstance(o, h5py.Dataset) else None)
            data_paths = [n for n in stored if "netCDF" not in str(f[n].attrs.get("NAME", ""))]
        listed = [line.split(":")[0].strip() for line in repr(res).splitlines()[1:]]
        assert sorted(listed) == sorted(data_paths) == sorted(res.keys())
        for name in listed:
            assert res[name].shape == data[name].shape, name
        # A key without its group is named with the one that opens it.
        with pytest.raises(KeyError, match=r"did you mean 'captures/layer1/output'"):
            res["layer1/output"]


@pytest.mark.slow
def test_render_cli_redraws_an_old_run(run_hookrun, tmp_path):
    result, _ = run_hookrun(
        [
            "experiment=grad_cam",
            "model=resnet18",
            "model.weights=null",
            "dataset=fake",
            *SMALL,
            "render=false",
        ]
    )
    assert result.images is None
    out = tmp_path / "again"
    proc = subprocess.run(
        [sys.executable, "-m", "hookrun.render", str(result.path), "--out", str(out), "--max", "2"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == [
        "00000_grad_cam_layer4.png",
        "00000_input.png",
        "00001_grad_cam_layer4.png",
        "00001_input.png",
        "contact_sheet.png",
    ]


def test_tensorboard_logger_writes_the_pictures_and_the_plan(run_hookrun, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result, _ = run_hookrun(
        [
            "experiment=saliency",
            "model=resnet18",
            "model.weights=null",
            "dataset=fake",
            *SMALL,
            "logger=tensorboard",
        ]
    )
    events = EventAccumulator(
        str(result.path.parent / "tensorboard"), size_guidance={"images": 0, "tensors": 0}
    )
    events.Reload()
    tags = events.Tags()
    assert len(tags["images"]) == 6  # input and saliency for 3 samples
    assert any("plan" in t for t in tags["tensors"])


@pytest.mark.slow
def test_main_command_summary_names_the_cat(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hookrun", "experiment=guided_bp", "progress=false"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    assert "sample 0: top-1 Egyptian cat" in text
    assert "pictures:" in text and "samples/s" in text
    sheets = list((tmp_path / "outputs").glob("*/*/images/guided_bp/contact_sheet.png"))
    assert len(sheets) == 1
