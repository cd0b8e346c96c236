"""experiment=lrp on small models: the epsilon rule's relevance and conservation gap by hand on
a 2-layer linear net, the model back bit for bit after a run (batch norms merged into a
layer without bias, ResNet blocks rewritten, in-place ReLUs called twice a block), no hook
left behind, the plan's lines, and each refusal in one line before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from conftest import read
from torch import nn

import hookrun
from hookrun.errors import HookrunError

QUIET = ["render=false", "progress=false"]
EPSILON_ONLY = [
    "experiment=lrp",
    "derive.lrp.composite=null",
    "+derive.lrp.rules.lin={select: {type: [Linear]}, rule: epsilon, epsilon: 0.1}",
    *QUIET,
]
# A rule the user gives that selects no module is refused: the ReLU's only where there is one.
WITH_PASS = [*EPSILON_ONLY, "+derive.lrp.rules.act={select: {type: [ReLU]}, rule: pass}"]


def _two_layers() -> nn.Module:
    """x (2) → W1 = [[1, -1], [2, 1]] → ReLU → W2 = [[1, 0.5]], no biases: y = 2 at (1, 2)."""
    net = nn.Sequential(nn.Linear(2, 2, bias=False), nn.ReLU(), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[1.0, -1.0], [2.0, 1.0]]))
        net[2].weight.copy_(torch.tensor([[1.0, 0.5]]))
    return net.eval()


def test_the_epsilon_rule_by_hand_on_a_two_layer_net(tmp_path):
    # Forward: z1 = W1 x = (-1, 4), a = relu(z1) = (0, 4), y = W2 a = 2; R_out = y = 2.
    # Layer 2: R_a = a * W2ᵀ (2 / (2 + 0.1)) = (0, 4 * 0.5 * 2 / 2.1) = (0, 4 / 2.1).
    # ReLU passes it. Layer 1: s = R / (z1 ± 0.1) = (0, (4 / 2.1) / 4.1);
    # R_x = x * W1ᵀ s = (1 * 2 * s2, 2 * 1 * s2) = (8, 8) / (2.1 * 4.1).
    each = 8 / (2.1 * 4.1)
    data = [torch.tensor([1.0, 2.0])]
    run = hookrun.run(WITH_PASS, model=_two_layers(), dataset=data, run_dir=tmp_path)
    got = read(run.path)
    np.testing.assert_allclose(got["derived/lrp/input"], [[each, each]], rtol=1e-6)
    gap = got["derived/lrp/input.completeness_gap"]
    np.testing.assert_allclose(gap, [2 * each - 2], rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["model/output"], [[2.0]])


def test_epsilon_on_positive_paths_loses_only_what_epsilon_takes(tmp_path):
    # Every path positive: (1, 2) → z1 = (3, 4) with W1 = [[1, 1], [2, 1]], no bias; the
    # gap is what ε takes from each denominator.
    net = _two_layers()
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[1.0, 1.0], [2.0, 1.0]]))
    # z1 = (3, 4), y = 3 + 2 = 5; R_a = a * W2ᵀ 5 / 5.1 = (3, 2) * 5 / 5.1;
    # s = R_a / (z1 + 0.1) = (15 / 5.1 / 3.1, 10 / 5.1 / 4.1);
    # R_x = x * W1ᵀ s = (1 * (s1 + 2 s2), 2 * (s1 + s2)).
    s1, s2 = 15 / 5.1 / 3.1, 10 / 5.1 / 4.1
    expected = [1 * (s1 + 2 * s2), 2 * (s1 + s2)]
    run = hookrun.run(EPSILON_ONLY, model=net, dataset=[torch.tensor([1.0, 2.0])], run_dir=tmp_path)
    got = read(run.path)
    np.testing.assert_allclose(got["derived/lrp/input"], [expected], rtol=1e-6)
    np.testing.assert_allclose(
        got["derived/lrp/input.completeness_gap"], [sum(expected) - 5], rtol=0, atol=1e-6
    )


def _snapshot(net: nn.Module) -> dict:
    return {
        "tensors": {k: v.clone() for k, v in net.state_dict(keep_vars=True).items()},
        "objects": {k: id(v) for k, v in net.state_dict(keep_vars=True).items()},
        "names": [n for n, _ in net.named_modules()],
        "flags": [
            (p.requires_grad, m.training) for m in net.modules() for p in m.parameters(False)
        ],
        "biases": [getattr(m, "bias", 0) is None for m in net.modules()],
    }


def _no_hooks(net: nn.Module) -> bool:
    return all(
        not m._forward_hooks and not m._forward_pre_hooks and "forward" not in vars(m)
        for m in net.modules()
    )


class _ConvBN(nn.Module):
    """A conv without bias before a batch norm (the merge gives it one for the pass), a linear
    layer called twice and an in-place ReLU called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.relu(self.bn(self.conv(x)))).flatten(1)
        return self.head(self.relu(self.fc(self.fc(h))))


