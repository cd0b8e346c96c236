"""Bad input to the perturbation methods, typed as a user types it, refused before any work
in one line naming the key, the value and what is valid: sizes that cannot fit in memory
(pinned to 1 GiB where the bytes are worked out by hand below; a huge value from the command
line on this machine), baselines that are no finite number the input holds (refused with
the config, before any model is built), and token data, which has no pixels to perturb —
not "needs a gradient": these methods take none. A mask file's labels are segments whatever
their values (1e12 is a label as 1 is), so their size sizes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from captum.attr import FeatureAblation
from conftest import hookrun_cli, read, resnet18_file, run_config
from test_perturbation import _shapley_by_hand

import hookrun
from hookrun import memory
from hookrun.errors import HookrunError
from hookrun.stages.derive.perturb import check_baseline

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

GIB = 1 << 30
FLOAT32 = "valid: a finite number from -3.403e+38 to 3.403e+38"


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    return resnet18_file(tmp_path_factory.mktemp("weights"), seed=5)


def _refused(tmp_path, overrides: list[str], name: str) -> str:
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path, [f"experiment={name}", *overrides], experiment=name)
    assert not list(tmp_path.rglob("*.h5")), "refused after the file was made"
    message = str(err.value)
    assert "\n" not in message, message
    return message


# (method, overrides, the message's start, the bytes as it prints them), every row's bytes
# by hand; the fixture's rows are 3 fake images in batches of 2 (rows = 2), float32.
TOO_LARGE = [
    (
        # 128 x 128 one-pixel windows = 16384 copies a row, x 2 rows = 32768 rows a pass of
        # 3 x 128 x 128 x 4 B = 192 KiB: 6.0 GiB (the config alone sees 2 rows: the windows
        # need the image's size, checked again once the model is planned)
        "occlusion",
        [
            "dataset.image_size=128",
            "derive.occlusion.window=1",
            "derive.occlusion.stride=1",
            "derive.occlusion.internal_batch_size=10000000000",
        ],
        "derive.occlusion.internal_batch_size: 10000000000 makes one extra pass of 32768 x "
        "[3, 128, 128]",
        "6.0 GiB",
    ),
    (
        # layer4's 512 channels x 4 rows = 2048 masked copies of 3 x 224 x 224 x 4 B: 1.1 GiB
        "score_cam",
        [
            "dataset.image_size=224",
            "dataset.size=4",
            "batch_size=4",
            "model.cam_layer=layer4",
            "derive.score_cam.internal_batch_size=10000000000",
        ],
        "derive.score_cam.internal_batch_size: 10000000000 makes one extra pass of 2048 x "
        "[3, 224, 224]",
        "1.1 GiB",
    ),
    (
        # 7 cells of ceil(32 / 7) = 5 px: each mask upsampled to 40 x 40 = 1600 values, cropped
        # to 32 x 32 = 1024, and 2 rows' scores: 4 B x 200000 x 2626 = 1.96 GiB
        "rise",
        ["derive.rise.masks=200000"],
        "derive.rise.masks: 200000 makes a batch's 200000 masks of 32 x 32",
        "2.0 GiB",
    ),
    (
        # 64 grid segments: 1e10 coalitions drawn, each a bool and an int64 per segment and 2
        # rows' float32 scores: 1e10 x (9 x 64 + 8) B = 5.31 TiB
        "kernel_shap",
        [
            "derive.kernel_shap.segments=grid",
            "derive.kernel_shap.cells=8",
            "derive.kernel_shap.samples=10000000000",
        ],
        "derive.kernel_shap.samples: 10000000000 makes 10000000000 coalitions of sample 0's "
        "64 segments",
        "5.3 TiB",
    ),
    (
        # 36 segments and samples past 2^36 − 2: every coalition, 68719476734 of them, x
        # (9 x 36 + 8) B = 20.7 TiB
        "kernel_shap",
        [
            "derive.kernel_shap.segments=grid",
            "derive.kernel_shap.cells=6",
            "derive.kernel_shap.samples=100000000000",
        ],
        "derive.kernel_shap.samples: 100000000000 makes 68719476734 coalitions of sample 0's "
        "36 segments",
        "20.7 TiB",
    ),
]


@pytest.mark.parametrize(("name", "extra", "said", "size"), TOO_LARGE, ids=lambda v: str(v)[:40])
def test_a_size_that_cannot_fit_is_refused_before_any_work(
    resnet, tmp_path, monkeypatch, name, extra, said, size
):
    monkeypatch.setattr(memory, "machine_memory", lambda: GIB)
    _, overrides = resnet
    message = _refused(tmp_path, [*overrides, *extra], name)
    assert message.startswith(said), message
    assert message.endswith(
        f"need {size} at once, more than this machine's 1.0 GiB of memory; valid: a smaller value"
    ), message


@pytest.mark.slow
def test_a_huge_mask_count_typed_on_the_command_line_is_refused_in_one_line(tmp_path):
    done = hookrun_cli(["experiment=rise", "derive.rise.masks=10000000000", "limit=1"], tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "hookrun: error: derive.rise.masks: 10000000000 makes a batch's 10000000000 masks of "
        "224 x 224 need"
    ), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not list(tmp_path.rglob("*.h5"))


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("occlusion", "baseline", "nan"),
        ("occlusion", "baseline", "1e39"),
        ("feature_ablation", "baseline", "inf"),
        ("feature_ablation", "baseline", "-inf"),
        ("kernel_shap", "baseline", "nan"),
        ("kernel_shap", "baseline", "-1e39"),
    ],
)
def test_a_baseline_that_is_no_finite_float32_is_refused_with_the_config(name, key, value):
    with pytest.raises(HookrunError) as err:
        hookrun.compose([f"experiment={name}", f"derive.{name}.{key}={value}"])  # nothing built
    shown = repr(float(value))
    assert str(err.value) == (
        f"derive.{name}.{key}: {shown} is not a number the input (float32) holds; {FLOAT32}"
    )


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            ["experiment=integrated_gradients", "derive.integrated_gradients.baseline=1e39"],
            "derive.integrated_gradients.baseline: '1e+39'; valid: zeros, mean, blur, or a "
            "finite number from -3.403e+38 to 3.403e+38",
        ),
        (
            ["experiment=smoothgrad", "derive.smoothgrad.sigma=inf"],
            "derive.smoothgrad.sigma: inf; valid: a finite number >= 0",
        ),
        (
            ["experiment=feature_ablation", "derive.feature_ablation.compactness=inf"],
            "derive.feature_ablation.compactness: inf; valid: a finite number > 0",
        ),
    ],
)
def test_the_other_numbers_the_methods_write_are_finite(overrides, said):
    with pytest.raises(HookrunError) as err:
        hookrun.compose(overrides)
    assert str(err.value) == said


def test_a_baseline_is_checked_against_the_inputs_own_dtype():
    """A float16 model's input holds at most 65504: checked once the model is planned."""
    half = torch.zeros((3, 8, 8), dtype=torch.float16)
    check_baseline("derive.occlusion.baseline", 65504.0, half)
    with pytest.raises(HookrunError) as err:
        check_baseline("derive.occlusion.baseline", 70000.0, half)
    assert str(err.value) == (
        "derive.occlusion.baseline: 70000.0 is not a number the input (float16) holds; valid: "
        "a finite number from -6.55e+04 to 6.55e+04"
    )


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("occlusion", "occlusion sets windows of an image's pixels to a baseline"),
        ("feature_ablation", "feature_ablation sets segments of an image's pixels to a baseline"),
        (
            "kernel_shap",
            "kernel_shap keeps coalitions of an image's pixel segments, the rest at a baseline",
        ),
        ("rise", "rise multiplies an image's pixels by random smooth masks"),
        ("score_cam", "score_cam multiplies an image's pixels by a layer's upsampled activations"),
        (
            "ablation_cam",
            "ablation_cam zeroes channels of a layer's image grid (H x W) and maps over it",
        ),
    ],
)
def test_a_perturbation_method_on_token_data_is_refused_for_what_it_perturbs(tmp_path, name, what):
    args = ["model=tiny_lm", "dataset=repeated_tokens", "dataset.size=2"]
    message = _refused(tmp_path, args, name)
    assert message == (
        f"derive.{name}: {what}, and token data has no pixels (its input is token ids); "
        "valid: image data (C, H, W) with an image classifier, or on token data "
        "integrated_gradients, lrp, attention_rollout, smoothgrad, logit_lens"
    )
    assert "gradient" not in message.split(";")[0]


