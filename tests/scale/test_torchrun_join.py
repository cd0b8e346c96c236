"""The torchrun join kept inside the completeness promise: a join cut short leaves no
captures.h5 (it is made under another name), a captures.h5 that cannot be read beside
complete shards is joined again by the same command with resume=true, and a stage's
whole-run work killed on the joined file is computed by the resume alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
from conftest import ONE_THREAD, TESTS, hook, read, run_config

FAULTS = TESTS / "io" / "finish_faults.py"
IMAGES = [
    "model=resnet18",
    "model.weights=null",
    "dataset=fake",
    "dataset.size=6",
    "dataset.image_size=32",
    "batch_size=2",
    "render=false",
    "progress=false",
    *hook("c", "layer1", "output", "capture"),
]
INDUCTION = ["experiment=induction", "dataset.size=4", "batch_size=2", "render=false"]
INDUCTION += ["progress=false"]


def torchrun(args: list[str], cwd: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """2 processes of `python -m hookrun ARGS` under torchrun, one thread each; with `fault`,
    each runs tests/io/finish_faults.py FAULT ARGS instead."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS), env.get("PYTHONPATH", "")] if p)
    program = [str(FAULTS), fault] if fault else ["-m", "hookrun"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return subprocess.run(
        [*command, "--nproc_per_node=2", *program, *args],
        cwd=cwd,
        env={**env, **ONE_THREAD},
        capture_output=True,
        text=True,
        timeout=600,
    )


def single(folder: Path, overrides: list[str], experiment: str | None = None) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun process: the same bits
    try:
        return read(run_config(folder, overrides, experiment).path)
    finally:
        torch.set_num_threads(threads)


def assert_same(path: Path, clean: dict) -> None:
    got = read(path)
    assert got.keys() == clean.keys()
    for key, value in clean.items():
        assert got[key].tobytes() == value.tobytes(), key


@pytest.mark.parametrize("left", ["empty", "garbage", "killed-joining"])
def test_a_join_lost_or_cut_short_is_joined_again_by_the_resume(tmp_path, left):
    clean = single(tmp_path / "single", IMAGES)
    run_dir = tmp_path / "run"
    joined = run_dir / "captures.h5"
    args = [*IMAGES, f"hydra.run.dir={run_dir}"]
    if left == "killed-joining":  # rank 0 killed half-way through writing the join
        done = torchrun(args, tmp_path, fault="kill-joining")
        assert done.returncode != 0
        assert not joined.exists()  # the half-made join never took the name
    else:
        done = torchrun(args, tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        # What a kill left while an older hookrun joined in place: a file nothing reads.
        joined.write_bytes(b"" if left == "empty" else os.urandom(3000))
    for rank in range(2):
        with h5py.File(run_dir / f"captures.rank{rank}-of-2.h5") as f:
            assert f.attrs["status"] == "complete"

    again = torchrun([*args, "resume=true"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same(joined, clean)
    with h5py.File(joined) as f:
        assert f.attrs["status"] == "complete" and f.attrs["world_size"] == 2
    assert not list(run_dir.glob(".captures.join*"))
    verify = [sys.executable, "-m", "hookrun.verify", str(joined)]
    assert subprocess.run(verify, capture_output=True).returncode == 0


def test_whole_run_work_killed_on_the_joined_file_is_computed_by_the_resume(tmp_path):
    """experiment=induction over 2 processes: rank 0 killed once the induction score is
    computed, before it is written into the join; the resume joins the shards again (no
    row copied: virtual datasets) and writes the score, to the single process's bytes."""
    clean = single(tmp_path / "single", INDUCTION, "induction")
    run_dir = tmp_path / "run"
    joined = run_dir / "captures.h5"
    args = [*INDUCTION, f"hydra.run.dir={run_dir}"]
    done = torchrun(args, tmp_path, fault="kill-computed")
    assert done.returncode != 0
    with h5py.File(joined, "r", swmr=True) as f:  # the join, rows all in, score pending
        assert f.attrs["status"] == "running" and f.attrs["completed"] == 4
        assert f["induction/score"].attrs["written"] == 0
        assert f["samples/index"].is_virtual

    again = torchrun([*args, "resume=true"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout + again.stderr
    assert "resume: computed the whole-run results of induction" in said, said[-3000:]
    assert_same(joined, clean)
    with h5py.File(joined) as f:
        assert f.attrs["status"] == "complete"
        assert f["samples/index"].is_virtual
