"""A caller's model does not inherit the preset's CAM layer: every experiment runs through
`hookrun.run(..., model=net, dataset=images)` on a caller's resnet18 and a caller's small
ViT with no override that names a layer, or is refused in one line that says why (CAM on a
model without a pooled linear head; grad_scale on a model without ReLU modules)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import hookrun
from hookrun.api import conf_dir
from hookrun.errors import HookrunError

EXPERIMENTS = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))
# What each model cannot run, and the words of the refusal (README, Models).
REFUSED = {
    ("vit", "cam"): "one linear layer",
    ("vit", "grad_scale"): "matches no module",
    # A language-model experiment selects transformer blocks, which image models lack.
    ("resnet18", "lm_cache"): "matches no module",
    ("vit", "lm_cache"): "matches no module",
    ("resnet18", "lm_patching"): "target.kind: answer",
    ("vit", "lm_patching"): "target.kind: answer",
    ("resnet18", "logit_lens"): "matches no module",
    ("vit", "logit_lens"): "matches no module",
    ("resnet18", "induction"): "matches no module",
    ("vit", "induction"): "matches no module",
    ("resnet18", "generate"): "valid: a causal language model",
    # Its dictionary is the user's to give (hooks.sae.args.path), refused before any work.
    ("resnet18", "sae"): "hooks.sae.args.path: null",
    ("vit", "sae"): "hooks.sae.args.path: null",
    # Training reads a language model's tokens: one image row is refused before any work.
    ("resnet18", "train_sae"): "leaves none to train on",
    ("vit", "train_sae"): "leaves none to train on",
    ("vit", "generate"): "valid: a causal language model",
    ("resnet18", "steering"): "matches no module",
    ("resnet18", "circuit"): "target.kind: answer",
    ("vit", "circuit"): "target.kind: answer",
    ("vit", "steering"): "matches no module",
    ("resnet18", "features"): "matches no module",
    ("vit", "features"): "matches no module",
    # Attention rollout reads self-attention: resnet18 has none (the ViT's map is tested).
    ("resnet18", "attention_rollout"): "has no attention modules found",
    # No LRP composite has a rule for a transformer's LayerNorm (AttnLRP's are another's).
    # Attribution graphs run over a GPT-2's transcoders.
    ("resnet18", "attribution_graph"): "valid: a Hugging Face GPT-2",
    ("vit", "attribution_graph"): "valid: a Hugging Face GPT-2",
    ("vit", "lrp"): r"derive.lrp: no rule covers encoder.layers.encoder_layer_0.ln_1 \(LayerNorm",
}


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def _vit() -> nn.Module:
    torch.manual_seed(0)
    net = torchvision.models.VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
        num_classes=10,
    )
    nn.init.normal_(net.heads.head.weight)  # torchvision zeroes it: every gradient would be 0
    return net


# One instance each for the whole module: a model leaves every run exactly as it came in
# (tests/api/test_api.py), so the runs can share it, and building resnet18 is the slow part.
MODELS = {"resnet18": _resnet(), "vit": _vit()}


def _images() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(3, 32, 32, generator=gen) for _ in range(2)]


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> dict[str, Path]:
    """A grad_cam run per model: the file the patch experiment reads its CAM layer from."""
    out = {}
    for name, net in MODELS.items():
        folder = tmp_path_factory.mktemp(name)
        run = hookrun.run(_args("grad_cam"), model=net, dataset=_images(), run_dir=folder)
        out[name] = run.path
    return out


def _args(experiment: str) -> list[str]:
    return [f"experiment={experiment}", "limit=1", "render=false", "progress=false"]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.slow
def test_every_experiment_runs_on_a_callers_model(model, experiment, stored, tmp_path, caplog):
    args = _args(experiment)
    if experiment == "patch":
        args.append(f"hooks.ablate.args.file={stored[model]}")
    net = MODELS[model]
    refusal = REFUSED.get((model, experiment))
    caplog.set_level(logging.INFO, logger="hookrun")
    if refusal:
        with pytest.raises(HookrunError, match=refusal) as err:
            hookrun.run(args, model=net, dataset=_images(), run_dir=tmp_path)
        assert "features.18" not in str(err.value)
        return
    result = hookrun.run(args, model=net, dataset=_images(), run_dir=tmp_path)
    assert result.rows == 1
    with result.open() as res:
        layers = set(res.layers) | {k for g in res.derived.values() for k in g}
        assert "features.18" not in layers and "features.18" not in str(res.config)
    if "cam" in experiment or experiment == "patch":
        # The log says which layer stood in for the preset's.
        assert "model.cam_layer: 'features.18' is the mobilenet_v2 preset's" in caplog.text
        (picked,) = [r.args[0] for r in caplog.records if "the probe picked" in r.getMessage()]
        assert picked in layers or experiment in ("cam", "patch")
        assert picked == (
            "layer4" if model == "resnet18" else "encoder.layers.encoder_layer_1.ln_1"
        )


def test_a_layer_the_user_set_is_kept(tmp_path):
    args = [*_args("grad_cam"), "model.cam_layer=layer3"]
    result = hookrun.run(args, model=MODELS["resnet18"], dataset=_images(), run_dir=tmp_path)
    with result.open() as res:
        assert set(res.derived["grad_cam"]) == {"layer3"}


def test_a_preset_with_another_model_name_picks_its_own_layer():
    # model.name changed on a preset (its weights off): the preset's layer is not inherited,
    # from the CLI's overrides as from the API's.
    args = ["experiment=grad_cam", "model.name=resnet18", "model.weights=null"]
    assert hookrun.compose(args).model.cam_layer == "auto"
    assert hookrun.compose(["experiment=grad_cam"]).model.cam_layer == "features.18"
    kept = hookrun.compose([*args, "model.cam_layer=layer2"])
    assert kept.model.cam_layer == "layer2" and kept.derive["grad_cam"].layer == "layer2"
