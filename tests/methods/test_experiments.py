"""Every conf/experiment file with its own defaults (limit=3: real MobileNetV2 weights on the
bundled photos), each against an independent reference computed here with plain PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import CONF, read, run_config
from PIL import Image
from pytorch_grad_cam import GradCAMPlusPlus, LayerCAM
from references import input_gradient, mobilenet, swap_relu6
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

from hookrun.errors import HookrunError

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
CAT_CLASSES = range(281, 286)  # ImageNet's tabby, tiger cat, Persian, Siamese, Egyptian cat
# Fewer passes for the methods with passes of their own (tests/methods/test_attribution.py
# checks their numbers); the picture test only needs their files.
FEWER_PASSES = {
    "integrated_gradients": ["derive.integrated_gradients.steps=4"],
    "smoothgrad": ["derive.smoothgrad.samples=3"],
    # tests/methods/test_perturbation.py checks their numbers; here a pass count the files
    # and pictures need (their defaults take thousands of passes at 224 px).
    "occlusion": ["derive.occlusion.window=112", "derive.occlusion.stride=56"],
    "feature_ablation": ["derive.feature_ablation.n_segments=8"],
    "kernel_shap": ["derive.kernel_shap.n_segments=8", "derive.kernel_shap.samples=16"],
    "rise": ["derive.rise.masks=24"],
    "score_cam": ["limit=2", "model.cam_layer=features.17"],  # 320 channels, not 1280
    "ablation_cam": ["limit=2", "model.cam_layer=features.17"],
    # tests/evaluate/test_sanity.py checks its numbers on the default layers.
    "sanity_check": [
        "sanity.methods=[saliency,grad_cam]",
        "sanity.layers=[classifier.1,features.18,features.14]",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each experiment run once, as `python -m hookrun experiment=NAME limit=3` would."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            run_dir = tmp_path_factory.mktemp(name)
            overrides = [f"experiment={name}", "limit=3", *FEWER_PASSES.get(name, [])]
            if name == "patch":  # mean ablation needs a stored run of the same layer
                overrides.append(f"hooks.ablate.args.file={get('grad_cam')[0].path}")
            result = run_config(run_dir, overrides, experiment=name)
            cache[name] = (result, read(result.path))
        return cache[name]

    return get


def plain_grad_cam(
    x: torch.Tensor, target: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Grad-CAM at features (= features.18's output) by hand: A, dy/dA, relu(sum alpha A)."""
    model = mobilenet()
    a = model.features(x)
    a.retain_grad()
    logits = model.classifier(torch.flatten(F.adaptive_avg_pool2d(a, 1), 1))
    logits.gather(1, torch.from_numpy(target)[:, None]).sum().backward()
    alpha = a.grad.mean(dim=(2, 3), keepdim=True)
    return a.detach().numpy(), a.grad.numpy(), torch.relu((alpha * a).sum(1)).detach().numpy()


def close(got: np.ndarray, expected: np.ndarray, rtol: float = 1e-5) -> None:
    scale = float(np.abs(expected).max())
    assert scale > 0
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * scale)


def test_every_experiment_file_is_tested():
    assert (
        sorted(
            [
                "ablation_cam",
                "attention_rollout",  # tests/methods/test_attention_rollout.py
                "attribution_graph",  # tests/graph/test_attribution_graph.py
                "cam",
                "capture",
                "circuit",  # tests/lm/test_circuit.py
                "feature_ablation",
                "feature_maps",
                "features",  # tests/features/test_features.py
                "grad_cam",
                "grad_cam_pp",
                "grad_scale",
                "guided_bp",
                "guided_grad_cam",
                "integrated_gradients",
                "induction",  # tests/lm/test_induction.py
                "kernel_shap",
                "layer_cam",
                "lm_cache",  # tests/lm/test_lm_cache.py
                "generate",  # tests/lm/test_generate.py
                "lm_patching",  # tests/lm/test_lm_patching.py
                "logit_lens",  # tests/lm/test_logit_lens.py
                "lrp",  # tests/lrp/test_lrp_zennit.py (against Zennit on this preset too)
                "occlusion",
                "patch",
                "rise",
                "sae",  # tests/dictionaries/test_scores.py, docs/tutorials/sae.py
                "saliency",
                "sanity_check",
                "score_cam",
                "smoothgrad",
                "steering",  # tests/lm/test_steering.py
                "train_sae",  # tests/training/test_train_job.py
            ]
        )
        == EXPERIMENTS
    )


