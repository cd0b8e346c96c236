"""A catalogue of hostile inputs: each stops before any work with one HookrunError line naming
the key (and the file or value), never a traceback, never wrong numbers, never a file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hook, hookrun_cli, run_config
from PIL import Image
from torch import nn

from hookrun.errors import HookrunError

SMALL = ["dataset.size=2", "dataset.image_size=32", "model.weights=null", "render=false"]
PHOTOS = ["dataset=samples", "dataset.names=[astronaut]", "model.weights=null", "render=false"]
CONSTANT = ["dataset=constant", "dataset.shape=[4]", "dataset.size=1", "render=false"]


class RaisingNet(nn.Module):
    """A model whose forward fails on every input (importable by model._target_)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("width 4 expected, this net is broken on purpose")


def _folder(root: Path, mode: str, size: int = 16) -> Path:
    (root / "c0").mkdir(parents=True)
    if mode == "I;16":
        pixels = (np.arange(size * size).reshape(size, size) * 200).astype(np.uint16)
        Image.fromarray(pixels).save(root / "c0" / "a.png")
    else:
        Image.new(mode, (size, size)).save(root / "c0" / "a.png")
    return root


def _files(tmp: Path) -> None:
    """Hostile files, made fresh for each case (cheap: a few small files)."""
    (tmp / "empty.pt").write_bytes(b"")
    (tmp / "text.pt").write_text("not a checkpoint\n")
    torch.save({"weights": [1, 2, 3]}, tmp / "list.pt")
    (tmp / "dangling.h5").symlink_to(tmp / "nowhere" / "x.h5")
    (tmp / "adir.h5").mkdir()
    (tmp / "taken.h5").write_bytes(b"someone's earlier file")
    (tmp / "noclass").mkdir()
    (tmp / "noclass" / "a.png").write_bytes(b"")
    _folder(tmp / "deep", "I;16")
    _folder(tmp / "big", "L", size=100)
    (tmp / "broken" / "c0").mkdir(parents=True)
    (tmp / "broken" / "c0" / "a.png").write_bytes(b"\x89PNG but cut")


RESNET = ["model=resnet18", "model.weights=null", "render=false"]
FOLDER = [*RESNET, "dataset=image_folder", "dataset.resize=16", "dataset.crop=16"]

# (case id, overrides with {tmp} for the case's folder, a regex the one line must match)
CASES = [
    ("mean-nan", [*PHOTOS, "dataset.mean=[nan,0,0]"], r"^dataset\.mean: \[nan"),
    ("std-inf", [*PHOTOS, "dataset.std=[inf,1,1]"], r"^dataset\.std: \[inf"),
    (
        "std-length",
        [*PHOTOS, "dataset.std=[1,1]"],
        r"^dataset\.std: .*per channel",
    ),
    ("std-zero", [*PHOTOS, "dataset.std=[0,1,1]"], r"^dataset\.std:"),
    (
        "weights-empty",
        ["model=digits_cnn", "dataset=digits", "model.weights={tmp}/empty.pt"],
        r"^model\.weights: .*empty\.pt is not a readable",
    ),
    (
        "weights-text",
        ["model=digits_cnn", "dataset=digits", "model.weights={tmp}/text.pt"],
        r"^model\.weights: .*text\.pt is not a readable",
    ),
    (
        "weights-not-state-dict",
        ["model=digits_cnn", "dataset=digits", "model.weights={tmp}/list.pt"],
        r"^model\.weights: .*list\.pt",
    ),
    (
        "weights-missing",
        ["model=digits_cnn", "dataset=digits", "model.weights={tmp}/none.pt"],
        r"^model\.weights: .*none\.pt",
    ),
    (
        "image-16-bit",
        [*FOLDER, "dataset.root={tmp}/deep"],
        r"^dataset\.root: .*a\.png has I;16 pixels",
    ),
    (
        "image-bomb",
        [*FOLDER, "dataset.root={tmp}/big"],
        r"^dataset\.root: cannot read image .*a\.png \(.*decompression bomb",
    ),
    (
        "image-broken",
        [*FOLDER, "dataset.root={tmp}/broken"],
        r"^dataset\.root: cannot read image .*a\.png",
    ),
    (
        "folder-no-classes",
        [*FOLDER, "dataset.root={tmp}/noclass"],
        r"^dataset\.root: .*class folder",
    ),
    (
        "folder-missing",
        [*FOLDER, "dataset.root={tmp}/nothing"],
        r"^dataset\.root: .* is not a directory",
    ),
    (
        "sink-dangling-link",
        [*SMALL, "sink.path={tmp}/dangling.h5"],
        r"^sink\.path: .*dangling\.h5 is a symbolic link",
    ),
    (
        "sink-directory",
        [*SMALL, "sink.path={tmp}/adir.h5"],
        r"^sink\.path: .*adir\.h5 is a directory",
    ),
    (
        "sink-existing",
        [*SMALL, "sink.path={tmp}/taken.h5"],
        r"^sink\.path: .*taken\.h5 already exists",
    ),
    ("seed-negative", [*SMALL, "seed=-1"], r"^seed: -1 is out of range"),
    ("seed-huge", [*SMALL, "seed=99999999999999999999"], r"^seed: 99999999999999999999 is out"),
    ("custom-no-target", ["model=custom", *CONSTANT], r"^model\._target_: Missing mandatory"),
    (
        "custom-no-forward",
        ["model=custom", "model._target_=torch.nn.Module", *CONSTANT],
        r"^model: torch\.nn\.Module failed its probe .*NotImplementedError",
    ),
    (
        "custom-forward-raises",
        ["model=custom", "model._target_=test_hostile_inputs.RaisingNet", *CONSTANT],
        r"^model: .*RaisingNet failed its probe .*ValueError: width 4 expected",
    ),
    (
        "custom-not-module",
        ["model=custom", "model._target_=collections.OrderedDict", *CONSTANT],
        r"^model\._target_: .*OrderedDict",
    ),
    (
        "grad-cam-no-cam-layer",
        [
            "model=custom",
            "model._target_=models_for_tests.TwiceNet",
            "experiment=grad_cam",
            *CONSTANT,
        ],
        r"cam_layer",
    ),
    ("batch-size-zero", [*SMALL, "batch_size=0"], r"^batch_size: 0 is out of range"),
    ("limit-zero", [*SMALL, "limit=0"], r"^limit: 0 is out of range"),
    ("workers-negative", [*SMALL, "num_workers=-1"], r"^num_workers: -1 is out of range"),
    ("queue-depth-zero", [*SMALL, "sink.queue_depth=0"], r"^sink\.queue_depth: 0"),
    ("render-max-zero", [*SMALL, "render_max=0"], r"^render_max: 0"),
    ("logger-unknown", [*SMALL, "logger=wandb"], r"^logger: 'wandb'"),
    ("device-unknown", [*SMALL, "device.name=tpu"], r"^device\.name: 'tpu'"),
    ("resume-and-overwrite", [*SMALL, "resume=true", "sink.overwrite=true"], r"resume"),
    ("dataset-kind-unknown", [*SMALL, "dataset.kind=nope"], r"^dataset\.kind: 'nope'"),
    (
        "action-unknown",
        [*SMALL, *hook("h", "layer1", "output", "explode")],
        r"^hooks\.h\.action: 'explode'",
    ),
    (
        "select-matches-nothing",
        [*SMALL, *hook("h", "layer9", "output", "capture")],
        r"^hooks\.h\.select",
    ),
    (
        "noise-std-nan",
        [*SMALL, *hook("h", "layer1", "output", "noise", std="nan")],
        r"^hooks\.h\.args\.std",
    ),
    (
        "target-index-out-of-range",
        [*SMALL, "target.kind=index", "+target.index=5000"],
        r"^target\.index: 5000",
    ),
]


