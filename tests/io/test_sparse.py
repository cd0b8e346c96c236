"""Sparse records (hookrun/io/sparse.py): sparsify/densify exact, a file written batch by
batch beside dense records, read back (rows, CSR, keys, TokenBatches, bytes in memory),
resumed past rows a file does not count, joined over shards, and verified. Every dense
reference is built by plain numpy indexing (tests/io/sparse_batches.py), never by the code
under test."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from conftest import read
from sparse_batches import KEY, ROWS, TOKENS, WIDTH, batch, options, write

import hookrun
from hookrun.io.activations import Activations, TokenBatches
from hookrun.io.appender import CapturesFile, FileOptions
from hookrun.io.sink import HDF5Sink, SinkOptions
from hookrun.io.sparse import SparseRows, densify, sparsify
from hookrun.io.stored import join_shards, reopen
from hookrun.verify import verify


def _random(shape, dtype, seed=0):
    """Mostly zeros, negatives among the rest; row 1 all zeros, token (0, 2) all active."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.1)
    dense[1] = 0
    dense[0, 2] = torch.randn(shape[-1], generator=g) + 5  # every latent non-zero
    return dense.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sparsify_densify_round_trip_is_exact(dtype):
    dense = _random((3, 4, 64), dtype)
    rows = sparsify(dense)
    want = dense.float().numpy()  # bfloat16 → float32 is exact
    # Reference by numpy: counts per token, entries in row-major order.
    np.testing.assert_array_equal(rows.counts.numpy(), (want != 0).sum(-1))
    flat = np.flatnonzero(want.reshape(-1))
    np.testing.assert_array_equal(rows.latent.numpy(), flat % 64)
    np.testing.assert_array_equal(rows.values.float().numpy(), want.reshape(-1)[flat])
    assert rows.counts.dtype == torch.int32 and rows.latent.dtype == torch.int32
    assert rows.values.dtype == dtype and rows.counts[1].sum() == 0 and rows.counts[0, 2] == 64
    back = densify(rows, 64)
    assert back.shape == (3, 4, 64) and (want < 0).any()
    np.testing.assert_array_equal(back, want)


def test_nan_is_kept_and_negative_zero_is_a_zero():
    dense = torch.tensor([[0.0, float("nan"), -0.0, 2.0]])
    rows = sparsify(dense)
    assert rows.counts.tolist() == [2] and rows.latent.tolist() == [1, 3]
    back = densify(rows, 4)
    assert np.isnan(back[0, 1]) and back[0, 2] == 0 and back[0, 3] == 2


def _by_mask(dense: torch.Tensor) -> SparseRows:
    """sparsify as it was first written (a mask, summed for the counts, searched for the
    entries): what its faster form must give, tensor for tensor."""
    mask = dense != 0
    flat = mask.reshape(-1).nonzero().squeeze(1)
    return SparseRows(
        mask.sum(-1, dtype=torch.int32),
        dense.reshape(-1).index_select(0, flat),
        (flat % dense.shape[-1]).to(torch.int32),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 64), (2, 3, 4, 16), (0, 4, 64), (3, 4, 1)])
def test_sparsify_gives_the_masks_counts_values_and_latents(dtype, shape):
    dense = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    dense = dense * (torch.rand(shape, generator=torch.Generator().manual_seed(2)) < 0.2)
    if dense.numel():
        flat = dense.view(-1)
        flat[:4] = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf")])
        dense[-1] = 0  # a last row with no entry: its tokens' counts end the search at nnz
    dense = dense.to(dtype)
    got, want = sparsify(dense), _by_mask(dense)
    assert got.counts.shape == want.counts.shape == shape[:-1]
    for part in ("counts", "values", "latent"):
        a, b = getattr(got, part), getattr(want, part)
        assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), part


def test_densify_refuses_parts_that_disagree():
    rows = SparseRows(np.array([[2]], np.int32), np.ones(1, np.float32), np.array([0], np.int32))
    with pytest.raises(ValueError, match="counts sum to 2 entries, values hold 1"):
        densify(rows, 4)
    rows = SparseRows(np.array([1], np.int32), np.ones(1, np.float32), np.array([4], np.int32))
    with pytest.raises(ValueError, match=r"latent index outside \[0, 4\)"):
        densify(rows, 4)


def _reference(batches: range) -> np.ndarray:
    return np.concatenate([batch(b)[1] for b in batches])


