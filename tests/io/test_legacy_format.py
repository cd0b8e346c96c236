"""A captures.h5 written by hookrun 0.1.0 before the restructure (tests/data/legacy_grad_cam.h5:
`python -m hookrun experiment=grad_cam dataset.crop=48 dataset.resize=48 limit=2
batch_size=1`) still opens, renders and resumes: the file format did not change."""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import pytest
import torch
from conftest import dimensions_of, read, run_config

import hookrun
from hookrun.render.draw import render

LEGACY = Path(__file__).resolve().parents[1] / "data" / "legacy_grad_cam.h5"
OVERRIDES = [
    "experiment=grad_cam",
    "dataset.crop=48",
    "dataset.resize=48",
    "limit=2",
    "batch_size=1",
    "render=false",
]


def test_legacy_file_opens():
    with hookrun.open(LEGACY) as res:
        assert res.status == "complete" and res.completed == 2
        assert res.layers["features.18"] == {
            "grad_output": (2, 1280, 2, 2),
            "output": (2, 1280, 2, 2),
        }
        assert res.layers["input"] == {"output": (2, 3, 48, 48)}
        assert res.derived == {"grad_cam": {"features.18": (2, 2, 2)}}
        assert res.config.model.name == "mobilenet_v2"
        assert res.capture("features.18", "output")[:1].shape == (1, 1280, 2, 2)


def test_legacy_file_renders(tmp_path):
    written = render(LEGACY, tmp_path / "pictures", max_samples=2)
    names = sorted(p.name for p in written)
    assert "contact_sheet.png" in names
    assert "00000_grad_cam_features.18.png" in names and "00001_input.png" in names


@pytest.mark.slow
def test_legacy_file_resumes_to_the_same_rows(tmp_path):
    cut = tmp_path / "captures.h5"
    shutil.copy(LEGACY, cut)
    with h5py.File(cut, "r+") as f:  # as if the run had stopped after its first row
        f.attrs["status"] = "running"
        f.attrs["completed"] = 1
        # The format is under test, not the environment: a resume under another torch is
        # refused by design (tests/io/test_resume_sources.py), so record the one running now.
        f.attrs["torch_version"] = str(torch.__version__)
    result = run_config(tmp_path / "run", [*OVERRIDES, "resume=true", f"sink.path={cut}"])
    assert result.rows == 2
    # Row 1 recomputed now is compared with the same row computed now in one uninterrupted
    # run, not with 0.1.0's: float32 convolutions round differently across the torch
    # versions pyproject allows (up to 9e-6 between 2.14 and 2.15), and the format is under
    # test here, not the arithmetic.
    fresh = run_config(tmp_path / "fresh", [*OVERRIDES, f"sink.path={tmp_path / 'fresh.h5'}"])
    legacy, resumed, now = read(LEGACY), read(cut), read(fresh.path)
    # Continued as it began: without the named dimensions a file of today has (/sample, the
    # coordinate of its `sample` dimension, and the scales that name the other axes).
    assert legacy.keys() == resumed.keys() and now.keys() - legacy.keys() == {"sample"}
    assert all(set(axes) == {None} for axes in dimensions_of(cut).values())
    for key in legacy:
        # Row 0 is 0.1.0's, kept byte for byte; row 1 is today's, as a fresh run writes it.
        assert resumed[key][:1].tobytes() == legacy[key][:1].tobytes(), key
        assert resumed[key][1:].tobytes() == now[key][1:].tobytes(), key
    # The input and the sample records do not depend on the arithmetic: 0.1.0's bytes.
    for key in ("captures/input/output", "samples/index"):
        assert resumed[key].tobytes() == legacy[key].tobytes(), key
    with hookrun.open(cut) as res:
        assert res.status == "complete" and res.completed == 2
