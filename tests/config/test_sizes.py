"""Sizes that cannot fit, and lists of the wrong length, are refused before any work in one
line naming the key, the value and why — never the allocator's failure after the model was
built. The memory is pinned to 1 GiB here, so every byte count below is worked out by hand
from the config (float32: 4 bytes a value)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import hookrun
from hookrun import memory
from hookrun.errors import HookrunError

GIB = 1 << 30
SAMPLES = ["dataset=samples"]
FAKE = ["dataset=fake", "dataset.size=4"]


@pytest.fixture(autouse=True)
def one_gib(monkeypatch):
    monkeypatch.setattr(memory, "machine_memory", lambda: GIB)


# (overrides, the key, the bytes it makes the allocation need, as the message prints them)
TOO_LARGE = [
    # 3 x 20000 x 20000 x 4 B = 4.47 GiB for one image
    ([*FAKE, "dataset.image_size=20000"], "dataset.image_size: 20000", "4.5 GiB"),
    # 100000 channels x 64 x 64 x 4 B = 1.53 GiB
    ([*FAKE, "dataset.image_size=64", "dataset.channels=100000"], "dataset.channels", "1.5 GiB"),
    # 2000 rows x 3 x 224 x 224 x 4 B = 1.12 GiB for one batch (each image 588 KiB fits)
    (["dataset=fake", "dataset.size=5000", "batch_size=2000"], "batch_size: 2000", "1.1 GiB"),
    # 16385 x 16384 x 4 B: 64 KiB more than 1 GiB (exactly 1 GiB fits, below)
    (["dataset=constant", "dataset.shape=[16385,16384]"], "dataset.shape: [16385, 16384]", ""),
    # PIL's resized photo: 3 bytes x 20000 x 20000 (short side; the long side only adds)
    ([*SAMPLES, "dataset.resize=20000"], "dataset.resize: 20000", "1.1 GiB"),
    ([*SAMPLES, "dataset.crop=10000"], "dataset.crop: 10000", "1.1 GiB"),
    # numpy's steps x steps float64 eigenproblem: 20000^2 x 8 B = 2.98 GiB
    (
        ["experiment=integrated_gradients", *FAKE, "derive.integrated_gradients.steps=20000"],
        "derive.integrated_gradients.steps: 20000",
        "3.0 GiB",
    ),
    # 4 rows x 50 steps = 200 rows of 588 KiB a pass = 115 MiB fits; 2000 rows x 50 would not
    # be asked for: the pass takes min(internal_batch_size, rows x steps) rows.
    (
        [
            "experiment=integrated_gradients",
            "dataset=fake",
            "dataset.size=4000",
            "batch_size=1000",
            "derive.integrated_gradients.internal_batch_size=2000",
        ],
        "derive.integrated_gradients.internal_batch_size: 2000",
        "1.1 GiB",
    ),
    (
        [
            "experiment=smoothgrad",
            "dataset=fake",
            "dataset.size=4000",
            "batch_size=1000",
            "derive.smoothgrad.internal_batch_size=2000",
        ],
        "derive.smoothgrad.internal_batch_size: 2000",
        "1.1 GiB",
    ),
]


@pytest.mark.parametrize("overrides,key,size", TOO_LARGE, ids=lambda v: str(v)[:50])
@pytest.mark.slow
def test_a_size_that_cannot_fit_is_refused_by_the_spec(overrides, key, size):
    with pytest.raises(HookrunError) as err:
        hookrun.compose(overrides)  # the spec: nothing built, nothing read
    message = str(err.value)
    assert message.startswith(key) and "\n" not in message
    assert f"{size} at once, more than this machine's 1.0 GiB of memory" in message


@pytest.mark.slow
def test_values_that_fit_pass():
    one = ["dataset=fake", "dataset.size=1", "dataset.image_size=8192"]
    hookrun.compose(one)  # 3 x 8192^2 x 4 B = 768 MiB, one row a batch
    hookrun.compose(["dataset=constant", "dataset.shape=[16384,16384]"])  # exactly 1 GiB
    big_batch = ["dataset=fake", "dataset.size=2", "batch_size=100000000"]
    hookrun.compose(big_batch)  # a batch holds at most the 2 samples there are


@pytest.mark.parametrize("key", ["dataset.mean", "dataset.std"])
@pytest.mark.slow
def test_a_normalisation_for_other_channels_is_refused(key):
    values = "[0.5,0.5]"
    other = "dataset.std" if key == "dataset.mean" else "dataset.mean"
    with pytest.raises(HookrunError) as err:
        hookrun.compose([*SAMPLES, f"{key}={values}", f"{other}=[0.5,0.5,0.5]"])
    assert str(err.value) == (
        f"{key}: [0.5, 0.5] has 2 values, the images 3 channels; valid: 3 numbers (one per "
        "channel), or 1 for all"
    )
    hookrun.compose([*SAMPLES, "dataset.mean=[0.5]", "dataset.std=[0.25]"])  # one for all


class _NeverRuns(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the model ran before the sizes were checked")


def test_a_callers_samples_in_too_large_a_batch_are_refused_before_the_model_runs(tmp_path):
    images = [torch.zeros(3, 256, 256)] * 2000  # one tensor, 768 KiB a sample
    with pytest.raises(HookrunError, match=r"^batch_size: 2000 makes one batch of 2000 x"):
        hookrun.run(["batch_size=2000"], model=_NeverRuns(), dataset=images, run_dir=tmp_path)
    assert not (tmp_path / "captures.h5").exists()


@pytest.mark.slow
def test_a_pooled_capture_too_large_is_refused_before_the_first_batch(tmp_path):
    # resnet18's layer1 has 64 channels: 64 x 5000 x 5000 x 4 B = 5.96 GiB for one row.
    hooks = [
        "++hooks.p.select.name=layer1",
        "++hooks.p.at=output",
        "++hooks.p.action=capture",
        "++hooks.p.args.pool=avg",
        "++hooks.p.args.size=5000",
    ]
    with pytest.raises(HookrunError) as err:
        hookrun.run([*FAKE, "dataset.image_size=32", *hooks], run_dir=tmp_path)
    assert str(err.value).startswith(
        "hooks.p.args.size: 5000 makes one pooled row [64, 5000, 5000] need 6.0 GiB"
    )
    assert not (tmp_path / "captures.h5").exists()


def test_the_machine_memory_is_what_the_system_reports(monkeypatch):
    monkeypatch.undo()  # the real reading, not the pinned 1 GiB
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    found = memory.machine_memory()
    assert found is not None and found <= physical
    assert found >= physical * 0.99 or found < physical  # a cgroup limit may be lower
    with pytest.raises(HookrunError, match=r"^context: 7 makes one sequence need 1\.0 TiB"):
        memory.check_fits("context", 7, 1 << 40, "one sequence")  # the reusable check