def test_written_batch_by_batch_it_reads_back_as_the_dense_reference(tmp_path):
    path = tmp_path / "captures.h5"
    write(path, range(5)).close()
    want = _reference(range(5))
    with hookrun.open(path) as res:
        record = res[KEY]
        assert record.shape == (5 * ROWS, TOKENS, WIDTH) and len(record) == 5 * ROWS
        assert record.dims == ("sample", "token", "latent")
        assert record.nnz == int((want != 0).sum())
        np.testing.assert_array_equal(record[:], want)
        np.testing.assert_array_equal(record[3], want[3])
        np.testing.assert_array_equal(record[-1], want[-1])
        np.testing.assert_array_equal(record[5:13:3], want[5:13:3])
        np.testing.assert_array_equal(record[[17, 2, 2, 9]], want[[17, 2, 2, 9]])
        np.testing.assert_array_equal(record[np.array([4, 5])], want[4:6])
        np.testing.assert_array_equal(record[2:4, 1], want[2:4, 1])
        csr = record.to_scipy()
        assert csr.shape == (5 * ROWS * TOKENS, WIDTH) and csr.nnz == record.nnz
        np.testing.assert_array_equal(csr.toarray(), want.reshape(-1, WIDTH))
        some = record.to_scipy([7, 1])
        np.testing.assert_array_equal(some.toarray(), want[[7, 1]].reshape(-1, WIDTH))
        # One key for the record, not its three datasets; the dense beside it as before.
        listed = res.keys()
        assert KEY in listed and not [k for k in listed if k.startswith(KEY + "/")]
        np.testing.assert_array_equal(res["model/output"][:], want[:, 0, :3])
        with pytest.raises(IndexError):
            record[5 * ROWS]
        tree = res.to_xarray()  # the record's parts as stored, on named dimensions
        assert tree[KEY].dataset["counts"].dims == ("sample", "token")
        assert tree[KEY].dataset["values"].dims == ("entry",)
        tree.close()
    ok, lines = verify(path)
    assert ok, lines


def test_slicing_reads_only_the_rows_entries(tmp_path, monkeypatch):
    path = tmp_path / "captures.h5"
    write(path, range(5)).close()
    with hookrun.open(path) as res:
        record = res[KEY]
        assert record.offsets[-1] == record.nnz  # computed once, from the counts
        reads = []
        real = h5py.Dataset.__getitem__

        def spy(ds, key):
            reads.append((ds.name.rsplit("/", 1)[-1], key))
            return real(ds, key)

        monkeypatch.setattr(h5py.Dataset, "__getitem__", spy)
        record[6:8]
        lo, hi = int(record.offsets[6]), int(record.offsets[8])
        assert ("values", slice(lo, hi)) in reads and ("latent", slice(lo, hi)) in reads
        assert all(k != slice(None) and k != () for _, k in reads)


def test_l0_32_of_16384_takes_under_a_fiftieth_of_the_dense_bytes(tmp_path):
    path = tmp_path / "captures.h5"
    rows, tokens, width = 8, 64, 16384
    out = CapturesFile.create(
        path, {"config": "{}"}, options(tokens=tokens, width=width, expected_rows=32)
    )
    dense_parts = []
    for b in range(4):
        arrays, dense = batch(b, rows=rows, tokens=tokens, width=width, l0=16)  # mean L0 16
        counts = np.full((rows, tokens), 32, np.int32)  # exactly 32 per token
        rng = np.random.default_rng(100 + b)
        latent = np.sort(
            np.stack([rng.choice(width, 32, replace=False) for _ in range(rows * tokens)]), 1
        )
        values = rng.standard_normal((rows * tokens, 32)).astype(np.float32)
        dense = np.zeros((rows * tokens, width), np.float32)
        np.put_along_axis(dense, latent, values, 1)
        arrays[KEY] = SparseRows(counts, values.reshape(-1), latent.reshape(-1).astype(np.int32))
        arrays["model/output"] = values[::tokens, :3].copy()
        out.append(arrays)
        dense_parts.append(dense.reshape(rows, tokens, width))
    out.close()
    dense_bytes = 4 * rows * tokens * width * 4  # float32 (N, T, d_sae)
    size = path.stat().st_size
    ratio = dense_bytes / size
    assert ratio >= 50, f"file {size} B, dense float32 {dense_bytes} B: only {ratio:.0f}x smaller"
    print(f"sparse file {size} B vs dense float32 {dense_bytes} B: {ratio:.0f}x smaller")
    with hookrun.open(path) as res:
        np.testing.assert_array_equal(res[KEY][:], np.concatenate(dense_parts))
        assert res[KEY].nnz == 4 * rows * tokens * 32


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_sink_stores_torch_sparse_rows_in_the_run_float_and_reads_from_memory(tmp_path, dtype):
    """What a hook hands the sink (sparsify of its tensor), stored in sink.dtype: bfloat16
    as its raw bits with the `dtype` attribute, as dense floats are; and read back from the
    file's bytes, as a sink.path=memory run's result is."""
    path = tmp_path / "captures.h5"
    spec = {KEY: ((TOKENS, 64), ("sample", "token", "latent"))}
    tensors = [_random((ROWS, TOKENS, 64), torch.float32, seed) for seed in range(3)]
    opts = SinkOptions(dtype=dtype, batch_size=ROWS, sparse=spec)
    with HDF5Sink(path, opts) as sink:
        for b, dense in enumerate(tensors):
            index = torch.arange(b * ROWS, (b + 1) * ROWS)
            sink.write({"samples/index": index, "model/output": dense[:, 0], KEY: sparsify(dense)})
    torch_dtype = getattr(torch, dtype)
    want = torch.cat(tensors).to(torch_dtype).float().numpy()  # rounded once, as stored
    with h5py.File(path) as f:
        values = f[KEY]["values"]
        assert values.dtype == (np.uint16 if dtype == "bfloat16" else np.float16)
        assert (values.attrs.get("dtype") == "bfloat16") == (dtype == "bfloat16")
        assert f[KEY]["latent"].dtype == np.int32 and f[KEY]["counts"].dtype == np.int32
    with hookrun.open(path.read_bytes()) as res:
        assert res[KEY][:].dtype == np.float32
        np.testing.assert_array_equal(res[KEY][:], want)
        np.testing.assert_array_equal(res[KEY].to_scipy().toarray(), want.reshape(-1, 64))


