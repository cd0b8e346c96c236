"""TokenBatches: shuffled batches of token vectors to train on. Each epoch gives the same
multiset of vectors as the per-token reader (and as numpy's mask over the stored arrays),
several keys stay token by token together, the shuffle is seeded, a buffer smaller than the
corpus still gives every token once, DataLoader workers split the blocks, float16 and
bfloat16 files read as their numbers, and listed positions are counted by what was listed,
also when as many positions were listed as the rows have tokens."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from conftest import run_config
from lm_models import SENTENCES
from torch.utils.data import DataLoader

from hookrun.io.activations import Activations, TokenBatches
from hookrun.io.encoding import read_floats

H0, H1 = "captures/transformer.h.0/output", "captures/transformer.h.1/output"


def _run(tmp_path, *extra: str, shortest: int = 3):
    """The shipped tiny_lm on documents of several lengths (`shortest` words and more),
    right-padded to 16 tokens (a mask is stored), batches of 3."""
    corpus = tmp_path / "corpus.txt"
    words = " ".join(SENTENCES).split()
    lines = [" ".join(words[i % len(words) :][: shortest + i % 11]) for i in range(23)]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = [
        "experiment=lm_cache",
        f"dataset.path={corpus}",
        "dataset.pack=false",
        "dataset.context=16",
        "batch_size=3",
        "render=false",
        "progress=false",
        *extra,
    ]
    return run_config(tmp_path / "run", args).path


def _stored(path, key) -> np.ndarray:
    """The real tokens' vectors by numpy: the stored array under the stored mask."""
    with h5py.File(path) as f:
        values = np.asarray(read_floats(f[key]), np.float32)
        mask = f["samples/mask"][()].astype(bool) if values.ndim == 3 else None
    if mask is not None and values.shape[1] == mask.shape[1]:
        return values[mask]
    return values.reshape(-1, values.shape[-1])


def _sorted(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


def _all(batches) -> np.ndarray:
    return np.concatenate(
        [b.numpy() if torch.is_tensor(b) else torch.cat(b, 1).numpy() for b in batches]
    )


def test_an_epoch_is_the_per_token_readers_multiset_shuffled_and_seeded(tmp_path):
    path = _run(tmp_path)
    want = _stored(path, H1)
    with h5py.File(path) as f:
        assert not f["samples/mask"][()].all()  # padding to skip
    per_token = Activations(path, H1)
    assert len(per_token) == len(want)
    np.testing.assert_array_equal(np.stack([per_token[i].numpy() for i in range(len(want))]), want)

    reader = TokenBatches(path, H1, batch_size=16, buffer=40, block=2)  # buffer < corpus
    batches = list(reader)
    assert len(batches) == len(reader) == -(-len(want) // 16)
    assert all(len(b) == 16 for b in batches[:-1]) and batches[0].dtype == torch.float32
    got = _all(batches)
    np.testing.assert_array_equal(_sorted(got), _sorted(want))  # every token once
    assert not np.array_equal(got, want)  # shuffled
    np.testing.assert_array_equal(_all(TokenBatches(path, H1, 16, 40, block=2)), got)  # seeded
    other = TokenBatches(path, H1, 16, 40, block=2)
    other.set_epoch(1)
    assert not np.array_equal(_all(other), got)
    in_order = _all(TokenBatches(path, H1, 16, shuffle=False))
    np.testing.assert_array_equal(in_order, want)
    short = list(TokenBatches(path, H1, 16, 40, drop_last=True))
    assert len(short) == len(want) // 16 and all(len(b) == 16 for b in short)


def test_several_keys_stay_together_token_by_token_and_workers_split_the_blocks(tmp_path):
    path = _run(tmp_path)
    pairs = np.concatenate([_stored(path, H0), _stored(path, H1)], 1)
    reader = TokenBatches(path, [H0, H1], batch_size=8, buffer=32, block=2)
    first = next(iter(reader))
    assert isinstance(first, tuple) and [t.shape[1] for t in first] == [128, 128]
    np.testing.assert_array_equal(_sorted(_all(reader)), _sorted(pairs))
    loader = DataLoader(reader, batch_size=None, num_workers=2)
    np.testing.assert_array_equal(_sorted(_all(loader)), _sorted(pairs))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_files_read_as_their_numbers(tmp_path, dtype):
    path = _run(tmp_path, f"sink.dtype={dtype}")
    with h5py.File(path) as f:
        stored = f[H1].dtype
    assert stored == (np.float16 if dtype == "float16" else np.uint16)  # bfloat16: its bits
    want = _stored(path, H1)
    got = _all(TokenBatches(path, H1, batch_size=32))
    np.testing.assert_array_equal(_sorted(got), _sorted(want))
    assert np.isfinite(got).all() and np.abs(got).max() > 0.1


def test_listed_positions_are_every_stored_position_also_as_many_as_the_tokens(tmp_path):
    """Rows padded to 4 tokens, four positions listed ([0, 1, -2, -1]: inside every row of
    at least two tokens): (N, 4, D), every stored position a real token — though the mask,
    also (N, 4), has padding. The file's `positions` attribute tells them apart."""
    path = _run(
        tmp_path,
        "dataset.context=4",
        "+hooks.resid.args.positions=[0,1,-2,-1]",
        shortest=2,
    )
    with h5py.File(path) as f:
        mask, listed = f["samples/mask"][()], f[H1][()].astype(np.float32)
        assert list(f[H1].attrs["positions"]) == [0, 1, -2, -1]
    assert mask.shape == listed.shape[:2] and not mask.all()
    want = listed.reshape(-1, listed.shape[-1])
    per_token = Activations(path, H1)
    assert len(per_token) == len(want)
    np.testing.assert_array_equal(np.stack([per_token[i].numpy() for i in range(len(want))]), want)
    got = _all(TokenBatches(path, H1, batch_size=10))
    np.testing.assert_array_equal(_sorted(got), _sorted(want))


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"keys": "captures/nothing/output"}, "captures/nothing/output: no such dataset"),
        ({"keys": H1, "batch_size": 0}, "batch_size: 0; valid: an integer >= 1"),
        ({"keys": H1, "buffer": -1}, "buffer: -1; valid: an integer >= 1"),
        ({"keys": [H1, H1]}, "valid: one or more captures, each once"),
        (
            {"keys": [H1, "samples/tokens"]},
            "samples/tokens holds int32; valid: a capture of floats",
        ),
    ],
)
def test_bad_arguments_are_refused_in_one_line(tmp_path, kwargs, said):
    path = _run(tmp_path)
    with pytest.raises((ValueError, KeyError)) as err:
        TokenBatches(path, **kwargs)
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)


