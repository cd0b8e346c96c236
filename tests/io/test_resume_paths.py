"""A resumed image-folder file keeps one set of source paths: a relative dataset.root
resolved from another directory names other files than the stored rows, and is refused
before anything is written (the file stays as it was)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import h5py
import pytest
from conftest import folder_resnet, photo_folder, run_config

from hookrun.errors import HookrunError

pytestmark = pytest.mark.slow  # every test here takes over ~1.5 s


def test_a_relative_root_from_another_directory_is_refused(tmp_path, monkeypatch):
    for side in ("a", "b"):  # two identical copies of one folder
        photo_folder(tmp_path / side / "photos", 4)
    args = folder_resnet(Path("photos"), 24, 2)  # relative: resolved from the cwd
    monkeypatch.chdir(tmp_path / "a")
    path = run_config(tmp_path / "run", args).path
    with h5py.File(path, "r+") as f:  # as a run interrupted after its first batch
        f.attrs["status"], f.attrs["completed"] = "interrupted", 2
    before = hashlib.sha256(path.read_bytes()).hexdigest()

    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(HookrunError, match=r"resume refused: row 0 was read from .*/a/photos/"):
        run_config(tmp_path / "run", [*args, "resume=true"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before

    monkeypatch.chdir(tmp_path / "a")  # where it started: it continues
    resumed = run_config(tmp_path / "run", [*args, "resume=true"])
    with resumed.open() as res:
        assert res.status == "complete" and res.paths[0].startswith(str(tmp_path / "a"))