@pytest.mark.slow
@pytest.mark.parametrize("composite", ["epsilon_plus_flat", "epsilon_gamma_box"])
def test_the_model_leaves_the_run_bit_for_bit(composite, tmp_path):
    torch.manual_seed(0)
    resnet = torchvision.models.resnet18(num_classes=5).eval()
    small = _ConvBN().eval()
    for net in (resnet, small):
        with torch.no_grad():  # statistics that are not the initial ones
            for m in net.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-1, 1)
                    m.running_var.uniform_(0.5, 2)
                    m.weight.uniform_(0.5, 1.5)
        before = _snapshot(net)
        args = ["experiment=lrp", f"derive.lrp.composite={composite}", "limit=2", *QUIET]
        args += ["derive.lrp.low=-3", "derive.lrp.high=3"]
        images = [torch.randn(3, 32, 32) for _ in range(2)]
        run = hookrun.run(args, model=net, dataset=images, run_dir=tmp_path / type(net).__name__)
        after = _snapshot(net)
        assert after["objects"] == before["objects"] and after["names"] == before["names"]
        for key, value in before["tensors"].items():
            assert torch.equal(after["tensors"][key], value), key
        assert after["flags"] == before["flags"] and after["biases"] == before["biases"]
        assert _no_hooks(net)
        assert np.isfinite(read(run.path)["derived/lrp/input"]).all()


def test_a_linear_layer_called_twice_gets_its_rule_at_each_call(tmp_path):
    # y = W (W x): each call's epsilon rule with its own input and output. By hand with
    # W = [[2]] and x = 3: z1 = 6, z2 = 12; R = 12 → 6 * 2 * 12 / 12.1 → 3 * 2 * that / 6.1.
    net = nn.Sequential()
    fc = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        fc.weight.fill_(2.0)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = fc

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.fc(x))

    net = Twice().eval()
    middle = 6 * 2 * 12 / 12.1
    expected = 3 * 2 * middle / 6.1
    run = hookrun.run(EPSILON_ONLY, model=net, dataset=[torch.tensor([3.0])], run_dir=tmp_path)
    np.testing.assert_allclose(read(run.path)["derived/lrp/input"], [[expected]], rtol=1e-6)


def test_the_dry_run_shows_each_rule_and_where_it_stands():
    spec = hookrun.compose(["experiment=lrp", "derive.lrp.composite=epsilon_gamma_box"])
    args = spec.derive["lrp"]
    # The box from the preset's dataset.mean/std: the images of pixel values 0 and 1.
    np.testing.assert_allclose(args.low, [-0.485 / 0.229, -0.456 / 0.224, -0.406 / 0.225])
    np.testing.assert_allclose(args.high, [0.515 / 0.229, 0.544 / 0.224, 0.594 / 0.225])
    from hookrun.stages.derive.lrp.method import LRP

    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=4).eval()
    lines = LRP().describe(args, LRP().prepare(args, net, torch.zeros(3, 32, 32)))
    text = "\n".join(lines)
    assert "lrp: bn1 merged into conv1" in text
    assert "lrp: layer1.0: residual sum as layer1.0.canonizer_sum" in text
    assert "epsilon_gamma_box.first_layer: name=conv1 -> zbox(low=[-2.118" in text
    assert "epsilon_gamma_box.convolutions: type=[" in text and "-> gamma(gamma=0.25" in text
    assert "epsilon_gamma_box.first_layer on conv1" in text
    assert "epsilon_gamma_box.sums on layer1.0.canonizer_sum" in text
    assert "epsilon_gamma_box.linears on fc" in text
    assert _no_hooks(net) and not hasattr(net.layer1[0], "canonizer_sum")


