"""torchrun under faults: the whole job killed with its shards partial, then the join lost
after every shard finished; `resume=true` finishes the shards and joins them to the
single-process bytes."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
import torch
from conftest import ONE_THREAD, folder_resnet, hook, photo_folder, read, run_config

import hookrun
from hookrun.io.layout import open_readonly

pytestmark = pytest.mark.slow  # every test here takes over ~1.5 s

TESTS = Path(__file__).resolve().parents[1]
OVERRIDES = [
    "model=resnet18",
    "model.weights=null",
    "dataset=fake",
    "dataset.size=160",
    "dataset.image_size=32",
    "batch_size=2",
    "render=false",
    "progress=false",
    *hook("c", "layer1", "output", "capture"),
    *hook("x", "input", "grad_output", "capture"),
]


def torchrun(args: list[str], cwd: Path, processes: int = 2) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS), env.get("PYTHONPATH", "")] if p)
    env.update(ONE_THREAD)  # as single_process: the same summation order, the same bits
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return subprocess.Popen(
        [*command, f"--nproc_per_node={processes}", "-m", "hookrun", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # The launcher in a group of its own. Its ranks are not in it: torchrun starts
        # each worker in a new session, so a signal to this group reaches no rank.
        start_new_session=True,
    )


def rows_of(path: Path) -> int:
    try:
        with open_readonly(path) as f:
            return int(f.attrs["completed"])
    except (OSError, KeyError):
        return 0


def single_process(folder: Path, overrides: list[str]) -> dict:
    """The single-process run's datasets, made with one thread as each torchrun process
    runs: the same summation order, the same bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return read(run_config(folder, overrides).path)
    finally:
        torch.set_num_threads(threads)


def started(args: list[str], cwd: Path, shards: list[Path], rows: int) -> subprocess.Popen:
    """A 2-process torchrun, once every shard holds at least `rows` rows."""
    job = torchrun(args, cwd)
    deadline = time.monotonic() + 240
    while min(rows_of(s) for s in shards) < rows and time.monotonic() < deadline:
        assert job.poll() is None, job.stderr.read()[-3000:]
        time.sleep(0.05)
    return job


def frozen_at(job: subprocess.Popen, shards: list[Path], rows: int) -> dict[int, int]:
    """Each rank of `job` stopped (SIGSTOP) as soon as its own shard holds at least `rows`
    rows, so no rank runs on to its last row while the test waits for the other (on a
    loaded machine one rank can get far ahead); rank → pid."""
    frozen: dict[int, int] = {}
    deadline = time.monotonic() + 240  # the start-up takes ~10 s on a quiet machine
    while len(frozen) < len(shards):
        assert job.poll() is None, job.stderr.read()[-3000:]
        seen = [rows_of(s) for s in shards]
        assert time.monotonic() < deadline, f"rows after 240 s: {seen}"
        for rank, count in enumerate(seen):
            if rank not in frozen and count >= rows:
                pid = rank_pids(job.pid)[rank]
                os.kill(pid, signal.SIGSTOP)
                frozen[rank] = pid
        time.sleep(0.05)
    return frozen


def killed(job: subprocess.Popen, ranks: dict[int, int]) -> None:
    """SIGKILL to the launcher, then to every (stopped) rank, and wait until all are gone:
    torchrun starts its workers in sessions of their own, so a signal to the launcher's
    process group reaches none of them, and they would finish and join without it."""
    os.killpg(job.pid, signal.SIGKILL)  # first, so it cannot act on its ranks' deaths
    job.wait()
    for pid in ranks.values():
        os.kill(pid, signal.SIGKILL)  # kills a stopped process too
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in ranks.values()):
        assert time.monotonic() < deadline, f"ranks {ranks} still alive 60 s after SIGKILL"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_torchrun_killed_mid_way_then_join_lost_resumes_to_the_single_bytes(tmp_path):
    single = single_process(tmp_path / "single", OVERRIDES)
    run_dir = tmp_path / "run"
    args = [*OVERRIDES, f"hydra.run.dir={run_dir}"]
    shards = [run_dir / f"captures.rank{r}-of-2.h5" for r in range(2)]

    job = torchrun(args, tmp_path)
    ranks = frozen_at(job, shards, 6)
    killed(job, ranks)  # every rank, mid-stream, and the launcher
    partial = [rows_of(s) for s in shards]
    assert all(0 < rows < 80 for rows in partial), partial
    assert not (run_dir / "captures.h5").exists()

    job = torchrun([*args, "resume=true"], tmp_path)
    assert job.wait(timeout=600) == 0, job.stderr.read()[-3000:]
    merged = run_dir / "captures.h5"
    assert read(merged).keys() == single.keys()
    for key, value in read(merged).items():
        assert value.tobytes() == single[key].tobytes(), key

    merged.unlink()  # the join lost after both shards finished
    job = torchrun([*args, "resume=true"], tmp_path)
    assert job.wait(timeout=600) == 0, job.stderr.read()[-3000:]
    with h5py.File(merged) as f:
        assert f.attrs["status"] == "complete" and f.attrs["world_size"] == 2
    for key, value in read(merged).items():
        assert value.tobytes() == single[key].tobytes(), key