def test_a_mask_files_labels_are_segments_whatever_their_values(resnet, tmp_path):
    """Labels 0, 7, 1e12 and 2^62: four segments (numbered 0..3 in increasing order, as
    /derived/<method>/input.segments stores them), not 2^62 + 1 perturbations."""
    model, overrides = resnet
    values = np.array([0, 7, 10**12, 2**62], dtype=np.int64)
    quadrant = (np.arange(32)[:, None] >= 16) * 2 + (np.arange(32)[None, :] >= 16)
    np.save(tmp_path / "mask.npy", values[quadrant])
    mask = ["segments=file", f"mask={tmp_path / 'mask.npy'}", "baseline=0.25"]
    ablation = read(
        run_config(
            tmp_path / "fa",
            ["experiment=feature_ablation", *overrides]
            + [f"derive.feature_ablation.{m}" for m in mask],
            experiment="feature_ablation",
        ).path
    )
    x = torch.from_numpy(ablation["captures/input/output"])
    target = torch.from_numpy(ablation["samples/target"])
    labels = torch.from_numpy(quadrant).long()
    want = FeatureAblation(model).attribute(
        x,
        baselines=0.25,
        target=target,
        feature_mask=labels.expand(len(x), 3, 32, 32),
    )
    got = ablation["derived/feature_ablation/input"]
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(
        ablation["derived/feature_ablation/input.segments"], quadrant[None].repeat(3, 0)
    )
    shap = read(
        run_config(
            tmp_path / "ks",
            ["experiment=kernel_shap", *overrides, "derive.kernel_shap.samples=14"]
            + [f"derive.kernel_shap.{m}" for m in mask],
            experiment="kernel_shap",
        ).path
    )  # 4 segments: all 14 proper coalitions, the exact Shapley values
    exact = _shapley_by_hand(model, x, target, labels.expand(len(x), 32, 32), 0.25)
    np.testing.assert_allclose(shap["derived/kernel_shap/input"][:, 0], exact, rtol=1e-4, atol=1e-5)