def test_a_record_the_options_do_not_declare_is_refused(tmp_path):
    out = CapturesFile.create(tmp_path / "c.h5", {"config": "{}"}, FileOptions(batch_size=ROWS))
    with pytest.raises(RuntimeError, match=f"{KEY}: SparseRows for a key FileOptions.sparse"):
        out.append(batch(0)[0])


def test_a_batch_whose_parts_disagree_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "captures.h5"
    out = write(path, range(2))
    arrays = batch(2)[0]
    rows = arrays[KEY]
    arrays[KEY] = SparseRows(rows.counts, rows.values[:-1], rows.latent)
    with pytest.raises(RuntimeError, match="counts sum to"):
        out.append(arrays)
    out.append(batch(2)[0])  # the file took nothing of the bad batch
    out.close()
    with hookrun.open(path) as res:
        np.testing.assert_array_equal(res[KEY][:], _reference(range(3)))


def test_rows_past_completed_are_dropped_on_resume_to_the_uninterrupted_bytes(tmp_path):
    """A batch on disk but not counted (the kill came before `completed` moved): resume
    truncates the counts to `completed` rows and the entries to sum(counts[:completed])."""
    reference = tmp_path / "reference.h5"
    write(reference, range(6)).close()
    path = tmp_path / "captures.h5"
    out = write(path, range(4))
    out.close(KeyboardInterrupt("stop"), interrupted=True)
    with h5py.File(path, "r+") as f:
        f.attrs["completed"] = 3 * ROWS  # batch 3 written, never counted
    resumed = reopen(path, options())
    f = resumed.file  # nothing of batch 3 is left before it is written again
    counted = int(f[KEY]["counts"][: 3 * ROWS].sum())
    assert len(f[KEY]["counts"]) == 3 * ROWS and len(f[KEY]["values"]) == counted
    assert counted < sum(len(batch(b)[0][KEY].values) for b in range(4))
    write(path, range(3, 6), resumed).close()
    got, want = read(path), read(reference)
    assert got.keys() == want.keys() and f"{KEY}/values" in got
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key


def test_two_shards_join_to_the_one_file_and_verify(tmp_path):
    whole = tmp_path / "whole.h5"
    write(whole, range(4)).close()
    shards = [tmp_path / "shard0.h5", tmp_path / "shard1.h5"]
    write(shards[0], range(0, 2)).close()
    write(shards[1], range(2, 4)).close()
    joined = tmp_path / "captures.h5"
    join_shards(joined, shards, 4 * ROWS, {"config": "{}"})
    got, want = read(joined), read(whole)
    for part in ("counts", "values", "latent"):
        np.testing.assert_array_equal(got[f"{KEY}/{part}"], want[f"{KEY}/{part}"])
    with h5py.File(joined) as f:
        assert f[f"{KEY}/values"].is_virtual and f[KEY].attrs["sparse"] == "rows"
        assert list(f[KEY].attrs["shape"]) == [TOKENS, WIDTH]
    with hookrun.open(joined) as res:
        np.testing.assert_array_equal(res[KEY][:], _reference(range(4)))
        np.testing.assert_array_equal(res[KEY][[9, 0]], _reference(range(4))[[9, 0]])
    ok, lines = verify(joined)
    assert ok, lines


