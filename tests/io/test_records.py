"""Honest records: the dry run's size estimate against the real file, no reserved room left
in a finished file, and a resumed run's throughput counting only the rows it computed."""

from __future__ import annotations

import re

import h5py
from conftest import hook, run_config

from hookrun.io.storage import stored_eof

ARGS = [
    "model=resnet18",
    "model.weights=null",
    "dataset=fake",
    "dataset.size=64",
    "dataset.image_size=32",
    "batch_size=8",
    "render=false",
    *hook("c", "layer1", "output", "capture"),
]
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def test_dry_run_estimate_is_within_ten_percent_of_the_file(tmp_path, capsys):
    dry = run_config(tmp_path / "dry", [*ARGS, "dry_run=true"])
    assert "dry run: nothing written" in capsys.readouterr().out
    assert not (tmp_path / "dry" / "captures.h5").exists()
    number, unit = re.search(r"estimated file size ([\d.]+) (\w+)", dry.plan_text).groups()
    estimate = float(number) * UNITS[unit]
    path = run_config(tmp_path / "real", ARGS).path
    size = path.stat().st_size
    assert abs(estimate - size) <= 0.1 * size, (estimate, size)
    assert size == stored_eof(path), "room reserved for writing must be given back"


def test_throughput_after_resume_counts_only_the_rows_computed(tmp_path):
    path = run_config(tmp_path, ARGS).path
    with h5py.File(path, "r+") as f:  # as a run interrupted after 4 of its 8 batches
        f.attrs["status"] = "interrupted"
        f.attrs["completed"] = 32
    resumed = run_config(tmp_path, [*ARGS, "resume=true"])
    assert "(32 rows computed here, 64 in the file)" in resumed.summary
    seconds, rate = re.search(r"time: ([\d.]+) s, ([\d.]+) samples/s", resumed.summary).groups()
    # rate × time ≈ 32 rows, not 64 (the time is printed to 0.1 s: midway as the bound)
    assert float(rate) * float(seconds) < 48


def test_checksums_on_by_default_and_off_when_asked(tmp_path):
    small = ["model=seed_mlp", "dataset=constant", "dataset.shape=[3]", "dataset.size=2"]
    for flag, expected in (([], True), (["sink.checksum=false"], False)):
        path = run_config(tmp_path / str(expected), [*small, *flag, "render=false"]).path
        with h5py.File(path) as f:
            filters = [f[name].fletcher32 for name in ("model/output", "samples/index")]
        assert filters == [expected, expected]
