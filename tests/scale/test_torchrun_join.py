"""The torchrun join kept inside the completeness promise: a join cut short leaves no
captures.h5 (it is made under another name), a captures.h5 that cannot be read beside
complete shards is joined again by the same command with resume=true, and a stage's
whole-run work killed on the joined file is computed by the resume alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
import torch
from conftest import ONE_THREAD, TESTS, hook, read, run_config

pytestmark = pytest.mark.slow  # every test here takes over ~1.5 s

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


def test_a_rank_told_to_stop_while_it_waits_for_the_others_stops(tmp_path):
    """Rank 0's shard complete, rank 1 stopped (SIGSTOP) before its own is: rank 0 waits for
    it before joining, and SIGTERM to rank 0 alone ends it within seconds (it waited in a
    blocking gloo barrier no handler interrupts, 30 minutes by default)."""
    from test_torchrun_faults import alive, rank_pids, rows_of

    run_dir = tmp_path / "run"
    args = [*IMAGES, "dataset.size=40", f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS), env.get("PYTHONPATH", "")] if p)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    job = subprocess.Popen(
        [*command, "-m", "hookrun", *args],
        cwd=tmp_path,
        env={**env, **ONE_THREAD},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    shard = run_dir / "captures.rank0-of-2.h5"
    pids: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 240
        while len(pids) < 2:
            assert time.monotonic() < deadline and job.poll() is None
            pids = rank_pids(job.pid)
            time.sleep(0.05)
        while rows_of(run_dir / "captures.rank1-of-2.h5") < 2:  # both past the start-up
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.02)
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 frozen mid-way: rank 0 will wait for it
        while not _complete(shard):
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.1)
        time.sleep(1.0)  # rank 0 in the wait by now
        os.kill(pids[0], signal.SIGTERM)
        told = time.monotonic()
        while alive(pids[0]) and time.monotonic() - told < 30:
            time.sleep(0.05)
        ended = time.monotonic() - told
        assert not alive(pids[0]) and ended < 10, f"rank 0 still alive {ended:.1f} s after SIGTERM"
    finally:
        ranks = rank_pids(job.pid) or pids
        os.killpg(job.pid, signal.SIGKILL)
        for pid in ranks.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        job.wait()
    with h5py.File(shard) as f:
        assert f.attrs["status"] == "complete"  # its rows are kept for the resume


def _complete(path: Path) -> bool:
    try:
        with h5py.File(path, "r", swmr=True) as f:
            return f.attrs["status"] == "complete"
    except (OSError, KeyError):
        return False


def test_a_joined_language_model_file_verifies_with_the_single_processs_dimensions(tmp_path):
    """A token run's vocabulary (/model/vocabulary, a whole-run dataset copied once into the
    join) kept the shard's dimension-scale references, which point into the shard: the
    joined file's dimensions could not be read (verify: "its metadata cannot be read")."""
    single(tmp_path / "single", INDUCTION, "induction")
    run_dir = tmp_path / "run"
    done = torchrun([*INDUCTION, f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    joined = run_dir / "captures.h5"
    verify = subprocess.run(
        [sys.executable, "-m", "hookrun.verify", str(joined)], capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    files = [next((tmp_path / "single").rglob("captures.h5")), joined]
    names = []
    for path in files:
        with h5py.File(path) as f:
            names.append(
                {k: [d.label for d in f[k].dims] for k in ("model/vocabulary", "model/output")}
            )
    assert names[0] == names[1]
