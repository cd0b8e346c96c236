"""Real faults in real processes: a file-size limit (EFBIG), SIGTERM/SIGINT, a second
writer, two runs racing for one file, a cut or damaged file, a kill before the first row.
Every resumed file is compared byte for byte with an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import (
    folder_resnet,
    hook,
    killed_after,
    photo_folder,
    read,
    run_config,
    spawn,
    wait_rows,
)
from PIL import Image

import hookrun
from hookrun.errors import HookrunError
from hookrun.io.layout import open_readonly

pytestmark = pytest.mark.slow  # every test here takes over ~1.5 s

# resnet18 on 32 px noise: ~21 KiB a row, a few dozen rows a second on this machine.
RUN = [
    "model=resnet18",
    "model.weights=null",
    "dataset=fake",
    "dataset.image_size=32",
    "batch_size=2",
    *hook("c", "layer1", "output", "capture"),
    *hook("n", "layer2", "output", "noise", std=0.1),
    "progress=false",
    "render=false",
]


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def attrs(path: Path) -> dict:
    with open_readonly(path) as f:
        return dict(f.attrs)


def assert_same_bytes(path: Path, reference: dict[str, np.ndarray]) -> None:
    resumed = read(path)
    assert resumed.keys() == reference.keys()
    for key in reference:
        assert resumed[key].tobytes() == reference[key].tobytes(), key


def one_line(stderr: str) -> str:
    """The error line; nothing else on stderr may look like a traceback."""
    assert "Traceback" not in stderr and "Segmentation" not in stderr, stderr[-2000:]
    (line,) = [x for x in stderr.splitlines() if x.startswith("hookrun: ")]
    return line


@pytest.mark.slow
def test_file_size_limit_fails_cleanly_then_resumes_to_the_clean_bytes(tmp_path):
    args = [*RUN, "dataset.size=192"]
    reference = read(run_config(tmp_path / "reference", args).path)
    run_dir = tmp_path / "limited"
    path = run_dir / "captures.h5"
    # 2.5 MB: about 130 of the 192 rows fit (layer1: 16 KiB a row, in chunks of one batch).
    code, err = finish(spawn([*args, f"hydra.run.dir={run_dir}"], tmp_path, 2_500_000))
    assert code == 1, err[-2000:]
    line = one_line(err)
    assert str(path) in line and "[Errno 27] File too large" in line and "resume=true" in line
    state = attrs(path)
    assert state["status"] == "failed" and "File too large" in state["error"]
    done = int(state["completed"])
    assert 0 < done < 192
    with open_readonly(path) as f:  # `completed` never runs ahead of the rows on disk
        for key, expected in reference.items():
            np.testing.assert_array_equal(f[key][:done], expected[:done])

    code, err = finish(spawn([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path))
    assert code == 0, err[-2000:]
    assert_same_bytes(path, reference)
    assert attrs(path)["status"] == "complete"


@pytest.mark.slow
def test_a_full_disk_fails_cleanly_then_resumes_after_room_is_made(tmp_path):
    """ENOSPC on a real 3 MiB tmpfs (mounting needs root: skipped where it cannot)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); test_file_size_limit covers EFBIG")
    try:
        args = [*RUN, "dataset.size=192", f"sink.path={disk / 'captures.h5'}"]
        reference = read(run_config(tmp_path / "reference", RUN + ["dataset.size=192"]).path)
        code, err = finish(spawn([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path))
        assert code == 1 and "[Errno 28] No space left on device" in one_line(err), err[-2000:]
        assert "make room, then run again with resume=true" in one_line(err)
        state = attrs(disk / "captures.h5")
        assert state["status"] == "failed" and 0 < state["completed"] < 192
        subprocess.run(["mount", "-o", "remount,size=32m", str(disk)], check=True)  # room made
        resume = [*args, f"hydra.run.dir={tmp_path / 'run'}", "resume=true"]
        code, err = finish(spawn(resume, tmp_path))
        assert code == 0, err[-2000:]
        assert_same_bytes(disk / "captures.h5", reference)
    finally:
        subprocess.run(["umount", str(disk)])


@pytest.mark.slow
def test_an_io_error_inside_hdf5s_write_keeps_the_rows_then_resumes(tmp_path):
    """EIO from a real file system: tests/io/eio_disk.py, a FUSE disk whose writes past
    1.5 MB fail with EIO while fallocate succeeds, so the error hits HDF5's own write (the
    path storage.abandon guards), not hookrun's room check. Needs root and /dev/fuse."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("a FUSE mount needs root and /dev/fuse; the EFBIG and ENOSPC tests remain")
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("eio_disk.py")), str(disk), "1500000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if server.stdout.readline().strip() != "mounted":
        server.wait()
        pytest.skip(f"cannot mount a FUSE file system here: {server.stderr.read().strip()}")
    try:
        path = disk / "captures.h5"
        args = [*RUN, "dataset.size=192", f"sink.path={path}", f"hydra.run.dir={tmp_path / 'run'}"]
        code, err = finish(spawn(args, tmp_path))
        assert code == 1, err[-2000:]
        line = one_line(err)
        assert f"writing {path} failed: [Errno 5] Input/output error" in line
        assert "rows are kept: check the disk, then" in line  # not "make room": room is not it
        state = attrs(path)  # HDF5 failed its own write: its handle wrote nothing after that
        assert state["status"] == "running"
        done = int(state["completed"])
        assert 0 < done < 192
        reference = read(run_config(tmp_path / "reference", [*RUN, "dataset.size=192"]).path)
        with open_readonly(path) as f:  # `completed` never runs ahead of the rows on disk
            for key, expected in reference.items():
                np.testing.assert_array_equal(f[key][:done], expected[:done])
        server.send_signal(signal.SIGUSR1)  # the disk is healed (replaced)
        code, err = finish(spawn([*args, "resume=true"], tmp_path))
        assert code == 0, err[-2000:]
        assert_same_bytes(path, reference)
        assert attrs(path)["status"] == "complete"
    finally:
        subprocess.run(["umount", "-l", str(disk)])
        server.wait(timeout=30)


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.slow
def test_a_signal_stops_the_run_marks_interrupted_and_resumes(tmp_path, signum, code):
    args = [*RUN, "dataset.size=60"]
    run_dir = tmp_path / "signalled"
    path = run_dir / "captures.h5"
    proc = spawn([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    seen = wait_rows(proc, path, 6)
    proc.send_signal(signum)
    rc, err = finish(proc, 60)
    assert rc == code, err[-2000:]
    assert signal.Signals(signum).name in one_line(err)
    state = attrs(path)
    assert state["status"] == "interrupted" and signal.Signals(signum).name in state["error"]
    assert seen <= int(state["completed"]) < 60
    if signum != signal.SIGTERM:
        return  # one resume is enough to show the rows continue to the same bytes
    reference = read(run_config(tmp_path / "reference", args).path)
    rc, err = finish(spawn([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path))
    assert rc == 0, err[-2000:]
    assert_same_bytes(path, reference)


@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    args = [*RUN, "dataset.size=100"]
    run_dir = tmp_path / "run"
    first = spawn([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    try:
        assert wait_rows(first, run_dir / "captures.h5", 2) >= 2
        for extra in (["resume=true"], ["sink.overwrite=true"]):
            with pytest.raises(HookrunError, match="being written by another run") as err:
                run_config(run_dir, [*args, *extra])
            assert f"pid {first.pid} on " in str(err.value)
    finally:
        first.kill()  # SIGKILL: the kernel drops the lock with the process
        first.wait()
    resumed = run_config(run_dir, [*args, "resume=true"])
    assert attrs(resumed.path)["status"] == "complete"


@pytest.mark.slow
def test_two_runs_racing_for_one_sink_path_one_wins(tmp_path):
    target = tmp_path / "shared" / "captures.h5"
    args = [*RUN, "dataset.size=8", f"sink.path={target}"]
    procs = [spawn([*args, f"hydra.run.dir={tmp_path / name}"], tmp_path) for name in "ab"]
    results = [finish(p) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], [e[-1500:] for _, e in results]
    loser = one_line(next(e for rc, e in results if rc == 2))
    assert "being written by another run" in loser or "already exists" in loser
    assert attrs(target)["status"] == "complete" and attrs(target)["completed"] == 8


@pytest.mark.slow
def test_cut_and_damaged_files_are_refused_with_the_reason(tmp_path):
    args = [*RUN, "dataset.size=60"]
    run_dir = tmp_path / "killed"
    path = run_dir / "captures.h5"
    killed_after(args, tmp_path, run_dir, 20)
    with open_readonly(path) as f:  # cut through rows the file counts as complete
        first = f["captures/layer1/output"].id.get_chunk_info(0)
    os.truncate(path, first.byte_offset + first.size // 2)
    started = time.monotonic()
    rc, err = finish(spawn([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path))
    assert rc == 2 and "cut short" in one_line(err), err[-2000:]
    assert time.monotonic() - started < 60
    verify = subprocess.run(
        [sys.executable, "-m", "hookrun.verify", str(path)], capture_output=True, text=True
    )
    assert verify.returncode == 1 and "cut short" in verify.stdout

    # A complete file with one flipped byte inside a chunk: its checksum fails loudly.
    done = run_config(tmp_path / "done", [*RUN, "dataset.size=4"]).path
    ok = subprocess.run([sys.executable, "-m", "hookrun.verify", str(done)], capture_output=True)
    assert ok.returncode == 0
    with h5py.File(done, "r") as f:
        ds = f["captures/layer1/output"]
        assert ds.fletcher32
        offset = ds.id.get_chunk_info(0).byte_offset
    with open(done, "r+b") as fh:
        fh.seek(offset + 100)
        byte = fh.read(1)
        fh.seek(offset + 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with h5py.File(done, "r") as f, pytest.raises(OSError):
        f["captures/layer1/output"][:]
    bad = subprocess.run(
        [sys.executable, "-m", "hookrun.verify", str(done)], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "captures/layer1/output: unreadable" in bad.stdout


def stalling(flag: Path, stall_at: int) -> list[str]:
    """A run of StallingNet over 8 rows in batches of 2, its batch `stall_at` ten minutes
    long while `flag` exists."""
    return [
        "model=custom",
        "model._target_=models_for_tests.StallingNet",
        f"+model.kwargs.stall_flag={flag}",
        f"+model.kwargs.stall_at={stall_at}",
        "dataset=constant",
        "dataset.shape=[4]",
        "dataset.size=8",
        "batch_size=2",
        *hook("c", "fc", "output", "capture"),
        *hook("g", "relu", "grad_input", "capture"),
        "progress=false",
        "render=false",
    ]


def stalled(args: list[str], flag: Path, cwd: Path, run_dir: Path) -> subprocess.Popen:
    """The run started, once it is inside its stalling batch."""
    flag.touch()
    proc = spawn([*args, f"hydra.run.dir={run_dir}"], cwd)
    deadline = time.monotonic() + 120
    while flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not flag.exists() and proc.poll() is None  # inside the long batch
    return proc


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.slow
def test_stopped_during_its_first_batch_then_resumed(tmp_path, signum):
    """Killed during its first batch, a run leaves no file (it takes its name with its first
    rows); stopped by SIGTERM, a closed one any reader opens, also as SWMR readers do:
    header, `interrupted`, no rows. Either way resume=true computes every row, and no file
    made on the way is left beside it."""
    args = stalling(tmp_path / "stall", 1)
    run_dir = tmp_path / "early"
    path = run_dir / "captures.h5"
    proc = stalled(args, tmp_path / "stall", tmp_path, run_dir)
    proc.send_signal(signum)
    proc.communicate(timeout=60)
    assert proc.returncode == (-signal.SIGKILL if signum == signal.SIGKILL else 143)
    if signum == signal.SIGKILL:
        assert not path.exists()
    else:
        for swmr in (False, True):
            with h5py.File(path, "r", swmr=swmr) as f:
                assert f.attrs["status"] == "interrupted" and f.attrs["completed"] == 0
                assert "config" in f.attrs and "SIGTERM" in f.attrs["error"]
    rc, err = finish(spawn([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path))
    assert rc == 0, err[-2000:]
    assert_same_bytes(path, read(run_config(tmp_path / "clean", args).path))
    assert sorted(p.name for p in run_dir.iterdir() if p.suffix == ".h5") == ["captures.h5"]


class SignalsItself(torch.utils.data.Dataset):
    """Eight rows of width 4; reading row `at` sends this process `signum` (once)."""

    def __init__(self, signum: int | None, at: int = 5) -> None:
        self.signum, self.at = signum, at

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.at and self.signum is not None:
            os.kill(os.getpid(), self.signum)
            self.signum = None
        return torch.linspace(-1, 1, 4) * (index + 1)


def test_sigterm_in_process_stops_the_batch_and_removes_every_hook(tmp_path):
    from models_for_tests import TwiceNet

    import hookrun
    from hookrun.errors import Interrupted

    overrides = ["batch_size=2", "render=false", "progress=false"]
    overrides += hook("c", "fc", "output", "capture") + hook("g", "relu", "grad_input", "capture")
    model = TwiceNet()
    with pytest.raises(Interrupted) as err:
        hookrun.run(overrides, model=model, dataset=SignalsItself(signal.SIGTERM), run_dir=tmp_path)
    assert err.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the caller's handler is back
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not module._backward_hooks and not module._backward_pre_hooks
    state = attrs(tmp_path / "captures.h5")
    # Row 5 was being read for batch [4, 5]: that batch stops there (it is computed again on
    # resume); every batch before it is written.
    assert state["status"] == "interrupted" and state["completed"] == 4
    assert "SIGTERM" in state["error"]
    resumed = hookrun.run(
        [*overrides, "resume=true"], model=TwiceNet(), dataset=SignalsItself(None), run_dir=tmp_path
    )
    clean = hookrun.run(
        overrides, model=TwiceNet(), dataset=SignalsItself(None), run_dir=tmp_path / "clean"
    )
    assert_same_bytes(resumed.path, read(clean.path))


@pytest.mark.slow
def test_sigterm_inside_a_long_batch_ends_the_run_within_seconds_and_it_resumes(tmp_path):
    """Slurm gives 30 s between SIGTERM and SIGKILL: a batch that takes ten minutes is
    stopped where it is, the batches before it are in the file, marked interrupted, and
    resume=true gives the bytes of an uninterrupted run."""
    args = stalling(tmp_path / "stall", 3)
    run_dir = tmp_path / "run"
    path = run_dir / "captures.h5"
    proc = stalled(args, tmp_path / "stall", tmp_path, run_dir)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert took < 30, took
    assert proc.returncode == 143
    assert one_line(err) == (
        f"hookrun: error: interrupted by SIGTERM: {path} holds 4 complete rows and is marked "
        "interrupted; continue it with resume=true"
    )
    state = attrs(path)
    assert state["status"] == "interrupted" and "SIGTERM" in state["error"]
    assert state["completed"] == 4  # the two batches before it
    for swmr in (False, True):  # closed cleanly: any reader opens it
        h5py.File(path, "r", swmr=swmr).close()
    code, err = finish(spawn([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path))
    assert code == 0, err[-2000:]
    assert_same_bytes(path, read(run_config(tmp_path / "clean", args).path))


@pytest.mark.slow
def test_samples_path_holds_each_rows_file_also_after_a_kill_and_resume(tmp_path):
    files = photo_folder(tmp_path / "photos", 48)
    args = folder_resnet(tmp_path / "photos", 24, 1)
    reference = run_config(tmp_path / "reference", args)
    with h5py.File(reference.path) as f:  # plain h5py: UTF-8 strings, one per row
        assert [p.decode() for p in f["samples/path"][:]] == files
        assert f["samples/path"].dtype.itemsize == max(len(p.encode()) for p in files)
    with reference.open() as res:
        assert res.paths == files
    verified = subprocess.run(
        [sys.executable, "-m", "hookrun.verify", str(reference.path)], capture_output=True
    )
    assert verified.returncode == 0, verified.stdout

    run_dir = tmp_path / "killed"
    path = run_dir / "captures.h5"
    seen = killed_after(args, tmp_path, run_dir, 3)
    done = int(attrs(path)["completed"])
    assert seen <= done < 48
    with hookrun.open(path) as res:  # the killed file's rows name their files already
        assert res.status == "running" and res.paths == files[:done]
    code, err = finish(spawn([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path))
    assert code == 0, err[-2000:]
    assert_same_bytes(path, read(reference.path))
    with hookrun.open(path) as res:
        assert res.paths == files


def test_the_dry_run_estimate_counts_the_path_width(tmp_path):
    files = photo_folder(tmp_path / "photos", 5)
    width = max(len(p.encode()) for p in files)
    run = run_config(tmp_path / "run", [*folder_resnet(tmp_path / "photos", 24, 1), "dry_run=true"])
    # layer1 at 24 px: 64 x 6 x 6 floats; the output 1000 floats; index, label, target and
    # the /sample coordinate int64.
    per_row = (64 * 6 * 6 + 1000) * 4 + 4 * 8 + width
    assert f"source path {width} B" in run.plan_text
    # Besides, HDF5's own metadata: 12 KiB a file and 1 KiB for each of its 7 datasets.
    metadata = (12 + 7) * 1024
    assert f"estimated file size {(per_row * 5 + metadata) / 1024:.1f} KiB" in run.plan_text


# Integrated gradients with 96 steps: the derived passes take ~99% of each batch's time, so a
# kill that follows a batch landing on disk falls inside the next batch's derive.
DERIVE = [
    "experiment=integrated_gradients",
    "model=resnet18",
    "model.weights=null",
    "dataset=fake",
    "dataset.image_size=32",
    "dataset.size=10",
    "batch_size=2",
    "derive.integrated_gradients.steps=96",
    "progress=false",
    "render=false",
]


@pytest.mark.slow
def test_killed_during_derive_resumes_to_the_clean_bytes(tmp_path):
    run_dir = tmp_path / "killed"
    path = run_dir / "captures.h5"
    killed_after(DERIVE, tmp_path, run_dir, 2)
    state = attrs(path)
    assert state["status"] == "running" and 2 <= state["completed"] < 10
    with open_readonly(path) as f:  # the derived rows are there up to `completed`, no further
        assert f["derived/integrated_gradients/input"].shape[0] >= state["completed"]
    code, err = finish(spawn([*DERIVE, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path))
    assert code == 0, err[-2000:]
    clean = run_config(tmp_path / "clean", DERIVE, "integrated_gradients")
    assert_same_bytes(path, read(clean.path))


FEATURE_MAPS = [
    "experiment=feature_maps",
    "model=resnet18",
    "model.weights=null",
    "dataset=fake",
    "dataset.image_size=32",
    "dataset.size=12",
    "render_max=12",
    "progress=false",
]


@pytest.mark.slow
def test_killed_while_drawing_then_resumed_draws_only_the_missing_pictures(tmp_path):
    """Pictures are drawn from the complete file: a kill there leaves a complete, intact
    file and only whole PNGs. The requeued job's resume=true computes nothing, leaves the file
    and the pictures already there as they are, draws the missing ones and exits 0."""
    run_dir = tmp_path / "killed"
    path, images = run_dir / "captures.h5", run_dir / "images" / "feature_maps"
    proc = spawn([*FEATURE_MAPS, f"hydra.run.dir={run_dir}"], tmp_path)
    deadline = time.monotonic() + 300
    while not list(images.glob("*.png")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert attrs(path)["status"] == "complete"
    verified = subprocess.run([sys.executable, "-m", "hookrun.verify", str(path)])
    assert verified.returncode == 0
    drawn = sorted(images.glob("*.png"))
    assert len(drawn) > 0 and not (images / "contact_sheet.png").exists()
    for picture in drawn:  # every picture there is whole (written under another name first)
        Image.open(picture).load()
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in drawn}
    file_bytes = path.read_bytes()

    resumed = spawn([*FEATURE_MAPS, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert "Traceback" not in err
    added = 12 * 21 + 1 - len(drawn)
    said = "is already complete (12 rows): nothing computed, every dataset left as it was; drew"
    assert f"{said} {added} missing pictures" in out, out[-2000:]
    assert path.read_bytes() == file_bytes  # not opened for writing
    for name, (mtime, data) in before.items():  # the pictures already there are untouched
        assert (images / name).stat().st_mtime_ns == mtime
        assert (images / name).read_bytes() == data
    assert not [p for p in images.parent.iterdir() if p.name.startswith(".")]  # no scratch left
    clean = run_config(tmp_path / "clean", FEATURE_MAPS, "feature_maps")
    expected = sorted(p.name for p in clean.images.glob("*.png"))
    assert sorted(p.name for p in images.glob("*.png")) == expected
    assert len(expected) == 12 * 21 + 1  # the input and 20 conv layers per sample, the sheet
    for name in expected[:-1]:
        assert (images / name).read_bytes() == (clean.images / name).read_bytes(), name

    # Resumed again, all there: nothing drawn, still 0.
    again = spawn([*FEATURE_MAPS, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0 and f"{said} 0 missing pictures" in out, err[-2000:]
