"""sink.path=memory (issue 40): a quick look from a notebook with no file left on disk — the
run's file read back through the same `Results` reader from the bytes the result holds."""

from __future__ import annotations

import glob
import os
import tempfile

import numpy as np
import pytest
from conftest import SEED_MLP, hook, hookrun_cli, read

import hookrun
from hookrun.errors import HookrunError

RUN = [*SEED_MLP, *hook("x", "input", "grad_output", "capture"), "render=false", "progress=false"]


def _scratch() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "hookrun-memory-*")))


def test_a_file_in_memory_reads_as_the_same_file_on_disk_and_leaves_nothing(tmp_path):
    on_disk = hookrun.run(RUN, run_dir=tmp_path / "disk")
    before = _scratch()
    result = hookrun.run([*RUN, "sink.path=memory"], run_dir=tmp_path / "memory")
    assert result.path is None and isinstance(result.memory, bytes)
    assert result.summary.startswith("captures: memory (1 rows, ")
    assert not (tmp_path / "memory").exists() and _scratch() == before  # nothing on disk
    want = read(on_disk.path)
    with result.open() as res, hookrun.open(result.memory) as again:
        assert res.status == "complete" and sorted(res.keys()) == sorted(want)
        for key, value in want.items():
            np.testing.assert_array_equal(res[key][()], value, err_msg=key)
            np.testing.assert_array_equal(again[key][()], value, err_msg=key)
        # The seed MLP's input gradient (tests/seeds/README.md).
        np.testing.assert_array_equal(res["captures/input/grad_output"][0], [22, 26, 30])


@pytest.mark.slow
def test_memory_is_refused_where_a_file_on_disk_is_the_point(tmp_path):
    with pytest.raises(HookrunError, match=r"^resume: true with sink.path: memory"):
        hookrun.run([*RUN, "sink.path=memory", "resume=true"], run_dir=tmp_path)
    done = hookrun_cli([*RUN, "sink.path=memory", f"hydra.run.dir={tmp_path / 'cli'}"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("hookrun: error: sink.path: memory keeps the file in the ")
    assert not (tmp_path / "cli" / "captures.h5").exists()


def test_open_takes_the_result_a_memoryview_and_names_cut_bytes(tmp_path):
    on_disk = hookrun.run(RUN, run_dir=tmp_path / "disk")
    memory = hookrun.run([*RUN, "sink.path=memory"], run_dir=tmp_path / "memory")
    want = read(on_disk.path)["captures/input/grad_output"]
    for given in (on_disk, memory, memoryview(memory.memory)):
        with hookrun.open(given) as res:
            np.testing.assert_array_equal(res["captures/input/grad_output"][()], want)
    cut = memory.memory[: len(memory.memory) // 2]
    with pytest.raises(OSError, match=rf"^these {len(cut)} bytes are not a whole HDF5 file"):
        hookrun.open(cut)