def test_verify_names_a_sparse_record_short_of_entries_or_with_a_latent_outside(tmp_path):
    path = tmp_path / "captures.h5"
    write(path, range(3)).close()
    with h5py.File(path, "r+") as f:
        f[KEY]["values"].resize(len(f[KEY]["values"]) - 3, axis=0)
    ok, lines = verify(path)
    damaged = [line for line in lines if "damaged:" in line and "entries" in line]
    assert not ok and len(damaged) == 1 and KEY in damaged[0], lines
    assert "values holds" in damaged[0] and "fewer than the" in damaged[0]
    cli = subprocess.run([sys.executable, "-m", "hookrun.verify", str(path)], capture_output=True)
    assert cli.returncode == 1

    other = tmp_path / "other.h5"
    write(other, range(3)).close()
    with h5py.File(other, "r+") as f:
        f[KEY]["latent"][5] = WIDTH
    ok, lines = verify(other)
    assert not ok and any(f"{KEY}: sparse record damaged: latent index {WIDTH}" in x for x in lines)


def test_a_torn_last_chunk_of_entries_keeps_its_counted_entries(tmp_path):
    """A SIGKILL can cut short the rewrite of the last, partly counted chunk of entries: its
    checksum then fails. Its counted entries lie in it as they were: resume keeps them."""
    path = tmp_path / "captures.h5"
    write(path, range(3)).close()
    with h5py.File(path, "r+") as f:
        f.attrs["completed"] = 2 * ROWS
        f.attrs["status"] = "running"
        counted = int(f[KEY]["counts"][: 2 * ROWS].sum())
        info = f[KEY]["values"].id.get_chunk_info(0)
    with open(path, "r+b") as fh:  # a byte of batch 2's entries changed: the tear
        fh.seek(info.byte_offset + 4 * counted + 2)
        byte = fh.read(1)
        fh.seek(info.byte_offset + 4 * counted + 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with h5py.File(path) as f, pytest.raises(OSError):
        f[KEY]["values"][:]
    from hookrun.io.resume import _refuse_damage
    from hookrun.io.stored import rewrite_rows

    _refuse_damage(path, 2 * ROWS)  # no damage to what `completed` counts
    rewrite_rows(path)
    with hookrun.open(path) as res:
        np.testing.assert_array_equal(res[KEY][:], _reference(range(2)))


def test_token_batches_and_activations_over_a_sparse_key_skip_padding(tmp_path):
    path = tmp_path / "captures.h5"
    out = write(path, range(0))
    mask_rng = np.random.default_rng(7)
    masks = []
    for b in range(4):
        arrays = batch(b)[0]
        mask = mask_rng.random((ROWS, TOKENS)) < 0.7
        arrays["samples/mask"] = mask
        masks.append(mask)
        out.append(arrays)
    out.close()
    want = _reference(range(4))[np.concatenate(masks)]  # (real tokens, WIDTH)
    batches = TokenBatches(path, KEY, batch_size=7, shuffle=False, block=3)
    got = torch.cat(list(batches)).numpy()
    np.testing.assert_array_equal(got, want)
    shuffled = torch.cat(list(TokenBatches(path, KEY, batch_size=5, buffer=16))).numpy()
    order = lambda a: a[np.lexsort(a.T[::-1])]  # noqa: E731
    np.testing.assert_array_equal(order(shuffled), order(want))
    items = Activations(path, KEY)
    assert len(items) == len(want)
    np.testing.assert_array_equal(items[len(want) - 1].numpy(), want[-1])


def test_densify_of_what_the_batches_helper_makes_is_its_dense():
    arrays, dense = batch(3)
    np.testing.assert_array_equal(densify(arrays[KEY], WIDTH), dense)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sparsify_stays_on_the_device():
    dense = _random((ROWS, TOKENS, 64), torch.float32).cuda()
    rows = sparsify(dense)
    assert rows.counts.is_cuda and rows.values.is_cuda and rows.latent.is_cuda
    np.testing.assert_array_equal(densify(rows, 64), dense.cpu().numpy())
