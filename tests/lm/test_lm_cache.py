"""experiment=lm_cache as users run it: SIGKILL mid-stream then resume=true gives the bytes of
an uninterrupted run; two torchrun processes give the single-process numbers; the dry run
says the file's size; the Activations dataset reads the capture as a token × feature matrix."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from conftest import hook, hookrun_cli, killed_after, read, run_config, torchrun
from lm_models import SENTENCES, save_lm
from PIL import Image

from hookrun.io.activations import Activations, TokenBatches
from hookrun.io.layout import read_state
from hookrun.verify import verify


def _corpus(path, lines: int):
    words = " ".join(SENTENCES).split()
    text = [
        " ".join(words[(i * 7) % len(words) :] + words[: (i * 7) % len(words)])
        for i in range(lines)
    ]
    path.write_text("\n".join(text) + "\n", encoding="utf-8")
    return path


def _args(tmp_path, lines: int, batch: int) -> list[str]:
    if not (tmp_path / "lm").exists():
        save_lm(tmp_path / "lm", "gpt2")
    corpus = _corpus(tmp_path / "corpus.txt", lines)
    return [
        "experiment=lm_cache",
        "model=hf",
        f"model.path={tmp_path / 'lm'}",
        f"dataset.path={corpus}",
        "dataset.context=16",
        f"batch_size={batch}",
        "progress=false",
    ]


@pytest.mark.slow
def test_kill_9_mid_stream_then_resume_gives_the_uninterrupted_bytes(tmp_path):
    args = _args(tmp_path, 400, 2)
    reference = run_config(tmp_path / "reference", args).path
    with h5py.File(reference) as f:
        rows = f["samples/tokens"].shape[0]
        assert f["captures/transformer.h.1/output"].dtype == np.float16
        assert f["samples/line"][0] == 1 and f["samples/path"][0].decode().endswith("corpus.txt")
    run_dir = tmp_path / "killed"
    seen = killed_after(args, tmp_path, run_dir, 6)
    assert seen < rows, "the run must be killed mid-stream"
    # The killed run's file reads as its complete rows, in order and shuffled.
    key = "captures/transformer.h.1/output"
    with h5py.File(reference) as f:
        done = read_state(run_dir / "captures.h5").completed
        want = f[key][:done].astype(np.float32).reshape(-1, f[key].shape[-1])
    in_order = torch.cat(list(TokenBatches(run_dir / "captures.h5", key, 7, shuffle=False)))
    np.testing.assert_array_equal(in_order.numpy(), want)
    shuffled = torch.cat(list(TokenBatches(run_dir / "captures.h5", key, 7, buffer=20)))
    assert sorted(map(tuple, shuffled.tolist())) == sorted(map(tuple, want.tolist()))
    proc = hookrun_cli([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed, expected = read(run_dir / "captures.h5"), read(reference)
    assert resumed.keys() == expected.keys()
    for key in expected:
        assert resumed[key].tobytes() == expected[key].tobytes(), key
    assert verify(run_dir / "captures.h5")[0]


@pytest.mark.slow
def test_two_torchrun_processes_give_the_single_process_numbers(tmp_path):
    args = _args(tmp_path, 40, 3)
    single = read(run_config(tmp_path / "single", args).path)
    job = torchrun([*args, f"hydra.run.dir={tmp_path / 'sharded'}"], tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    joined = read(tmp_path / "sharded" / "captures.h5")
    assert joined.keys() == single.keys()
    for key in single:
        np.testing.assert_array_equal(joined[key], single[key], err_msg=key)
    key = "captures/transformer.h.1/output"
    in_order = torch.cat(
        list(TokenBatches(tmp_path / "sharded" / "captures.h5", key, 64, shuffle=False))
    )
    np.testing.assert_array_equal(
        in_order.numpy(), single[key].astype(np.float32).reshape(-1, single[key].shape[-1])
    )


@pytest.mark.slow
def test_dry_run_says_the_size_and_activations_read_the_tokens_in_order(tmp_path):
    args = _args(tmp_path, 20, 4)
    dry = hookrun_cli([*args, "dry_run=true"], tmp_path)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "captures/transformer.h.1/output" in dry.stdout + dry.stderr
    result = run_config(tmp_path / "run", args)
    path = result.path
    picture = np.asarray(Image.open(result.images / "residual_norms.png").convert("RGB"))
    assert min(picture.shape[:2]) >= 200 and picture.std() > 5
    with h5py.File(path) as f:
        whole = f["captures/transformer.h.0/output"][:].astype(np.float32)
    matrix = Activations(path, "captures/transformer.h.0/output", block=3)
    assert len(matrix) == whole.shape[0] * whole.shape[1]  # packed rows: no padding
    picked = [5, 0, len(matrix) - 1, 17]
    for i in picked:
        np.testing.assert_array_equal(matrix[i].numpy(), whole.reshape(-1, whole.shape[2])[i])


def test_loader_workers_read_the_streamed_corpus_as_the_main_process_does(tmp_path):
    # The corpus's ids live in a temporary file the forked workers read by offset.
    args = _args(tmp_path, 30, 4)
    alone = read(run_config(tmp_path / "alone", args).path)
    workers = read(run_config(tmp_path / "workers", [*args, "num_workers=2"]).path)
    assert alone.keys() == workers.keys()
    for key in alone:
        np.testing.assert_array_equal(workers[key], alone[key], err_msg=key)


def test_activations_of_listed_positions_read_every_stored_position_and_no_padding(tmp_path):
    """The shipped tiny_lm on documents of several lengths, right-padded (a mask is stored):
    the blocks at positions [0, -1] (N, 2, D) beside the final norm at every token (N, T, D).
    Every stored listed position is a real token, so the matrix is the N * 2 stored vectors
    in order; the final norm's is its real tokens only, as the mask picks them with numpy."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join([*SENTENCES[:4], "x y"]) + "\n", encoding="utf-8")
    args = [
        "experiment=lm_cache",
        f"dataset.path={corpus}",
        "dataset.pack=false",
        "dataset.context=12",
        "batch_size=2",
        "render=false",
        "+hooks.resid.args.positions=[0,-1]",
        *hook("final", "transformer.ln_f", "output", "capture"),
        *hook("last", "transformer.h.1.mlp", "output", "capture"),
        "++hooks.last.args.positions=last",
    ]
    path = run_config(tmp_path, args).path
    with h5py.File(path) as f:
        mask = f["samples/mask"][()]
        listed = f["captures/transformer.h.0/output"][()].astype(np.float32)
        every = f["captures/transformer.ln_f/output"][()].astype(np.float32)
        last = f["captures/transformer.h.1.mlp/output"][()].astype(np.float32)
    rows, tokens = mask.shape
    assert listed.shape[:2] == (rows, 2) and every.shape[:2] == (rows, tokens)
    assert not mask.all() and mask.sum() > 2 * rows  # padding, and more real tokens than listed
    want = {
        "captures/transformer.h.0/output": listed.reshape(rows * 2, -1),
        "captures/transformer.ln_f/output": every[mask],
        "captures/transformer.h.1.mlp/output": last,  # (N, D): one real token per row
    }
    for key, vectors in want.items():
        for block in [None, 3]:
            matrix = Activations(path, key, block=block)
            assert len(matrix) == len(vectors), key
            got = np.stack([matrix[i].numpy() for i in range(len(matrix))])
            np.testing.assert_array_equal(got, vectors, err_msg=key)
