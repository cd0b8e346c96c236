"""One tokenization per job: a corpus is tokenized once for the two ranks of a torchrun job
and not again by a resumed run (the log says which process tokenized and which read the
run's token cache); a damaged cache is made again; `limit` reads the corpus only as far as
its rows need (a bad line past them is not read), and every row is the one the whole
corpus gives; a complete run leaves no cache behind."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import hookrun_cli, killed_after, read, run_config, torchrun
from lm_models import SENTENCES, save_lm

from hookrun.data.token_cache import FOLDER
from hookrun.errors import HookrunError

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

TOKENIZED, READ = "tokens tokenized into the token cache", "tokens read from the token cache"


def _args(tmp_path, lines: int = 60, *extra: str) -> list[str]:
    if not (tmp_path / "lm").exists():
        save_lm(tmp_path / "lm", "gpt2")
    words = " ".join(SENTENCES).split()
    text = [" ".join((words * 2)[(i * 5) % len(words) :][:12]) for i in range(lines)]
    (tmp_path / "corpus.txt").write_text("\n".join(text) + "\n", encoding="utf-8")
    return [
        "experiment=lm_cache",
        "model=hf",
        f"model.path={tmp_path / 'lm'}",
        f"dataset.path={tmp_path / 'corpus.txt'}",
        "dataset.context=8",
        "batch_size=2",
        "render=false",
        "progress=false",
        *extra,
    ]


@pytest.mark.slow
def test_two_torchrun_ranks_tokenize_once(tmp_path):
    args = _args(tmp_path)
    single = read(run_config(tmp_path / "single", args).path)
    job = torchrun([*args, f"hydra.run.dir={tmp_path / 'sharded'}"], tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    said = job.stdout + job.stderr
    assert said.count(TOKENIZED) == 1 and said.count(READ) == 1, said[-3000:]
    joined = read(tmp_path / "sharded" / "captures.h5")
    for key in single:
        np.testing.assert_array_equal(joined[key], single[key], err_msg=key)
    assert not (tmp_path / "sharded" / FOLDER).exists()  # complete: the cache is gone


@pytest.mark.slow
def test_a_resumed_run_reads_the_tokens_of_the_killed_one(tmp_path):
    args = _args(tmp_path, 300)
    reference = read(run_config(tmp_path / "reference", args).path)
    run_dir = tmp_path / "killed"
    killed_after(args, tmp_path, run_dir, 4)
    assert [p.name for p in (run_dir / FOLDER).iterdir() if p.is_dir()]  # kept for the resume
    resumed = hookrun_cli([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = resumed.stdout + resumed.stderr
    assert READ in said and TOKENIZED not in said, said[-2000:]
    got = read(run_dir / "captures.h5")
    for key in reference:
        assert got[key].tobytes() == reference[key].tobytes(), key


def test_a_damaged_cache_is_made_again(tmp_path, caplog):
    args = _args(tmp_path)
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="hookrun"):
        run_config(run_dir, [*args, "dry_run=true"])  # tokenizes, keeps the cache
    assert TOKENIZED in caplog.text
    (home,) = [p for p in (run_dir / FOLDER).iterdir() if p.is_dir()]
    ids = home / "ids.int32"
    ids.write_bytes(ids.read_bytes()[:-4])  # cut short
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hookrun"):
        again = run_config(run_dir, args)
    assert "is damaged; tokenizing again" in caplog.text and TOKENIZED in caplog.text
    whole = read(run_config(tmp_path / "fresh", args).path)
    for key, values in read(again.path).items():
        np.testing.assert_array_equal(values, whole[key], err_msg=key)


@pytest.mark.parametrize("pack", [True, False])
def test_limit_reads_only_what_its_rows_need(tmp_path, pack):
    args = _args(tmp_path, 40, f"dataset.pack={str(pack).lower()}")
    whole = read(run_config(tmp_path / "whole", args).path)
    with open(tmp_path / "corpus.txt", "ab") as f:
        f.write(b"\xff\xfe not UTF-8\n")  # a bad line far past the first rows
    with pytest.raises(HookrunError):
        run_config(tmp_path / "refused", args)  # read to its end: refused
    limited = read(
        run_config(tmp_path / "limited", [*args, "limit=4"]).path
    )  # whole batches: the same sums
    for key, values in limited.items():
        if values.shape[:1] == (4,):
            np.testing.assert_array_equal(values, whole[key][:4], err_msg=key)
    assert limited["samples/tokens"].shape[0] == 4


def test_a_run_folder_without_room_for_the_cache_tokenizes_as_before(tmp_path, caplog):
    args = _args(tmp_path, 20)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / FOLDER).write_text("a file where the cache's folder would be")
    with caplog.at_level(logging.WARNING, logger="hookrun"):
        got = read(run_config(run_dir, args).path)
    assert "no token cache in" in caplog.text
    want = read(run_config(tmp_path / "fresh", args).path)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_a_cut_docs_file_is_made_again(tmp_path, caplog):
    """Found in review: a truncated docs.npz raised zipfile's own error."""
    args = _args(tmp_path, 20)
    run_dir = tmp_path / "run"
    run_config(run_dir, [*args, "dry_run=true"])
    (home,) = [p for p in (run_dir / FOLDER).iterdir() if p.is_dir()]
    docs = home / "docs.npz"
    docs.write_bytes(docs.read_bytes()[: len(docs.read_bytes()) // 2])
    with caplog.at_level(logging.INFO, logger="hookrun"):
        run_config(run_dir, args)
    assert "is damaged; tokenizing again" in caplog.text
