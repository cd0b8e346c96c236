"""What makes hookrun cheap, as behaviour (not timings): bounded memory, frozen parameters,
one forward pass per batch, pooled captures, the profile."""

from __future__ import annotations

import threading
import time

import models_for_tests as m
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import hook

from hookrun.errors import HookrunError
from hookrun.io.sink import HDF5Sink, SinkOptions
from hookrun.runtime.transfer import HostCopier

WATCHED = [
    "model=custom",
    "model._target_=models_for_tests.WatchedConvNet",
    "+model.cam_layer=features",
    "dataset=fake",
    "dataset.size=6",
    "dataset.image_size=8",
    "dataset.num_classes=4",
    "batch_size=2",
    "render=false",
]


@pytest.mark.parametrize("experiment", ["guided_bp", "saliency", "grad_cam"])
def test_no_parameter_gradients_and_one_forward_per_batch(run_hookrun, experiment):
    result, data = run_hookrun([f"experiment={experiment}", *WATCHED])
    net = m.BUILT[-1]
    assert isinstance(net, m.WatchedConvNet)
    # The probes (two batches of 2 and 3 for the shapes and row layouts of hooked modules,
    # one for saliency's input alone; for grad_cam one more for the CAM layer's layout, for
    # guided_bp two more for the function-call sites) plus one forward per batch of 2: the
    # target came from it too.
    probes = {"saliency": 1, "grad_cam": 3, "guided_bp": 4}[experiment]
    assert len(net.forwards) == probes + 3
    assert not any(net.forwards), "parameters required grad during the run"
    assert all(p.grad is None for p in net.parameters())
    assert all(p.requires_grad for p in net.parameters())  # given back as they came
    assert result.rows == 6 and len(data["samples/index"]) == 6


def test_writer_queue_bounds_what_is_in_flight(tmp_path):
    depth, produced, written = 2, [0], [0]
    peak = [0]
    sink = HDF5Sink(tmp_path / "q.h5", SinkOptions(queue_depth=depth))
    original = sink._append

    def slow_append(batch):
        time.sleep(0.01)
        original(batch)
        written[0] += 1

    sink._append = slow_append
    with sink:
        for _ in range(25):
            sink.write({"x": torch.zeros(4, 256)})
            produced[0] += 1
            peak[0] = max(peak[0], produced[0] - written[0])
    # Queued batches plus the one being written: never more, however many are produced.
    assert peak[0] <= depth + 1
    assert written[0] == 25


def test_pooled_capture_stores_pooled_features(run_hookrun):
    base = [
        "dataset.size=2",
        "dataset.image_size=64",
        "render=false",
        *hook("full", "layer1", "output", "capture"),
    ]
    _, data = run_hookrun(
        [
            *base,
            *hook("avg", "layer2", "output", "capture", pool="avg", size=2),
            *hook("mx", "layer3", "output", "capture", pool="max", size=1),
            *hook("l2", "layer2", "output", "noise", std=0),
        ]
    )
    assert data["captures/layer2/output"].shape == (2, 128, 2, 2)
    assert data["captures/layer3/output"].shape == (2, 256, 1, 1)
    _, full = run_hookrun(
        [
            "dataset.size=2",
            "dataset.image_size=64",
            "render=false",
            *hook("a", "layer2", "output", "capture"),
            *hook("b", "layer3", "output", "capture"),
        ]
    )
    np.testing.assert_allclose(
        data["captures/layer2/output"],
        F.adaptive_avg_pool2d(torch.from_numpy(full["captures/layer2/output"]), 2).numpy(),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        data["captures/layer3/output"],
        full["captures/layer3/output"].max(axis=(2, 3), keepdims=True),
        rtol=1e-6,
    )


def test_pooling_a_vector_is_refused(tmp_path):
    from conftest import run_config

    with pytest.raises(HookrunError, match=r"hooks.p.args.pool: .*\[1000\].*\(C, H, W\)"):
        run_config(
            tmp_path,
            [
                "dataset.size=1",
                "dataset.image_size=32",
                *hook("p", "fc", "output", "capture", pool="avg", size=2),
            ],
        )


def test_profile_reports_every_stage(run_hookrun):
    result, _ = run_hookrun(
        [
            "experiment=guided_bp",
            "model=resnet18",
            "model.weights=null",
            "dataset=fake",
            "dataset.size=4",
            "dataset.image_size=32",
            "batch_size=2",
            "profile=true",
            "render=false",
        ]
    )
    for stage in ("data", "forward", "backward", "copy", "queue wait", "write"):
        assert result.profile[stage] > 0, stage
    assert result.profile["forward"] < result.seconds


def test_host_copier_pools_only_pinned_buffers():
    copier = HostCopier()
    host, event = copier.copy(torch.ones(2, 3, dtype=torch.float32), torch.float16)
    assert event is None and host.dtype == torch.float16 and host.tolist() == [[1.0] * 3] * 2
    copier.give_back([host])
    assert not any(copier._free.values())  # a plain CPU copy is never reused


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_land_before_the_writer_reads_and_buffers_are_reused():
    copier = HostCopier()
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    host, event = copier.copy(x * 2, torch.float32)
    event.synchronize()
    assert host.is_pinned() and torch.equal(host, (x * 2).cpu())
    copier.give_back([host])
    again, event = copier.copy(x * 3, torch.float32)
    event.synchronize()
    assert again.data_ptr() == host.data_ptr() and torch.equal(again, (x * 3).cpu())


def test_writer_thread_overlaps_compute(tmp_path):
    # While the writer is stuck in a write, the producer still hands over batches (up to the
    # queue bound): computing the next batch never waits for the disk.
    gate, started = threading.Event(), threading.Event()
    sink = HDF5Sink(tmp_path / "o.h5", SinkOptions(queue_depth=4))
    original = sink._append

    def gated_append(batch):
        started.set()
        gate.wait(30)
        original(batch)

    sink._append = gated_append
    with sink:
        sink.write({"x": torch.zeros(1, 2)})
        assert started.wait(30)
        producer = threading.Thread(
            target=lambda: [sink.write({"x": torch.zeros(1, 2)}) for _ in range(3)]
        )
        producer.start()
        producer.join(timeout=30)
        assert not producer.is_alive() and not gate.is_set()
        gate.set()


def test_deterministic_true_holds_for_the_run_only(run_hookrun):
    assert not torch.are_deterministic_algorithms_enabled()
    run_hookrun([*WATCHED, "deterministic=true"])
    assert all(m.BUILT[-1].deterministic)
    assert not torch.are_deterministic_algorithms_enabled()  # given back as it was
    run_hookrun(WATCHED)
    assert not any(m.BUILT[-1].deterministic)
