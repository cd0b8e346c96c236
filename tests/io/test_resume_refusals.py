"""What an adversary found a resume, `verify` or `render` let through, each refused now in one
line with the file untouched: a changed patch source, hooks reordered, a damaged chunk among
the completed rows, a second writer reaching the file through a symbolic link, files that
are not hookrun's or whose metadata is damaged, integers past 64 bits, a device as sink."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import hook, run_config

from hookrun.errors import HookrunError
from hookrun.io.lock import WriterLock
from hookrun.verify import verify

SMALL = [
    "model=resnet18",
    "model.weights=null",
    "dataset=fake",
    "dataset.image_size=32",
    "batch_size=2",
    "target.kind=none",
    "render=false",
]


def interrupted(path: Path) -> str:
    """Make a finished file look interrupted (as a stopped run leaves it); its sha256."""
    with h5py.File(path, "r+") as f:
        f.attrs["status"] = "interrupted"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_a_changed_patch_source_is_refused(tmp_path):
    capture = [*SMALL, "dataset.size=2", *hook("l", "layer1", "output", "capture")]
    source = run_config(tmp_path / "a", capture).path
    other = run_config(tmp_path / "b", [*capture, "seed=1"]).path
    patch_file = tmp_path / "patch.h5"
    shutil.copy(source, patch_file)
    args = [
        *SMALL,
        "dataset.size=4",
        *hook("p", "layer1", "output", "patch", row=0),
        f"++hooks.p.args.file={patch_file}",
        *hook("c", "fc", "output", "capture"),
    ]
    path = run_config(tmp_path / "run", args).path
    before = interrupted(path)
    shutil.copy(other, patch_file)  # same path, other rows: the continued rows would differ
    with pytest.raises(HookrunError, match="resume refused: the file hooks.p reads changed") as err:
        run_config(tmp_path / "run", [*args, "resume=true"])
    assert f"({patch_file} sha256 {digest(source)[:8]}… → " in str(err.value)
    assert digest(path) == before


@pytest.mark.slow
def test_the_same_hooks_reordered_are_refused(tmp_path):
    scale = hook("a", "layer1", "output", "scale", factor=2.0)
    add = hook("b", "layer1", "output", "add", value=1.0)
    capture = hook("c", "fc", "output", "capture")
    args = [*SMALL, "dataset.size=4"]
    path = run_config(tmp_path / "run", [*args, *scale, *add, *capture]).path
    reordered = run_config(tmp_path / "other", [*args, *add, *scale, *capture]).path
    with h5py.File(path) as f, h5py.File(reordered) as g:  # the order changes the numbers
        assert not np.array_equal(f["captures/fc/output"][:], g["captures/fc/output"][:])
    before = interrupted(path)
    with pytest.raises(HookrunError, match=r"config differs .* in hooks \(their order\)"):
        run_config(tmp_path / "run", [*args, *add, *scale, *capture, "resume=true"])
    assert digest(path) == before


@pytest.mark.slow
def test_a_damaged_chunk_among_the_completed_rows_is_refused(tmp_path):
    args = [*SMALL, "dataset.size=4", *hook("c", "layer1", "output", "capture")]
    path = run_config(tmp_path / "run", args).path
    with h5py.File(path) as f:
        offset = f["captures/layer1/output"].id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as fh:
        fh.seek(offset + 100)
        byte = fh.read(1)
        fh.seek(offset + 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    before = interrupted(path)
    with pytest.raises(HookrunError, match=r"resume refused: .* is damaged \(/captures/layer1"):
        run_config(tmp_path / "run", [*args, "resume=true"])
    assert digest(path) == before


@pytest.mark.slow
def test_a_second_writer_through_a_symbolic_link_is_refused_and_the_link_kept(tmp_path):
    args = [*SMALL, "dataset.size=4", *hook("c", "layer1", "output", "capture")]
    path = run_config(tmp_path / "run", args).path
    interrupted(path)
    link = tmp_path / "elsewhere" / "link.h5"
    link.parent.mkdir()
    link.symlink_to(path)
    resume = [*args, f"sink.path={link}", "resume=true"]
    holder = WriterLock(path)  # another writer of the real file, reached by its own name
    try:
        with pytest.raises(HookrunError, match="being written by another run"):
            run_config(tmp_path / "other", resume)
    finally:
        holder.release()
    run_config(tmp_path / "other", resume)  # once free, the link's file is continued
    assert link.is_symlink() and link.resolve() == path.resolve()
    with h5py.File(path) as f:
        assert f.attrs["status"] == "complete" and f.attrs["completed"] == 4


def _complete(tmp_path: Path) -> Path:
    return run_config(
        tmp_path, [*SMALL, "dataset.size=2", *hook("c", "layer1", "output", "capture")]
    ).path


@pytest.mark.slow
def test_verify_refuses_files_that_are_not_whole_hookrun_files(tmp_path):
    path = _complete(tmp_path / "run")
    assert verify(path)[0]
    emptied = tmp_path / "emptied.h5"
    shutil.copy(path, emptied)
    with h5py.File(emptied, "a") as f:
        for key in list(f):
            del f[key]
    ok, lines = verify(emptied)
    assert not ok and any("/samples/index: missing" in line for line in lines)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["captures/input/output"] = np.zeros((2, 3, 8, 8), "f4")
        f.attrs["status"], f.attrs["completed"] = "complete", 2
    ok, lines = verify(foreign)
    assert not ok and any("not a file hookrun wrote" in line for line in lines)
    drawn = subprocess.run(
        [sys.executable, "-m", "hookrun.render", str(foreign), "--out", str(tmp_path / "p")],
        capture_output=True,
        text=True,
    )
    assert drawn.returncode == 1 and "Traceback" not in drawn.stderr
    assert len(drawn.stderr.strip().splitlines()) == 1, drawn.stderr


@pytest.mark.parametrize("offset", [100, 600, 1900])  # all in HDF5 metadata
@pytest.mark.slow
def test_damaged_metadata_gives_one_line_from_verify_render_and_resume(tmp_path, offset):
    args = [*SMALL, "dataset.size=2", *hook("c", "layer1", "output", "capture")]
    path = run_config(tmp_path / "run", args).path
    with open(path, "r+b") as fh:
        fh.seek(offset)
        chunk = fh.read(16)
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in chunk))
    ok, lines = verify(path)  # returns, never raises
    assert not ok, lines
    for tool in (["hookrun.verify", str(path)], ["hookrun.render", str(path), "--out", "p"]):
        proc = subprocess.run(
            [sys.executable, "-m", *tool], capture_output=True, text=True, cwd=tmp_path
        )
        assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout, tool
    before = digest(path)
    with pytest.raises(HookrunError, match="resume"):
        run_config(tmp_path / "run", [*args, "resume=true"])
    assert digest(path) == before


@pytest.mark.parametrize("key", ["batch_size", "dataset.size", "dataset.num_classes", "limit"])
def test_integers_past_64_bits_are_refused_naming_the_key(tmp_path, key):
    with pytest.raises(HookrunError, match=rf"^{key}: 100000000000000000000 is out of range"):
        run_config(tmp_path, [*SMALL, "dataset.size=2", f"{key}=100000000000000000000"])
    assert not list(tmp_path.glob("*.h5"))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_a_device_as_sink_path_is_refused_even_with_overwrite(tmp_path):
    args = [*SMALL, "dataset.size=2", "sink.path=/dev/full", "sink.overwrite=true"]
    with pytest.raises(HookrunError, match="sink.path: /dev/full is not a regular file"):
        run_config(tmp_path, args)


def test_a_sink_path_ending_in_a_slash_is_refused(tmp_path):
    folder = f"{tmp_path / 'newdir'}/"
    with pytest.raises(HookrunError, match="ends with '/', which names a folder"):
        run_config(tmp_path / "run", [*SMALL, "dataset.size=2", f"sink.path={folder}"])
    assert not (tmp_path / "newdir").exists()


@pytest.mark.slow
def test_a_file_name_of_the_longest_legal_length_can_be_locked_and_written(tmp_path):
    target = tmp_path / ("c" * 250 + ".h5")  # 253 bytes: legal, but `.{name}.lock` is not
    result = run_config(tmp_path / "run", [*SMALL, "dataset.size=2", f"sink.path={target}"])
    assert result.path == target and verify(target)[0]


@pytest.mark.slow
def test_verify_and_render_name_what_the_path_is(tmp_path):
    for tool in ("hookrun.verify", "hookrun.render"):
        for arg, what in ((str(tmp_path), "not a file"), ("", "no such file")):
            proc = subprocess.run(
                [sys.executable, "-m", tool, arg], capture_output=True, text=True, cwd=tmp_path
            )
            assert proc.returncode == 2 and what in proc.stderr, (tool, arg, proc.stderr)
            assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_second_run_in_the_same_folder_keeps_the_first_runs_pictures(tmp_path):
    """Two runs in one run dir with their files at other paths: the second's pictures would
    replace the first's, so it is refused before any work unless asked to replace them."""
    base = ["experiment=saliency", "model=digits_cnn", "dataset=digits", "limit=2"]
    first = run_config(tmp_path / "run", [*base, f"sink.path={tmp_path / 'a.h5'}"])
    pictures = {p.name: p.read_bytes() for p in first.images.iterdir()}
    assert pictures
    second = [*base, "seed=1", f"sink.path={tmp_path / 'b.h5'}"]
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", second)
    assert str(err.value).startswith(f"render: {first.images} already holds the pictures")
    assert not (tmp_path / "b.h5").exists()
    assert {p.name: p.read_bytes() for p in first.images.iterdir()} == pictures
    assert run_config(tmp_path / "run", [*second, "render=false"]).path == tmp_path / "b.h5"
    replaced = run_config(tmp_path / "run", [*second, "sink.overwrite=true"])
    assert replaced.images == first.images
