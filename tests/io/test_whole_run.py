"""A file that says complete holds everything its run promised, the stages' whole-run work
included (the circuits' faithfulness, the induction score, the steering vectors): real
processes killed or signalled inside that work (tests/io/finish_faults.py) leave a file that
is not complete, that verify names the stage of, and that resume=true completes computing
only what is missing, to the bytes of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import TESTS, hookrun_cli, read, run_config
from sae_folders import write_sae

import hookrun
from hookrun.io.layout import open_readonly

pytestmark = pytest.mark.slow  # every test here takes over ~1.5 s

CIRCUIT = ["experiment=circuit", "limit=4", "batch_size=2", "circuit.k=[0,3]"]
INDUCTION = ["experiment=induction", "dataset.size=4", "batch_size=2"]
STEERING = ["experiment=steering", "limit=4", "batch_size=2", "generate.max_new_tokens=2"]
QUIET = ["render=false", "progress=false"]
FAULTS = TESTS / "io" / "finish_faults.py"


def faulted(fault: str, args: list[str], cwd: Path, env: dict | None = None):
    """`python -m hookrun ARGS` with `fault` injected (tests/io/finish_faults.py)."""
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(TESTS), environ.get("PYTHONPATH", "")] if p
    )
    return subprocess.run(
        [sys.executable, str(FAULTS), fault, *args],
        cwd=cwd,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def state(path: Path) -> tuple[str, int]:
    with open_readonly(path) as f:
        return str(f.attrs["status"]), int(f.attrs["completed"])


def verified(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hookrun.verify", str(path)], capture_output=True, text=True
    )


def assert_same(path: Path, clean: dict[str, np.ndarray]) -> None:
    got = read(path)
    assert got.keys() == clean.keys()
    for key, value in clean.items():
        assert got[key].tobytes() == value.tobytes(), key


def killed_then_resumed(
    tmp_path: Path, fault: str, args: list[str], stage: str, missing: str, group: str = ""
):
    """The run killed (or signalled) by `fault` inside its whole-run work: not complete,
    verify names `missing` (and its group, `stage` unless `group` says); then resume=true
    from the CLI: complete, only the whole-run work computed again. The file's path."""
    run_dir = tmp_path / "killed"
    path = run_dir / "captures.h5"
    done = faulted(fault, [*args, *QUIET, f"hydra.run.dir={run_dir}"], tmp_path)
    if fault == "term":
        assert done.returncode == 143, done.stderr[-3000:]
        assert "interrupted by SIGTERM" in done.stderr
        assert state(path)[0] == "interrupted"
    else:
        assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
        assert state(path)[0] == "running"
    rows = state(path)[1]
    checked = verified(path)
    assert checked.returncode == 1
    said = f"{missing}: not written: the {group or stage} stage's whole-run work is not in the file"
    assert said in checked.stdout, checked.stdout
    with hookrun.open(path) as res:  # its fill value is never read as a result
        listed = res.keys()
        assert missing not in res and missing not in listed
        assert f"  {missing}: " in repr(res) and "not written yet" in repr(res)
        with pytest.raises(KeyError, match="not written yet"):
            res[missing]

    resumed = hookrun_cli([*args, *QUIET, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert f"resume: computed the whole-run results of {stage}" in said, said[-3000:]
    assert f"(0 rows computed here, {rows} in the file)" in said
    assert state(path) == ("complete", rows)
    assert verified(path).returncode == 0
    return path


@pytest.mark.parametrize("fault", ["kill-before", "kill-computed", "kill-marking", "term"])
def test_killed_inside_the_circuits_faithfulness_then_resumed_to_the_whole_file(tmp_path, fault):
    clean = read(run_config(tmp_path / "clean", [*CIRCUIT, *QUIET], "circuit").path)
    path = killed_then_resumed(tmp_path, fault, CIRCUIT, "circuit", "circuit/faithfulness")
    assert_same(path, clean)
    with h5py.File(path) as f:
        assert list(f["circuit/faithfulness"].attrs["k"]) == [0, 3]


@pytest.mark.parametrize("fault", ["kill-before", "kill-computed", "kill-marking"])
def test_killed_inside_the_sae_scores_then_resumed_to_the_whole_file(tmp_path, fault):
    """A dictionary's scores are whole-run work: killed while they are computed or marked,
    the file is not complete, verify names them, and a resume writes the same bytes."""
    write_sae(tmp_path / "sae", 128, 64)
    args = ["experiment=sae", f"hooks.sae.args.path={tmp_path / 'sae'}", "limit=4", "batch_size=2"]
    clean = read(run_config(tmp_path / "clean", [*args, *QUIET], "sae").path)
    missing = "sae/transformer.h.1/output/scores"
    path = killed_then_resumed(tmp_path, fault, args, "sae_scores", missing, "sae")
    assert_same(path, clean)


@pytest.mark.parametrize(
    ("args", "experiment", "stage", "missing"),
    [
        (INDUCTION, "induction", "induction", "induction/score"),
        (STEERING, "steering", "steering", "steering/vector/transformer.h.0/output"),
    ],
)
def test_killed_inside_each_stages_whole_run_work_then_resumed(
    tmp_path, args, experiment, stage, missing
):
    clean = read(run_config(tmp_path / "clean", [*args, *QUIET], experiment).path)
    path = killed_then_resumed(tmp_path, "kill-computed", args, stage, missing)
    assert_same(path, clean)


def test_killed_while_the_sanity_verdicts_are_written_then_resumed(tmp_path):
    """The sanity check's verdicts are what it says of every row (Stage.complete): killed
    there, the file is not complete; the resume writes them, to the uninterrupted bytes."""
    args = ["experiment=sanity_check", "model=resnet18", "model.weights=null", "dataset=fake"]
    args += ["dataset.image_size=32", "dataset.size=2", "batch_size=2", "sanity.layers=[fc]"]
    args += ["sanity.methods=[saliency]", *QUIET]
    clean = run_config(tmp_path / "clean", args, "sanity_check").path
    run_dir = tmp_path / "killed"
    done = faulted("kill-complete", [*args, f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    path = run_dir / "captures.h5"
    assert state(path) == ("running", 2)
    assert verified(path).returncode == 1
    again = hookrun_cli([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same(path, read(clean))
    with h5py.File(path) as got, h5py.File(clean) as want:
        for method in ("saliency",):
            for name in ("passed", "score"):
                assert got[f"sanity/{method}"].attrs[name] == want[f"sanity/{method}"].attrs[name]
    assert verified(path).returncode == 0


def test_a_resume_computes_only_the_whole_run_work_a_kill_left_unwritten(tmp_path):
    """Two stages with whole-run work; the process killed inside the second's: the resume
    runs the second's alone, the first's values stay as written, and both equal the sums
    of /model/output numpy makes from the file."""
    log = tmp_path / "finished.log"
    run_dir = tmp_path / "run"
    args = ["model=seed_mlp", "dataset=constant", "dataset.shape=[3]", "dataset.size=5"]
    args += [*QUIET, "batch_size=2", f"hydra.run.dir={run_dir}"]
    env = {"FINISH_LOG": str(log)}
    done = faulted("totals-kill-second", args, tmp_path, env)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert log.read_text().split() == ["first", "second"]
    path = run_dir / "captures.h5"
    assert state(path) == ("running", 5)
    with open_readonly(path) as f:
        first = f["first/total"][()]
    checked = verified(path)
    assert "second/total: not written: the second stage's" in checked.stdout
    assert "first/total" not in checked.stdout

    again = faulted("totals", [*args, "resume=true"], tmp_path, env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert log.read_text().split() == ["first", "second", "second"]
    assert "resume: computed the whole-run results of second" in again.stdout + again.stderr
    with h5py.File(path) as f:
        assert f.attrs["status"] == "complete"
        total = f["model/output"][()].astype(np.float64).sum()
        assert f["first/total"][()].tobytes() == first.tobytes()
        np.testing.assert_array_equal(f["first/total"][()], [total])
        np.testing.assert_array_equal(f["second/total"][()], [total])
    assert verified(path).returncode == 0


def test_a_damaged_whole_run_result_is_named_by_verify(tmp_path):
    """A byte of /circuit/faithfulness's stored values flipped: verify names it."""
    path = run_config(tmp_path / "run", [*CIRCUIT, *QUIET], "circuit").path
    with h5py.File(path) as f:
        info = f["circuit/faithfulness"].id.get_chunk_info(0)
    with open(path, "r+b") as raw:
        raw.seek(info.byte_offset)
        byte = raw.read(1)
        raw.seek(info.byte_offset)
        raw.write(bytes([byte[0] ^ 0xFF]))
    checked = verified(path)
    assert checked.returncode == 1
    assert "circuit/faithfulness" in checked.stdout, checked.stdout


def test_a_full_disk_during_the_whole_run_work_keeps_every_row_then_resumes(tmp_path):
    """ENOSPC on a real tmpfs filled up once every row is in: one line, exit 1, the rows
    kept; room made, resume=true writes the whole-run results (mounting needs root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        clean = read(run_config(tmp_path / "clean", [*CIRCUIT, *QUIET], "circuit").path)
        path = disk / "captures.h5"
        args = [*CIRCUIT, *QUIET, f"sink.path={path}", f"hydra.run.dir={tmp_path / 'run'}"]
        done = faulted("fill-disk", args, tmp_path)
        assert done.returncode == 1, done.stderr[-3000:]
        (line,) = [x for x in done.stderr.splitlines() if x.startswith("hookrun: ")]
        assert f"writing {path} failed: [Errno 28] No space left on device; every row" in line
        assert (
            "make room, then run again with resume=true" in line and "Traceback" not in done.stderr
        )
        assert state(path) == ("running", 4)
        assert "circuit/faithfulness: not written" in verified(path).stdout
        (disk / "filler").unlink()  # room made
        again = hookrun_cli([*args, "resume=true"], tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert_same(path, clean)
        assert verified(path).returncode == 0
    finally:
        subprocess.run(["umount", str(disk)])