BAD = [
    (["derive.lrp.composite=epsilon_flat"], "derive.lrp.composite: 'epsilon_flat' is not an LRP"),
    (["derive.lrp.epsilon=0"], "derive.lrp.epsilon: 0.0; valid: a number > 0"),
    (["derive.lrp.epsilon=-1e-3"], "derive.lrp.epsilon: -0.001; valid: a number > 0"),
    (["derive.lrp.gamma=-0.5"], "derive.lrp.gamma: -0.5; valid: a number >= 0"),
    (
        ["derive.lrp.composite=epsilon_gamma_box", "derive.lrp.low=1", "derive.lrp.high=1"],
        "derive.lrp.low: 1.0 is not below derive.lrp.high=1.0",
    ),
    (
        ["derive.lrp.composite=epsilon_gamma_box", "derive.lrp.low=[0,2,0]", "derive.lrp.high=1"],
        r"derive.lrp.low\[1\]: 2.0 is not below derive.lrp.high\[1\]=1.0",
    ),
    (["+derive.lrp.rules.x={select: {type: [Conv2d]}, rule: zplusplus}"], "rules.x.rule: 'zplus"),
    (
        ["+derive.lrp.rules.x={select: {type: [Conv2d]}, rule: epsilon, epsilon: 0}"],
        "derive.lrp.rules.x.epsilon: 0.0; valid: a number > 0",
    ),
    (
        ["+derive.lrp.rules.x={select: {type: [Conv2d]}, rule: gamma, gamma: -1}"],
        "derive.lrp.rules.x.gamma: -1.0; valid: a number >= 0",
    ),
    (
        ["+derive.lrp.rules.x={select: {type: [Conv2d]}, rule: alpha_beta, alpha: 2, beta: 2}"],
        "derive.lrp.rules.x: alpha=2.0, beta=2.0; valid: .*alpha - beta = 1",
    ),
    (
        ["+derive.lrp.rules.x={select: {name: conv1}, rule: zbox, low: 0.5, high: 0}"],
        "derive.lrp.rules.x.low: 0.5 is not below derive.lrp.rules.x.high=0.0",
    ),
    (["+derive.lrp.rules.x={select: {}, rule: flat}"], "derive.lrp.rules.x.select: .* selects"),
    (["derive.lrp.composite=null"], "derive.lrp.composite: null with no derive.lrp.rules"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD)
def test_each_bad_argument_is_refused_in_one_line_before_any_work(overrides, message):
    with pytest.raises(HookrunError, match=message) as err:
        hookrun.compose(["experiment=lrp", *overrides])
    assert "\n" not in str(err.value)


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.features(x).mean((2, 3))))


def test_a_layer_with_parameters_no_rule_covers_is_named_before_any_work(tmp_path):
    with pytest.raises(HookrunError, match=r"no rule covers norm \(LayerNorm, a layer") as err:
        hookrun.run(
            ["experiment=lrp", *QUIET], model=_Normed(), dataset=[torch.zeros(3, 8, 8)],
            run_dir=tmp_path,
        )  # fmt: skip
    assert "\n" not in str(err.value)
    assert not (tmp_path / "captures.h5").exists()
    # A rule for it (here: pass) lets the run go on.
    rule = "+derive.lrp.rules.norms={select: {type: [LayerNorm]}, rule: pass}"
    run = hookrun.run(
        ["experiment=lrp", rule, *QUIET], model=_Normed(), dataset=[torch.zeros(3, 8, 8)],
        run_dir=tmp_path,
    )  # fmt: skip
    assert run.rows == 1


def test_a_weighted_rule_on_a_layer_without_weights_is_refused(tmp_path):
    rule = "+derive.lrp.rules.x={select: {type: [ReLU]}, rule: zplus}"
    with pytest.raises(HookrunError, match=r"rules.x: rule 'zplus' reads a layer's weight"):
        hookrun.run(
            ["experiment=lrp", rule, *QUIET], model=_Normed(), dataset=[torch.zeros(3, 8, 8)],
            run_dir=tmp_path,
        )  # fmt: skip


class _Boom(nn.Module):
    """Raises inside the LRP pass only: the one forward whose input carries a gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("boom inside the LRP pass")
        return x


@pytest.mark.slow
def test_a_pass_that_fails_leaves_the_model_whole(tmp_path):
    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=3).eval()
    net.fc = nn.Sequential(_Boom(), nn.Linear(512, 3))
    before = _snapshot(net)
    with pytest.raises(RuntimeError, match="boom inside the LRP pass"):
        hookrun.run(
            ["experiment=lrp", *QUIET], model=net, dataset=[torch.randn(3, 32, 32)],
            run_dir=tmp_path,
        )  # fmt: skip
    after = _snapshot(net)
    assert after["objects"] == before["objects"] and after["names"] == before["names"]
    for key, value in before["tensors"].items():
        assert torch.equal(after["tensors"][key], value), key
    assert _no_hooks(net) and not hasattr(net.layer1[0], "canonizer_sum")
