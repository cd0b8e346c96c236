"""experiment=lrp against Zennit 0.5.1 (a dev-only reference: hookrun never imports it): each
composite with its canonizers through `zennit.attribution.Gradient`, the output relevance
one-hot × the target logit, on torchvision's VGG-16 and ResNet-18 with random weights and
on the shipped MobileNetV2 weights; the numbers equal to float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from conftest import read, run_config
from references import mobilenet
from torch import nn

import hookrun

zennit_composites = pytest.importorskip("zennit.composites")
from zennit.attribution import Gradient  # noqa: E402  (after the skip: a dev-only reference)
from zennit.canonizers import SequentialMergeBatchNorm  # noqa: E402
from zennit.torchvision import ResNetCanonizer, VGGCanonizer  # noqa: E402

pytestmark = pytest.mark.slow  # each runs hookrun and Zennit on a real architecture

COMPOSITES = ["epsilon_plus_flat", "epsilon_gamma_box", "epsilon_alpha2_beta1", "epsilon_plus"]
MEAN = torch.tensor([0.485, 0.456, 0.406])
STD = torch.tensor([0.229, 0.224, 0.225])
LOW, HIGH = (-MEAN / STD).tolist(), ((1 - MEAN) / STD).tolist()
# A caller's images carry no normalisation: the box is given (the preset's dataset gives it).
BOX = [
    f"derive.lrp.low=[{','.join(map(str, LOW))}]",
    f"derive.lrp.high=[{','.join(map(str, HIGH))}]",
]


def zennit_composite(name: str, canonizer, shape: tuple[int, ...]):
    """Zennit's composite `name` with `canonizer`, its box the images of 0 and 1."""
    if name == "epsilon_gamma_box":
        low = MEAN.new_tensor(LOW).view(1, 3, 1, 1).expand(shape)
        high = MEAN.new_tensor(HIGH).view(1, 3, 1, 1).expand(shape)
        return zennit_composites.EpsilonGammaBox(low=low, high=high, canonizers=[canonizer])
    kind = {
        "epsilon_plus_flat": zennit_composites.EpsilonPlusFlat,
        "epsilon_alpha2_beta1": zennit_composites.EpsilonAlpha2Beta1,
        "epsilon_plus": zennit_composites.EpsilonPlus,
    }[name]
    return kind(canonizers=[canonizer])


def zennit_lrp(net: nn.Module, x: torch.Tensor, composite) -> tuple[torch.Tensor, torch.Tensor]:
    """Zennit's relevance of the predicted class, one-hot × its logit at the output, and
    that output relevance summed (the canonized model's target logit)."""
    with torch.no_grad():
        target = net(x).argmax(1)
    with Gradient(net, composite) as attributor:
        output, relevance = attributor(
            x, lambda out: nn.functional.one_hot(target, out.shape[1]).to(out) * out
        )
    return relevance.detach(), output.detach()[torch.arange(len(x)), target]


def _net(build) -> nn.Module:
    torch.manual_seed(0)
    net = build().eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


NETS = {
    "vgg16": (lambda: _net(torchvision.models.vgg16), VGGCanonizer),
    "resnet18": (lambda: _net(torchvision.models.resnet18), ResNetCanonizer),
}


