"""Resume refuses what changes the bytes but the config cannot show: the weights file's
contents (re-hashed), an image folder's files (the number of torchrun processes: with real
shards in tests/scale/test_torchrun_faults.py). A refused resume leaves the file byte for
byte as it was."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import folder_resnet, hook, photo_folder, read, run_config
from PIL import Image

import hookrun
from hookrun.errors import HookrunError

pytestmark = pytest.mark.slow  # every test here takes over ~1.5 s

CHECKPOINT = Path(hookrun.__file__).parent / "models" / "checkpoints" / "digits_cnn.pt"


def interrupted(path: Path) -> str:
    """Make a finished file look interrupted (as a killed run leaves it); its sha256."""
    with h5py.File(path, "r+") as f:
        f.attrs["status"] = "interrupted"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_changed_weights_file_is_refused_with_both_hashes(tmp_path):
    weights = tmp_path / "digits.pt"
    shutil.copy(CHECKPOINT, weights)
    args = [
        "model=digits_cnn",
        f"model.weights={weights}",
        "dataset=digits",
        "limit=8",
        "render=false",
        *hook("c", "features", "output", "capture"),
    ]
    path = run_config(tmp_path / "run", args).path
    before = hashlib.sha256(weights.read_bytes()).hexdigest()
    state = torch.load(weights, weights_only=True)
    first = next(iter(state))
    state[first] = state[first] + 1e-3  # same shapes, same file name, other numbers
    torch.save(state, weights)
    after = hashlib.sha256(weights.read_bytes()).hexdigest()
    digest = interrupted(path)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", [*args, "resume=true"])
    message = str(err.value)
    assert message.startswith("resume refused: model.weights changed (sha256 ")
    assert f"{before[:8]}… → sha256 {after[:8]}…" in message
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def _folder(root: Path, files: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(files):
        folder = root / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")


def test_changed_image_folder_is_refused(tmp_path):
    root = tmp_path / "photos"
    _folder(root, 4)
    args = folder_resnet(root, 16, 8)
    path = run_config(tmp_path / "run", args).path
    digest = interrupted(path)
    # The same names, one picture rewritten with another size: rows would not match.
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(root / "class0" / "0.png")
    with pytest.raises(HookrunError, match=r"resume refused: dataset files \(path, size, label\)"):
        run_config(tmp_path / "run", [*args, "resume=true"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_a_file_begun_before_samples_path_resumes_without_it(tmp_path):
    """An interrupted image-folder file from a hookrun that wrote no /samples/path (its
    layout rebuilt here from a new run: the first 4 of 8 rows, every other dataset) is
    continued as it began: no new dataset half-way, the other rows the uninterrupted ones."""
    files = photo_folder(tmp_path / "photos", 8)
    args = folder_resnet(tmp_path / "photos", 16, 2)
    whole = run_config(tmp_path / "whole", args).path
    reference = read(whole)
    assert [p.decode() for p in reference["samples/path"]] == files
    old = tmp_path / "old" / "captures.h5"
    old.parent.mkdir()
    with h5py.File(whole) as src, h5py.File(old, "w", libver="latest") as dst:
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        dst.attrs["completed"], dst.attrs["status"] = 4, "interrupted"
        for key, value in reference.items():
            if key != "samples/path":
                ds = src[key]
                dst.create_dataset(
                    key, data=value[:4], maxshape=ds.maxshape, chunks=ds.chunks, fletcher32=True
                )
    run_config(tmp_path / "old", [*args, "resume=true"])
    resumed = read(old)
    assert set(resumed) == set(reference) - {"samples/path"}
    for key, value in resumed.items():
        assert value.tobytes() == reference[key].tobytes(), key
