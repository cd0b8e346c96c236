"""A derived map is computed from the run's own tensors — the captures as the model made
them, in float32 here — and rounded once, when it is stored: a run with sink.dtype=float16
(or bfloat16) stores exactly the float32 run's map rounded to that dtype, by numpy's (and
torch's) round-to-nearest-even, not a map computed from float16-rounded activations and
gradients. Every method that reads captures: the CAM family, Guided Grad-CAM (the input's
guided gradient), Score-CAM and Ablation-CAM (the layer's activation), on a resnet18 with
seeded random weights and 8 x 8 layer grids, where the rounding of 128 channels' products
shows in the maps' last bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import read, resnet18_file, run_config

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

# Each method and its layer (CAM needs the layer before global pooling and the head).
METHODS = [
    ("grad_cam", "layer2"),
    ("grad_cam_pp", "layer2"),
    ("layer_cam", "layer2"),
    ("guided_grad_cam", "layer2"),
    ("cam", "layer4"),
    ("score_cam", "layer2"),
    ("ablation_cam", "layer2"),
]


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    return resnet18_file(tmp_path_factory.mktemp("weights"), seed=11)


def _maps(tmp_path, overrides, name, layer, dtype) -> np.ndarray:
    args = [f"experiment={name}", *overrides, f"model.cam_layer={layer}", f"sink.dtype={dtype}"]
    data = read(run_config(tmp_path / dtype, args, experiment=name).path)
    return data[f"derived/{name}/{layer}"]


def _bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values rounded to `dtype`, as the 16 bits the file holds."""
    if dtype == "float16":
        return values.astype(np.float16).view(np.uint16)
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.uint16).numpy()


@pytest.mark.parametrize(("name", "layer"), METHODS)
def test_a_16_bit_file_holds_the_float32_runs_map_rounded_once(resnet, tmp_path, name, layer):
    _, overrides = resnet
    overrides = [*overrides, "dataset.image_size=64", "target.kind=predicted"]
    exact = _maps(tmp_path, overrides, name, layer, "float32")
    assert exact.dtype == np.float32 and np.abs(exact).max() > 0
    half = _maps(tmp_path, overrides, name, layer, "float16")
    np.testing.assert_array_equal(half.view(np.uint16), _bits(exact, "float16"))
    if name == "grad_cam":  # bfloat16 is stored as its bits (uint16), rounded by torch
        brain = _maps(tmp_path, overrides, name, layer, "bfloat16")
        np.testing.assert_array_equal(brain, _bits(exact, "bfloat16"))


def test_the_logit_lens_of_a_float16_file_reads_the_blocks_as_the_model_made_them(tmp_path):
    """The lens reads every block's output: its top tokens are the float32 run's, and its
    probabilities those rounded once."""
    args = ["experiment=logit_lens", "limit=4", "batch_size=2", "render=false"]
    exact = read(run_config(tmp_path / "f32", args, experiment="logit_lens").path)
    half = read(run_config(tmp_path / "f16", [*args, "sink.dtype=float16"], "logit_lens").path)
    for name in ("top_ids", "top_probs", "target_prob"):
        want = exact[f"derived/logit_lens/{name}"]
        got = half[f"derived/logit_lens/{name}"]
        if want.dtype.kind == "f":
            np.testing.assert_array_equal(got.view(np.uint16), _bits(want, "float16"))
        else:
            np.testing.assert_array_equal(got, want)