@pytest.mark.parametrize("overrides,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.slow
def test_hostile_input_stops_in_one_line(tmp_path, monkeypatch, overrides, pattern):
    # PIL's decompression-bomb guard, scaled down so a 100x100 picture trips it.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
    _files(tmp_path)
    args = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    run_dir = tmp_path / "run"
    with pytest.raises(HookrunError) as err:
        run_config(run_dir, args)
    message = str(err.value)
    assert "\n" not in message, message
    assert re.search(pattern, message), message
    assert not (run_dir / "captures.h5").exists(), "bad input must stop before any file"
    assert (tmp_path / "taken.h5").read_bytes() == b"someone's earlier file"


def test_catalogue_has_thirty_cases_beyond_the_issue_list():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.slow
def test_an_internal_error_is_one_line_with_the_traceback_in_the_log(tmp_path):
    """An unexpected bug (here: a model whose forward fails only after the probe, on the
    second batch) prints one line naming where the traceback went; exit 1."""
    proc = hookrun_cli(
        [
            "model=custom",
            "model._target_=models_for_tests.ExplodingNet",
            "dataset=constant",
            "dataset.shape=[4]",
            "dataset.size=4",
            "batch_size=1",
            "render=false",
            "progress=false",
            "hydra.run.dir=run",
            # A gradient site, so the batches run in gradient mode, where ExplodingNet counts.
            "++hooks.x.select.name=input",
            "++hooks.x.at=grad_output",
            "++hooks.x.action=capture",
        ],
        tmp_path,
    )
    lines = [x for x in proc.stderr.splitlines() if x.startswith("hookrun:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = lines
    assert line.startswith("hookrun: internal error: ") and "full traceback in " in line
    log = Path(line.rsplit("full traceback in ", 1)[1].split(";")[0])
    assert "Traceback" in log.read_text()


@pytest.mark.slow
def test_render_and_verify_refuse_a_file_that_is_not_hdf5(tmp_path):
    bogus = tmp_path / "captures.h5"
    bogus.write_text("not HDF5\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for tool in ("hookrun.render", "hookrun.verify"):
        proc = subprocess.run(
            [sys.executable, "-m", tool, str(bogus)], capture_output=True, text=True, env=env
        )
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "file signature not found" in proc.stderr + proc.stdout