def rank_pids(launcher: int) -> dict[int, int]:
    """rank → pid of each worker torchrun started (read from its RANK variable)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent != launcher:
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        for item in env:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = int(stat.parent.name)
    return out


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.h5")}


def test_one_rank_killed_resumes_to_the_single_bytes_and_another_world_size_is_refused(
    tmp_path,
):
    """SIGKILL to rank 1 alone (torchrun then stops rank 0 with SIGTERM): the rerun with
    resume=true finishes both shards and joins them to the single-process bytes, /samples/path
    included; the same killed shards resumed with 1 or 3 processes are refused, untouched."""
    files = photo_folder(tmp_path / "photos", 64)
    overrides = folder_resnet(tmp_path / "photos", 24, 2)
    overrides += hook("x", "input", "grad_output", "capture")
    single = single_process(tmp_path / "single", overrides)
    run_dir = tmp_path / "run"
    args = [*overrides, f"hydra.run.dir={run_dir}"]
    shards = [run_dir / f"captures.rank{r}-of-2.h5" for r in range(2)]

    job = started(args, tmp_path, shards, 4)
    os.kill(rank_pids(job.pid)[1], signal.SIGKILL)  # one rank, not the launcher
    assert job.wait(timeout=120) != 0
    partial = [rows_of(s) for s in shards]
    # rank 1 was killed mid-stream; rank 0 may have finished its 32 rows before torchrun
    # stopped it (seen on a loaded 2-core machine), which the resume must handle too
    assert 0 < partial[1] < 32 and 0 < partial[0] <= 32, partial
    with open_readonly(shards[1]) as f:
        assert f.attrs["status"] == "running"  # killed: no status written after the kill
    assert not (run_dir / "captures.h5").exists()

    for processes in (1, 3):
        other = tmp_path / f"run{processes}"
        shutil.copytree(run_dir, other)
        before = digest(other)
        again = [*overrides, f"hydra.run.dir={other}", "resume=true"]
        if processes == 1:
            job = subprocess.Popen(
                [sys.executable, "-m", "hookrun", *again],
                cwd=tmp_path,
                stderr=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                text=True,
            )
        else:
            job = torchrun(again, tmp_path, processes)
        _, err = job.communicate(timeout=300)
        assert job.returncode != 0
        assert not re.search(r'File ".*hookrun/', err), err[-3000:]  # torchrun's own may show
        refusal = "hookrun: error: resume refused: the number of processes changed "
        refusal += f"(2 → {processes})"
        assert err.count(refusal) == processes, err[-3000:]  # from every process
        assert digest(other) == before  # the shards untouched, no captures.h5 made

    job = torchrun([*args, "resume=true"], tmp_path)
    assert job.wait(timeout=600) == 0, job.stderr.read()[-3000:]
    merged = read(run_dir / "captures.h5")
    assert merged.keys() == single.keys()
    for key, value in merged.items():
        assert value.tobytes() == single[key].tobytes(), key
    with hookrun.open(run_dir / "captures.h5") as res:  # virtual datasets over the shards
        assert res.paths == files
    verify = [sys.executable, "-m", "hookrun.verify", str(run_dir / "captures.h5")]
    assert subprocess.run(verify, capture_output=True).returncode == 0