def test_guided_bp_predicts_the_cat_and_matches_a_guided_relu6(runs):
    result, data = runs("guided_bp")
    assert result.rows == 3
    assert data["samples/target"][0] in CAT_CLASSES
    x = torch.from_numpy(data["captures/input/output"])
    expected = input_gradient(swap_relu6(mobilenet(), "guided"), x, data["samples/target"])
    close(data["captures/input/grad_output"], expected)
    # ReLU6's upper bound matters here: some ReLU6 inputs pass 6 on these photos.
    model, peaks = mobilenet(), []
    for m in model.modules():
        if isinstance(m, nn.ReLU6):
            m.register_forward_pre_hook(lambda mod, args: peaks.append(float(args[0].max())))
    with torch.no_grad():
        model(x)
    assert max(peaks) > 6


def test_saliency_is_the_plain_input_gradient(runs):
    _, data = runs("saliency")
    x = torch.from_numpy(data["captures/input/output"])
    close(
        data["captures/input/grad_output"], input_gradient(mobilenet(), x, data["samples/target"])
    )


def test_grad_cam_matches_a_hand_written_grad_cam(runs):
    _, data = runs("grad_cam")
    x = torch.from_numpy(data["captures/input/output"])
    a, grad, cam = plain_grad_cam(x, data["samples/target"])
    close(data["captures/features.18/output"], a)
    close(data["captures/features.18/grad_output"], grad)
    assert data["derived/grad_cam/features.18"].shape == (3, 7, 7)
    close(data["derived/grad_cam/features.18"], cam, rtol=1e-4)


