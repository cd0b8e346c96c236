"""select: name globs, regex, type, exclude; AND across keys, OR inside lists."""

from __future__ import annotations

import pytest
import torchvision
from torch import nn

from hookrun.errors import HookrunError
from hookrun.runtime.selectors import SelectConfig, select_layers


@pytest.fixture(scope="module")
def resnet():
    return torchvision.models.resnet18()


def names(resnet, **select):
    return select_layers(SelectConfig(**select), resnet, "hooks.t.select")


def test_exact_name_does_not_match_prefix_siblings():
    model = nn.Sequential()
    for n in ("layer1", "layer10", "layer1x"):
        model.add_module(n, nn.ReLU())
    assert select_layers(SelectConfig(name="layer1"), model, "k") == ["layer1"]


def test_star_matches_every_submodule_but_not_the_root(resnet):
    every = [n for n, _ in resnet.named_modules() if n]
    assert names(resnet, name="*") == every
    assert "" not in names(resnet, name="*")


def test_glob_crosses_dots(resnet):
    got = names(resnet, name="layer1.*")
    assert "layer1.0" in got and "layer1.0.conv1" in got and "layer1" not in got
    assert all(n.startswith("layer1.") for n in got)


def test_or_inside_a_list_and_across_keys(resnet):
    assert names(resnet, name=["layer4", "fc"]) == ["layer4", "fc"]
    convs_in_layer4 = names(resnet, name="layer4.*", type="Conv2d")
    assert convs_in_layer4 == [
        "layer4.0.conv1",
        "layer4.0.conv2",
        "layer4.0.downsample.0",
        "layer4.1.conv1",
        "layer4.1.conv2",
    ]


def test_regex_is_a_full_match(resnet):
    assert names(resnet, regex=r"layer\d\.0") == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    with pytest.raises(HookrunError, match="matches no module"):
        names(resnet, regex=r"layer4\.0\.conv")  # would match as a prefix search


def test_type_short_name_and_dotted_path(resnet):
    assert len(names(resnet, type="BatchNorm2d")) == 20
    blocks = names(resnet, type="torchvision.models.resnet.BasicBlock")
    assert blocks == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]


def test_exclude(resnet):
    got = names(resnet, type="Conv2d", exclude=["*downsample*", "conv1"])
    assert len(got) == 16  # 20 convs: 3 downsample and the stem dropped
    assert not any("downsample" in n for n in got) and "conv1" not in got


def test_input_pseudo_layer_only_by_name(resnet):
    assert names(resnet, name="input") == ["input"]
    assert "input" not in names(resnet, name="*")
    assert names(resnet, name=["input", "fc"]) == ["input", "fc"]


def test_no_match_lists_nearest_names(resnet):
    with pytest.raises(HookrunError) as info:
        names(resnet, name="layer4.0.conv3")
    assert "layer4.0.conv1" in str(info.value) or "layer4.0.conv2" in str(info.value)


def test_empty_select_is_an_error(resnet):
    with pytest.raises(HookrunError, match="give at least one of name, regex, type"):
        names(resnet)


def test_non_module_type_is_an_error(resnet):
    with pytest.raises(HookrunError, match="not a subclass of torch.nn"):
        names(resnet, type="collections.OrderedDict")


def test_a_type_that_matches_nothing_lists_the_types_the_model_has():
    # grad_scale's ReLU selector on a SiLU network: the message says what to select instead.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SiLU(), nn.Flatten())
    with pytest.raises(HookrunError, match="the model's module types: Conv2d, SiLU, Flatten$"):
        names(model, type=["ReLU", "ReLU6"])
