"""torchrun under faults: the whole job killed with its shards partial, then the join lost
after every shard finished; `resume=true` finishes the shards and joins them to the
single-process bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import torch
from conftest import hook, read, run_config

from hookrun.io.layout import open_readonly

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


def torchrun(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS), env.get("PYTHONPATH", "")] if p)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return subprocess.Popen(
        [*command, "--nproc_per_node=2", "-m", "hookrun", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: one signal reaches every rank
    )


def rows_of(path: Path) -> int:
    try:
        with open_readonly(path) as f:
            return int(f.attrs["completed"])
    except (OSError, KeyError):
        return 0


def test_torchrun_killed_mid_way_then_join_lost_resumes_to_the_single_bytes(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun process: the same summation order, same bits
    try:
        single = read(run_config(tmp_path / "single", OVERRIDES).path)
    finally:
        torch.set_num_threads(threads)
    run_dir = tmp_path / "run"
    args = [*OVERRIDES, f"hydra.run.dir={run_dir}"]
    shards = [run_dir / f"captures.rank{r}-of-2.h5" for r in range(2)]

    job = torchrun(args, tmp_path)
    deadline = time.monotonic() + 240
    while min(rows_of(s) for s in shards) < 6 and time.monotonic() < deadline:
        assert job.poll() is None, job.stderr.read()[-3000:]
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)  # every rank at once, mid-stream
    job.wait()
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
