"""A 2 × 2 sweep (two CAM methods × two layers, jobs in their own processes) ranks its jobs
by ROAD: every number in sweep_summary.csv and sweep_ranking.csv is the mean of what that
job's captures.h5 holds, read here with h5py, and the ranking is sorted best first."""

from __future__ import annotations

import csv
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import hookrun_cli
from PIL import Image

pytestmark = pytest.mark.slow  # every test here takes over ~1.5 s

SWEEP = [
    "-m",
    "hydra/launcher=joblib",
    "hydra.launcher.n_jobs=2",
    "experiment=grad_cam,layer_cam",
    "model=resnet18",
    "model.cam_layer=layer3,layer4",
    "dataset=fake",
    "dataset.size=3",
    "dataset.image_size=32",
    "evaluate=faithfulness",
    "evaluate.deletion.steps=3",
    "evaluate.insertion.steps=3",
    "evaluate.road.fractions=[0.3,0.6]",
    "render=false",
    "progress=false",
]


def rows_of(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_two_by_two_sweep_ranks_its_jobs_by_their_files(tmp_path):
    proc = hookrun_cli(SWEEP, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    summary = rows_of(sweep / "sweep_summary.csv")
    ranking = rows_of(sweep / "sweep_ranking.csv")
    assert len(summary) == 4 and len(ranking) == 4
    expected = {}
    for job in summary:
        with h5py.File(job["file"]) as f:
            method, layer = (
                f.attrs["experiment"],
                ("layer3" if "layer3" in job["overrides"] else "layer4"),
            )
            key = f"derived/{method}/{layer}"
            for metric, suffix in (("deletion", "auc"), ("insertion", "auc"), ("road", "score")):
                mean = float(np.mean(f[f"evaluate/{metric}/{key}.{suffix}"][()].astype(np.float64)))
                assert float(job[f"{metric}:{key}"]) == mean
                expected[(job["job"], metric)] = mean
    roads = [float(r["road"]) for r in ranking]
    assert roads == sorted(roads, reverse=True)  # ROAD: higher is more faithful
    assert [r["rank"] for r in ranking] == ["1", "2", "3", "4"]
    for row in ranking:
        assert {row["method"], row["layer"]} <= {"grad_cam", "layer_cam", "layer3", "layer4"}
        for metric in ("deletion", "insertion", "road"):
            assert float(row[metric]) == expected[(row["job"], metric)]
    assert "| rank | job | method | layer |" in (sweep / "sweep_ranking.md").read_text()
    heat = np.asarray(Image.open(sweep / "sweep_ranking.png").convert("RGB"))
    assert heat.std() > 5
