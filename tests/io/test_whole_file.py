"""A file replaced whole: the old one stays on any failure, nothing partial is left."""

from __future__ import annotations

from pathlib import Path

import pytest

from hookrun.io.whole_file import replaced_whole


def test_a_clean_exit_replaces_the_file(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "state.bin"
    with replaced_whole(target) as temp:
        assert temp.parent == target.parent and temp != target
        temp.write_bytes(b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["state.bin"]


def test_a_failure_midway_leaves_the_old_file_and_no_partial(tmp_path: Path) -> None:
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), replaced_whole(target) as temp:
        temp.write_bytes(b"half")
        raise KeyboardInterrupt
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]
