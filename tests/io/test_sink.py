"""captures.h5: layout, chunks, dtype, compression, status, and what is never overwritten."""

from __future__ import annotations

import threading

import h5py
import numpy as np
import pytest
import torch
from conftest import hook, read

from hookrun.io.layout import CHUNK_BYTES, chunk_shape, per_batch
from hookrun.io.sink import HDF5Sink, SinkOptions

# The experiments default to real MobileNetV2 weights on photos; these tests want speed.
RANDOM_RESNET = ["model=resnet18", "model.weights=null", "dataset=fake"]


def test_chunk_shape_targets_one_mib():
    assert chunk_shape((4,), 4) == (CHUNK_BYTES // 16, 4)
    assert chunk_shape((4,), 4, max_rows=10) == (10, 4)
    big = chunk_shape((64, 224, 224), 4)  # 12.8 MB per row: a slab of channels
    assert big[0] == 1 and big[2:] == (224, 224)
    assert np.prod(big) * 4 <= CHUNK_BYTES
    padded = -(-64 // big[1]) * big[1]
    assert padded - 64 < 0.05 * 64  # equal slabs: no half-empty last chunk
    assert chunk_shape((32, 112, 112), 4) == (1, 16, 112, 112)
    assert chunk_shape((3, 224, 224), 2) == (3, 3, 224, 224)  # 294 KiB rows: 3 per chunk


def test_chunks_divide_the_rows_one_append_writes():
    """Chunk heights divide a batch's rows, so an append never rewrites a chunk that holds
    rows `completed` already counts (a torn rewrite would fail its checksum and take them)."""
    assert chunk_shape((4,), 4, write_rows=12) == (12, 4)
    assert chunk_shape((4,), 4, write_rows=7) == (7, 4)
    assert chunk_shape((100_000,), 4, write_rows=12) == (2, 100_000)  # 400 kB rows: 2 fit
    assert chunk_shape((100_000,), 4, write_rows=7) == (1, 100_000)  # only 1 divides 7 and fits
    assert chunk_shape((64, 224, 224), 4, write_rows=8)[0] == 1  # a slab of one row


@pytest.mark.slow
def test_a_runs_chunks_never_straddle_two_batches(run_hookrun):
    """Every dataset of a real run: its chunk height divides the rows each batch appends."""
    overrides = [
        *RANDOM_RESNET,
        "dataset.size=10",
        "dataset.image_size=32",
        "batch_size=3",
        *hook("c", "layer1", "output", "capture"),
        *hook("g", "layer2", "grad_output", "capture"),
    ]
    path = run_hookrun(overrides)[0].path

    def check(name: str, ds: object) -> None:
        if isinstance(ds, h5py.Dataset) and ds.chunks and ds.maxshape[0] is None:
            per_append = 1 if per_batch(ds) else 3  # a folded record is (N, k, ...) too
            assert per_append % ds.chunks[0] == 0, (name, ds.chunks)

    with h5py.File(path) as f:
        f.visititems(check)


@pytest.mark.slow
def test_layout_attrs_and_labels(run_hookrun):
    overrides = [
        "model=resnet18",
        "dataset=fake",
        "dataset.size=5",
        "dataset.image_size=32",
        "dataset.num_classes=10",
        "batch_size=2",
        "target.kind=label",
        "+model.kwargs.num_classes=10",
        *hook("c", "layer4", "output", "capture"),
        *hook("g", "fc", "grad_output", "capture"),
    ]
    result, data = run_hookrun(overrides)
    assert result.rows == 5
    assert data["captures/layer4/output"].shape == (5, 512, 1, 1)
    assert data["captures/fc/grad_output"].shape == (5, 10)
    assert data["model/output"].shape == (5, 10)
    np.testing.assert_array_equal(data["samples/index"], np.arange(5))
    np.testing.assert_array_equal(data["samples/target"], data["samples/label"])
    # d(logit_label)/d(logits) is the one-hot of the label.
    np.testing.assert_array_equal(
        data["captures/fc/grad_output"], np.eye(10)[data["samples/label"]]
    )
    with h5py.File(result.path) as f:
        assert f.attrs["status"] == "complete" and f.attrs["completed"] == 5
        for key in ("config", "hookrun_version", "torch_version", "h5py_version", "seed"):
            assert key in f.attrs
        assert "layer4" in f.attrs["config"] and "target" in f.attrs["config"]
        ds = f["captures/layer4/output"]
        assert ds.maxshape == (None, 512, 1, 1) and ds.dtype == np.float32
        assert f["samples/index"].dtype == np.int64


@pytest.mark.slow
def test_float16_and_compression(run_hookrun):
    base = ["dataset.size=3", "dataset.image_size=32", *hook("c", "layer1", "output", "capture")]
    _, plain = run_hookrun(base)
    result, half = run_hookrun([*base, "sink.dtype=float16", "sink.compression=gzip"])
    with h5py.File(result.path) as f:
        assert f["captures/layer1/output"].dtype == np.float16
        assert f["captures/layer1/output"].compression == "gzip"
        assert f["samples/index"].dtype == np.int64
    np.testing.assert_allclose(
        half["captures/layer1/output"], plain["captures/layer1/output"], rtol=1e-3, atol=1e-3
    )


@pytest.mark.slow
def test_same_config_and_seed_give_identical_bytes(run_hookrun):
    overrides = [
        "experiment=guided_bp",
        *RANDOM_RESNET,
        "dataset.size=3",
        "dataset.image_size=32",
        "batch_size=2",
        *hook("n", "layer2.0.relu", "output", "noise", std=0.1),
        *hook("c", "layer3", "output", "capture"),
    ]
    _, first = run_hookrun(overrides)
    _, second = run_hookrun(overrides)
    _, other_seed = run_hookrun([*overrides, "seed=1"])
    assert first.keys() == second.keys()
    for key in first:
        assert first[key].tobytes() == second[key].tobytes(), key
    assert (
        first["captures/layer3/output"].tobytes() != other_seed["captures/layer3/output"].tobytes()
    )


@pytest.mark.slow
def test_batches_do_not_change_the_numbers(run_hookrun):
    overrides = [
        "dataset.size=5",
        "dataset.image_size=32",
        *hook("c", "layer2", "output", "capture"),
        *hook("n", "layer1", "output", "noise", std=0.0),
    ]
    _, one = run_hookrun([*overrides, "batch_size=5"])
    _, many = run_hookrun([*overrides, "batch_size=2"])
    # Conv kernels may pick another summation order for another batch size: float noise only.
    np.testing.assert_allclose(
        one["captures/layer2/output"], many["captures/layer2/output"], rtol=1e-4, atol=1e-5
    )


@pytest.mark.slow
def test_overwrite_true_replaces_the_file(run_hookrun, tmp_path):
    path = tmp_path / "c.h5"
    path.write_bytes(b"old")
    result, data = run_hookrun(
        [f"sink.path={path}", "sink.overwrite=true", "dataset.size=1", "dataset.image_size=32"]
    )
    assert result.path == path and data["samples/index"].tolist() == [0]


@pytest.mark.slow
def test_dry_run_prints_the_plan_and_writes_nothing(run_hookrun, tmp_path, capsys):
    overrides = [
        "experiment=guided_bp",
        *RANDOM_RESNET,
        "dataset.size=10",
        "dataset.image_size=64",
        f"sink.path={tmp_path / 'c.h5'}",
        "dry_run=true",
    ]
    result, _ = run_hookrun(overrides)
    out = capsys.readouterr().out
    assert result.path is None and not (tmp_path / "c.h5").exists()
    assert "guided_relu: clamp{min=0.0} at grad_input" in out
    # Every call of a twice-called ReLU is listed: conv1's relu, then 2 calls per block.
    assert out.count("layer1.0.relu ") == 2 and "layer1.0.relu (call 1)" in out
    assert "/captures/input/grad_output" in out
    per_sample = 3 * 64 * 64 * 4  # the input gradient in float32
    assert "48.0 KiB/sample" in out and per_sample == 48 * 1024
    assert "10 sample(s)" in out and "estimated file size" in out


def test_writer_queue_blocks_the_producer_when_full(tmp_path):
    gate = threading.Event()
    sink = HDF5Sink(tmp_path / "q.h5", SinkOptions(queue_depth=2))
    original = sink._append

    def slow_append(batch):
        gate.wait(timeout=30)
        original(batch)

    sink._append = slow_append
    batch = {"x": torch.zeros(2, 3)}
    with sink:
        sink.write(batch)  # taken by the writer, which then waits at the gate
        sink.write(batch)
        sink.write(batch)  # queue holds 2 now
        blocked = threading.Thread(target=sink.write, args=(batch,))
        blocked.start()
        blocked.join(timeout=0.5)
        assert blocked.is_alive(), "the producer should block while the queue is full"
        gate.set()
        blocked.join(timeout=30)
    assert read(tmp_path / "q.h5")["x"].shape == (8, 3)


def test_writer_error_reaches_the_producer_and_marks_the_file_failed(tmp_path):
    sink = HDF5Sink(tmp_path / "e.h5")
    with pytest.raises(RuntimeError, match="batch keys changed"), sink:
        sink.write({"x": torch.zeros(1, 2)})
        sink.write({"y": torch.zeros(1, 2)})
    with h5py.File(tmp_path / "e.h5") as f:
        assert f.attrs["status"] == "failed" and f.attrs["completed"] == 1