def _images(count: int, size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(count, 3, size, size, generator=gen)


def _close(got: np.ndarray, expected: torch.Tensor) -> None:
    expected = expected.detach().numpy()
    scale = float(np.abs(expected).max())
    assert scale > 0
    # float32 rounding, relative to the map's largest value (relevance spans decades).
    torch.testing.assert_close(
        torch.from_numpy(got), torch.from_numpy(expected), rtol=1e-5, atol=1e-5 * scale
    )


@pytest.fixture(scope="module")
def nets():
    return {name: build() for name, (build, _) in NETS.items()}


@pytest.mark.parametrize("composite", COMPOSITES)
@pytest.mark.parametrize("arch", sorted(NETS))
def test_each_composite_matches_zennit_on_random_weights(arch, composite, nets, tmp_path):
    net = nets[arch]
    x = _images(2, 64)
    args = ["experiment=lrp", f"derive.lrp.composite={composite}", *BOX, "render=false"]
    run = hookrun.run([*args, "progress=false"], model=net, dataset=list(x), run_dir=tmp_path)
    data = read(run.path)
    composite_ = zennit_composite(composite, NETS[arch][1](), tuple(x.shape))
    expected, start = zennit_lrp(net, x, composite_)
    _close(data["derived/lrp/input"], expected)
    # The gap: the input relevance summed minus the output relevance, the target logit of
    # the model as canonized (each batch norm left as x / sqrt(1 + eps), as Zennit's is).
    gap = (expected.flatten(1).sum(1) - start).numpy()
    scale = float(start.abs().max())
    np.testing.assert_allclose(
        data["derived/lrp/input.completeness_gap"], gap, rtol=1e-5, atol=1e-5 * scale
    )
    np.testing.assert_allclose(start, data["model/output"][[0, 1], data["samples/target"]], 1e-3)


@pytest.fixture(scope="module")
def reference_mobilenet() -> nn.Module:
    net = mobilenet()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


@pytest.mark.parametrize("composite", COMPOSITES)
def test_each_composite_matches_zennit_on_the_shipped_mobilenet(
    composite, reference_mobilenet, tmp_path
):
    # The preset: model=mobilenet_v2 on the bundled photos, the box from dataset.mean/std.
    overrides = ["experiment=lrp", "limit=1", "render=false", f"derive.lrp.composite={composite}"]
    data = read(run_config(tmp_path, overrides, experiment="lrp").path)
    x = torch.from_numpy(data["captures/input/output"])
    expected, _ = zennit_lrp(
        reference_mobilenet,
        x,
        zennit_composite(composite, SequentialMergeBatchNorm(), tuple(x.shape)),
    )
    _close(data["derived/lrp/input"], expected)
    assert data["samples/target"][0] in range(281, 286)  # the cat


class _Transposed(nn.Module):
    """Batch norms after a conv without bias and after a transposed conv (whose weight is
    (in, out, …): the merge scales its second axis), an average pool and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
            nn.ConvTranspose2d(6, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
            nn.AvgPool2d(2), nn.Flatten(), nn.Linear(4 * 8 * 8, 5),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


@pytest.mark.parametrize("composite", COMPOSITES)
def test_transposed_convolutions_and_their_batch_norms_match_zennit(composite, tmp_path):
    torch.manual_seed(2)
    net = _Transposed().eval()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    for p in net.parameters():
        p.requires_grad_(False)
    x = _images(2, 10)
    args = ["experiment=lrp", f"derive.lrp.composite={composite}", *BOX, "render=false"]
    run = hookrun.run([*args, "progress=false"], model=net, dataset=list(x), run_dir=tmp_path)
    composite_ = zennit_composite(composite, SequentialMergeBatchNorm(), tuple(x.shape))
    expected, _ = zennit_lrp(net, x, composite_)
    _close(read(run.path)["derived/lrp/input"], expected)


def test_canonize_false_matches_zennit_without_canonizers(tmp_path):
    # The batch norms stay as they are and pass the relevance on (Zennit's BatchNorm → Pass).
    torch.manual_seed(4)
    net = _Transposed().eval()
    with torch.no_grad():  # negative scales swap W⁺ and W⁻ of the merged layer: z⁺ sees them
        net.features[1].weight.uniform_(-1.5, 1.5)
        net.features[1].bias.uniform_(-1, 1)
    for p in net.parameters():
        p.requires_grad_(False)
    x = _images(2, 10)
    args = ["experiment=lrp", "derive.lrp.composite=epsilon_plus", "derive.lrp.canonize=false"]
    run = hookrun.run(
        [*args, "render=false", "progress=false"], model=net, dataset=list(x), run_dir=tmp_path
    )
    expected, _ = zennit_lrp(net, x, zennit_composites.EpsilonPlus(canonizers=[]))
    _close(read(run.path)["derived/lrp/input"], expected)
    merged, _ = zennit_lrp(
        net, x, zennit_composites.EpsilonPlus(canonizers=[SequentialMergeBatchNorm()])
    )
    assert not torch.allclose(merged, expected)  # the merge does change the map