def _same(got, want) -> None:
    """Two lists of batches equal bit for bit, batch by batch (tensors or tuples)."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        for x, y in zip(*((t,) if torch.is_tensor(t) else t for t in (a, b)), strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keys": H1, "batch_size": 10, "buffer": 64, "block": 2},
        {"keys": [H0, H1], "batch_size": 7, "buffer": 40, "block": 3, "drop_last": True},
        {"keys": H1, "batch_size": 10, "shuffle": False, "block": 2},
        {"keys": H1, "batch_size": 64, "buffer": 96, "block": 1, "dtype": torch.float16},
    ],
)
def test_a_resumed_epoch_is_the_uninterrupted_one_from_its_batch_on(tmp_path, kwargs):
    """Batches spanning windows (a window's tokens not a multiple of the batch), resumed
    at the first, inside a window, at the last and past the end."""
    path = _run(tmp_path)
    reader = TokenBatches(path, **kwargs)
    reader.set_epoch(2)
    full = list(reader)
    assert len(full) == len(reader) > 4
    for start in (0, 1, 3, len(full) // 2, len(full) - 1, len(full), len(full) + 5):
        _same(list(reader.batches(start)), full[start:])
        again = TokenBatches(path, **kwargs)  # a trainer's new process
        again.set_epoch(2, start=start)
        _same(list(again), full[start:])


@pytest.mark.parametrize("workers", [2, 3])
def test_a_resumed_epoch_in_dataloader_workers_is_the_loaders_from_its_batch_on(tmp_path, workers):
    """The workers' shares differ in batches (one ends first): the loader's order, workers
    in turn, those that ended left out, is the same resumed at any batch."""
    path = _run(tmp_path)
    reader = TokenBatches(path, H1, batch_size=9, buffer=64, block=2)
    full = list(DataLoader(reader, batch_size=None, num_workers=workers))
    for start in (1, workers + 1, len(full) - 2):
        reader.set_epoch(0, start=start)
        _same(list(DataLoader(reader, batch_size=None, num_workers=workers)), full[start:])


def test_tokens_of_blocks_far_apart_in_the_file_meet_in_one_batch(tmp_path):
    """A buffer of two blocks: a batch still holds tokens of blocks further apart than
    two (the blocks are read in an order drawn at random), every token once."""
    path = _run(tmp_path)
    with h5py.File(path) as f:
        rows = np.nonzero(f["samples/mask"][()])[0]  # each real token's row, file order
    want = _stored(path, H1)
    row_of = {vector.tobytes(): row for vector, row in zip(want, rows, strict=True)}
    reader = TokenBatches(path, H1, batch_size=16, buffer=1, block=2)  # two blocks
    assert reader.buffer == 2 * 2 * 16
    batches = list(reader)
    np.testing.assert_array_equal(_sorted(_all(batches)), _sorted(want))
    spans = [np.ptp([row_of[v.tobytes()] // 2 for v in b.numpy()]) for b in batches]
    assert max(spans) > 2, spans
