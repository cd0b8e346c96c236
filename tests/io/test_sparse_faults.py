"""Sparse records under real faults: a writer process SIGKILLed mid-run, whose file resumes
to the bytes of an uninterrupted one in every dataset; a full disk (a real small tmpfs) that
fails a batch cleanly, keeps the rows and resumes once room is made."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import read, wait_rows
from sparse_batches import KEY, ROWS, batch, options, write

import hookrun
from hookrun.io.layout import open_readonly
from hookrun.io.stored import reopen
from hookrun.verify import verify

HERE = Path(__file__).resolve().parent
BATCHES = 60


def _same_bytes(path: Path, reference: Path) -> None:
    got, want = read(path), read(reference)
    assert got.keys() == want.keys() and f"{KEY}/latent" in got
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key


def _writer(path: Path, pause: float) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, str(HERE / "sparse_batches.py"), str(path), str(BATCHES), str(pause)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_a_writer_killed_mid_run_resumes_to_the_uninterrupted_bytes(tmp_path):
    reference = tmp_path / "reference.h5"
    write(reference, range(BATCHES)).close()
    path = tmp_path / "captures.h5"
    proc = _writer(path, 0.01)
    seen = wait_rows(proc, path, 10 * ROWS)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with open_readonly(path) as f:  # killed: still marked open by its writer
        done = int(f.attrs["completed"])
        assert f.attrs["status"] == "running"
    assert seen <= done < BATCHES * ROWS and done % ROWS == 0
    with hookrun.open(path) as res:  # the killed file reads up to `completed`
        want = np.concatenate([batch(b)[1] for b in range(done // ROWS)])
        np.testing.assert_array_equal(res[KEY][:], want)
    resumed = reopen(path, options())  # io/stored.py: the killed writer's rows copied first
    assert resumed.rows == done
    write(path, range(done // ROWS, BATCHES), resumed).close()
    _same_bytes(path, reference)
    ok, lines = verify(path)
    assert ok, lines


def _mount(disk: Path, size: str) -> bool:
    disk.mkdir(exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]
        ).returncode
        == 0
    )


@pytest.mark.slow
def test_a_full_disk_fails_a_batch_cleanly_keeps_the_rows_and_resumes(tmp_path):
    """ENOSPC on a real 2 MiB tmpfs (mounting needs root: skipped where it cannot)."""
    disk = tmp_path / "disk"
    if not _mount(disk, "2m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        path = disk / "captures.h5"
        out = write(path, range(0))
        failed_at, error = None, None
        for b in range(100_000):  # far more than 2 MiB: the disk fills on the way
            try:
                out.append(batch(b)[0])
            except OSError as err:
                assert err.errno == errno.ENOSPC
                failed_at, error = b, err
                break
        assert failed_at is not None and failed_at > 10
        out.close(error)  # refused before HDF5 wrote a byte: the file closes as `failed`
        with open_readonly(path) as f:
            assert f.attrs["status"] == "failed" and "No space left" in f.attrs["error"]
            assert int(f.attrs["completed"]) == failed_at * ROWS
        with hookrun.open(path) as res:
            want = np.concatenate([batch(b)[1] for b in range(failed_at)])
            np.testing.assert_array_equal(res[KEY][:], want)
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # room made
        total = failed_at + 10
        resumed = reopen(path, options())
        write(path, range(failed_at, total), resumed).close()
        whole = tmp_path / "whole.h5"
        write(whole, range(total)).close()
        _same_bytes(path, whole)
    finally:
        subprocess.run(["umount", str(disk)])
