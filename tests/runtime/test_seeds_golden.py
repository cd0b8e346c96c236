"""The seed tutorials' numbers, out of full runs (tests/seeds/README.md)."""

from __future__ import annotations

import numpy as np
from conftest import SEED_CONVNET, SEED_MLP, hook


def test_seed_mlp_forward_captures(run_hookrun):
    _, data = run_hookrun([*SEED_MLP, "target.kind=sum", *hook("o", '"*"', "output", "capture")])
    np.testing.assert_array_equal(data["captures/fc1/output"], [[7, -13, 27, -29]])
    np.testing.assert_array_equal(data["captures/relu1/output"], [[7, 0, 27, 0]])
    np.testing.assert_array_equal(data["captures/fc2/output"], [[89]])
    np.testing.assert_array_equal(data["model/output"], [[89]])
    np.testing.assert_array_equal(data["samples/index"], [0])
    assert "samples/label" not in data  # the constant dataset has no labels


def test_seed_mlp_gradients(run_hookrun):
    overrides = [
        *SEED_MLP,
        "target.kind=sum",
        *hook("gout", '"*"', "grad_output", "capture"),
        *hook("gin", '"*"', "grad_input", "capture"),
        *hook("x", "input", "grad_output", "capture"),
    ]
    _, data = run_hookrun(overrides)
    np.testing.assert_array_equal(data["captures/fc2/grad_output"], [[1]])
    np.testing.assert_array_equal(data["captures/relu1/grad_output"], [[1, 2, 3, 4]])
    np.testing.assert_array_equal(data["captures/fc1/grad_output"], [[1, 0, 3, 0]])
    np.testing.assert_array_equal(data["captures/fc2/grad_input"], [[1, 2, 3, 4]])
    np.testing.assert_array_equal(data["captures/relu1/grad_input"], [[1, 0, 3, 0]])
    np.testing.assert_array_equal(data["captures/fc1/grad_input"], [[22, 26, 30]])
    np.testing.assert_array_equal(data["captures/input/grad_output"], [[22, 26, 30]])
    np.testing.assert_array_equal(data["samples/target"], [-1])


def test_seed_mlp_scaled_gradient(run_hookrun):
    overrides = [
        *SEED_MLP,
        "target.kind=sum",
        *hook("double", "relu1", "grad_output", "scale", factor=2),
        *hook("x", "input", "grad_output", "capture"),
    ]
    _, data = run_hookrun(overrides)
    np.testing.assert_array_equal(data["captures/input/grad_output"], [[44, 52, 60]])


def test_seed_convnet(run_hookrun):
    overrides = [*SEED_CONVNET, *hook("c", "conv1", "output", "capture")]
    _, data = run_hookrun(overrides)
    conv = data["captures/conv1/output"]
    np.testing.assert_array_equal(conv[0, 0], np.full((2, 2), 9.0))
    np.testing.assert_array_equal(conv[0, 1], np.full((2, 2), 18.0))
    np.testing.assert_array_equal(data["model/output"].reshape(-1), [9, 18])
    np.testing.assert_array_equal(data["samples/target"], [1])  # predicted: 18 > 9