def pytorch_grad_cam_map(name: str, a: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """pytorch-grad-cam's map before its scaling and resizing: its own weight code on the
    hand-computed activations and gradients, then the ReLU its compute_cam_per_layer applies."""
    model = mobilenet()
    layer = [model.features[18]]
    if name == "grad_cam_pp":
        weights = GradCAMPlusPlus(model, layer).get_cam_weights(None, layer, None, a, grad)
        cam = (weights[:, :, None, None] * a).sum(axis=1)
    else:
        cam = LayerCAM(model, layer).get_cam_image(None, layer[0], None, a, grad, False)
    return np.maximum(cam, 0)


@pytest.mark.parametrize("name", ["grad_cam_pp", "layer_cam"])
def test_grad_cam_pp_and_layer_cam_equal_pytorch_grad_cam(runs, name):
    _, data = runs(name)
    x = torch.from_numpy(data["captures/input/output"])
    a, grad, grad_cam = plain_grad_cam(x, data["samples/target"])
    close(data["captures/features.18/grad_output"], grad)
    got = data[f"derived/{name}/features.18"]
    assert got.shape == (3, 7, 7)
    expected = pytorch_grad_cam_map(name, a, grad)
    error = float(np.abs(got - expected).max() / np.abs(expected).max())
    print(f"{name}: max error relative to pytorch-grad-cam {error:.2e}")
    assert error < 2e-3
    # A different map from Grad-CAM's (the weighting did something).
    assert np.abs(got / got.max() - grad_cam / grad_cam.max()).max() > 0.05


def test_guided_grad_cam_is_the_product_of_its_two_references(runs):
    _, data = runs("guided_grad_cam")
    x = torch.from_numpy(data["captures/input/output"])
    target = data["samples/target"]
    _, grad, cam = plain_grad_cam(x, target)
    guided = input_gradient(swap_relu6(mobilenet(), "guided"), x, target)
    # The two backward passes do not mix: the CAM layer saw the plain gradient.
    close(data["captures/features.18/grad_output"], grad)
    close(data["captures/input/grad_output"], guided)
    up = F.interpolate(torch.from_numpy(cam)[:, None], size=(224, 224), mode="bilinear").numpy()
    close(data["derived/guided_grad_cam/features.18"], guided * up, rtol=1e-4)


def test_patch_mean_ablation_is_the_classifier_on_the_mean_feature_map(runs):
    _, source = runs("grad_cam")
    _, data = runs("patch")
    mean = source["captures/features.18/output"].astype(np.float64).mean(axis=0)
    model = mobilenet()
    with torch.no_grad():
        pooled = torch.from_numpy(mean).float().mean(dim=(1, 2))[None]
        expected = model.classifier(pooled).numpy()
    for row in data["model/output"]:
        close(row, expected[0], rtol=1e-5)


def test_cam_matches_a_hand_written_cam(runs):
    _, data = runs("cam")
    model = mobilenet()
    w = model.classifier[1].weight.detach().numpy()
    a = data["captures/features.18/output"]
    target = data["samples/target"]
    expected = np.stack([np.einsum("c,chw->hw", w[t], a[i]) for i, t in enumerate(target)])
    close(data["derived/cam/features.18"], expected, rtol=1e-4)
    close(a, model.features(torch.from_numpy(data["captures/input/output"])).detach().numpy())


def test_cam_refuses_a_model_without_global_pooling_and_one_linear(tmp_path):
    overrides = [
        "experiment=cam",
        "model=alexnet",
        "model.weights=null",
        "dataset=fake",
        "dataset.size=1",
        "dataset.image_size=64",
    ]
    with pytest.raises(HookrunError, match=r"derive.cam.layer: CAM is undefined .*features.11"):
        run_config(tmp_path, overrides)


def test_feature_maps_match_the_seeds_hand_written_hooks(runs):
    # torchvision's feature extractor treats MobileNet's Conv2dNormActivation as one leaf and
    # cannot return the conv inside, so the reference here is the seed tutorial's own method
    # (tests/seeds/001): a forward hook per Conv2d appending a copy of its output.
    _, data = runs("feature_maps")
    model = mobilenet()
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    assert len(convs) == 52
    expected: dict[str, torch.Tensor] = {}
    for name, conv in convs.items():
        conv.register_forward_hook(lambda m, i, o, name=name: expected.setdefault(name, o.clone()))
    with torch.no_grad():
        model(torch.from_numpy(data["captures/input/output"]))
    for name in convs:
        close(data[f"captures/{name}/output"], expected[name].numpy())


def test_feature_maps_survive_inplace_relus_alexnet(tmp_path):
    # AlexNet's ReLU(inplace=True) overwrites each conv output; the captures must not change.
    torch.manual_seed(0)
    model = torchvision.models.alexnet().eval()
    weights = tmp_path / "alexnet.pt"
    torch.save(model.state_dict(), weights)
    overrides = [
        "experiment=feature_maps",
        "model=alexnet",
        f"model.weights={weights}",
        "dataset=fake",
        "dataset.size=2",
        "dataset.image_size=64",
        "render=false",
    ]
    result = run_config(tmp_path, overrides)
    data = read(result.path)
    for m in model.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False  # the reference must not overwrite what it returns
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        expected = create_feature_extractor(model, {n: n for n in convs})(
            torch.from_numpy(data["captures/input/output"])
        )
    for name in convs:
        close(data[f"captures/{name}/output"], expected[name].numpy())
        assert (data[f"captures/{name}/output"] < 0).any()  # pre-ReLU values survived


def test_capture_extracts_every_conv_and_linear(runs):
    result, data = runs("capture")
    model = mobilenet()
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert sorted(k.split("/")[1] for k in data if k.startswith("captures/")) == sorted(names)
    np.testing.assert_array_equal(data["captures/classifier.1/output"], data["model/output"])
    assert result.images is None  # a bulk extraction job draws nothing


def test_grad_scale_matches_a_scaled_relu6(runs):
    _, data = runs("grad_scale")
    x = torch.from_numpy(data["captures/input/output"]) if "captures/input/output" in data else None
    assert x is not None
    expected = input_gradient(swap_relu6(mobilenet(), 2.0), x, data["samples/target"])
    close(data["captures/input/grad_output"], expected, rtol=1e-4)
    _, plain = runs("saliency")
    assert (
        np.abs(data["captures/input/grad_output"]).max()
        > 10 * np.abs(plain["captures/input/grad_output"]).max()
    )


# The language-model experiments draw their own pictures (tests/lm/); generate writes text.
LANGUAGE = (
    "attention_rollout",  # tiny_lm by default (the ViT map: test_attention_rollout.py)
    "attribution_graph",
    "circuit",
    "generate",
    "features",
    "induction",
    "lm_cache",
    "lm_patching",
    "logit_lens",
    "sae",
    "steering",
    "train_sae",
)


@pytest.mark.parametrize("name", [e for e in EXPERIMENTS if e not in ("capture", *LANGUAGE)])
def test_every_picture_is_a_real_image(runs, name):
    result, _ = runs(name)
    pngs = sorted(result.images.glob("*.png"))
    assert (result.images / "contact_sheet.png") in pngs
    assert len(pngs) >= 4
    for png in pngs:
        pixels = np.asarray(Image.open(png).convert("RGB"))
        assert min(pixels.shape[:2]) >= 64, png
        assert pixels.std() > 5, f"{png} is (nearly) constant"
