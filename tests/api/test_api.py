"""hookrun.run / hookrun.compose: the CLI's results from Python, and the caller's model
returned exactly as it came in."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

import h5py
import models_for_tests as m
import numpy as np
import pytest
import torch
from conftest import hookrun_cli, read
from hydra.core.global_hydra import GlobalHydra
from torch import nn

import hookrun
from hookrun.errors import HookrunError

ROOT = Path(__file__).resolve().parents[2]
SMALL_PHOTOS = ["dataset.resize=64", "dataset.crop=64", "progress=false"]


@pytest.mark.parametrize("experiment", ["guided_bp", "capture"])
@pytest.mark.slow
def test_api_writes_the_bytes_the_cli_writes(tmp_path, experiment):
    overrides = [f"experiment={experiment}", *SMALL_PHOTOS]
    cli = hookrun_cli([*overrides, f"hydra.run.dir={tmp_path / 'cli'}"], cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    result = hookrun.run(overrides, run_dir=tmp_path / "api")
    assert result.path == tmp_path / "api" / "captures.h5" and result.rows == 3
    from_cli, from_api = read(tmp_path / "cli" / "captures.h5"), read(result.path)
    assert from_cli.keys() == from_api.keys() and len(from_cli) > 4
    for key in from_cli:
        assert from_cli[key].dtype == from_api[key].dtype, key
        assert from_cli[key].tobytes() == from_api[key].tobytes(), key
    with result.open() as res:
        assert res.status == "complete" and res.completed == 3
    assert "3 rows" in result.summary and result.run_dir == tmp_path / "api"


def _state(model: nn.Module) -> dict:
    """Everything a run could leave changed on a model."""
    hooks = {}
    for name, module in model.named_modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
            "_state_dict_hooks",
            "_load_state_dict_pre_hooks",
        ):
            hooks[f"{name}.{attr}"] = len(getattr(module, attr, {}) or {})
    return {
        "hooks": hooks,
        "tensor_hooks": {n: len(p._backward_hooks or {}) for n, p in model.named_parameters()},
        "training": {n: mod.training for n, mod in model.named_modules()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "inplace": {n: getattr(mod, "inplace", None) for n, mod in model.named_modules()},
        "devices": {n: str(t.device) for n, t in model.state_dict().items()},
        "state": {n: t.clone() for n, t in model.state_dict().items()},
        "global_hooks": (
            len(torch.nn.modules.module._global_forward_hooks),
            len(torch.nn.modules.module._global_forward_pre_hooks),
            len(torch.nn.modules.module._global_backward_hooks),
        ),
    }


def _assert_same(before: dict, after: dict) -> None:
    for key in ("hooks", "tensor_hooks", "training", "requires_grad", "inplace", "devices"):
        assert before[key] == after[key], key
    assert before["global_hooks"] == after["global_hooks"]
    assert all(v == 0 for v in after["hooks"].values())
    assert before["state"].keys() == after["state"].keys()
    for name, tensor in before["state"].items():
        assert torch.equal(tensor, after["state"][name]), name


def _odd_flags(model: nn.Module) -> nn.Module:
    """A model in training mode with one frozen parameter and one sub-module in eval."""
    model.train()
    children = list(model.children())
    children[0].eval()
    next(model.parameters()).requires_grad_(False)
    return model


GUIDED = ["experiment=guided_bp", "progress=false", "render=false", "model.cam_layer=null"]


def test_callers_model_comes_back_unchanged_after_a_run(tmp_path):
    model = _odd_flags(m.TwiceNet())  # in-place ReLU, modules called twice
    before = _state(model)
    data = [torch.randn(4) for _ in range(5)]
    result = hookrun.run([*GUIDED, "batch_size=2"], model=model, dataset=data, run_dir=tmp_path)
    assert result.rows == 5
    _assert_same(before, _state(model))
    # The selectors applied to the caller's model: its ReLU (called twice) was clamped.
    stored = read(result.path)
    assert stored["captures/input/grad_output"].shape == (5, 4)
    with result.open() as res:
        assert "python" in str(res.config.model.source)


def test_callers_model_comes_back_unchanged_after_a_failing_run(tmp_path):
    model = _odd_flags(m.ExplodingNet())  # raises in the forward pass of batch 2
    before = _state(model)
    data = [torch.randn(4) for _ in range(4)]
    with pytest.raises(RuntimeError, match="boom in batch 2"):
        hookrun.run([*GUIDED, "batch_size=2"], model=model, dataset=data, run_dir=tmp_path)
    _assert_same(before, _state(model))
    with hookrun.open(tmp_path / "captures.h5") as res:
        assert res.status == "failed" and res.completed == 2


def test_two_runs_in_one_process_leave_no_global_state(tmp_path):
    root_handlers = list(logging.getLogger().handlers)
    cwd = os.getcwd()
    overrides = ["model=seed_mlp", "dataset=constant", "dataset.shape=[3]", "target.kind=sum"]
    overrides += ["++hooks.o.select.name=fc1", "++hooks.o.at=output", "++hooks.o.action=capture"]
    first = hookrun.run(overrides, run_dir=tmp_path / "a")
    second = hookrun.run(overrides, run_dir=tmp_path / "b")
    for result in (first, second):
        np.testing.assert_array_equal(read(result.path)["captures/fc1/output"], [[7, -13, 27, -29]])
    assert not GlobalHydra.instance().is_initialized()
    assert os.getcwd() == cwd
    assert logging.getLogger().handlers == root_handlers


def test_dataset_of_labelled_pairs_and_default_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pairs = [(torch.ones(3), i % 2) for i in range(3)]  # the seed input [1, 1, 1]
    overrides = ["model=seed_mlp", "target.kind=sum", "progress=false"]
    overrides += ["++hooks.g.select.name=input", "++hooks.g.at=grad_output"]
    overrides += ["++hooks.g.action=capture"]
    result = hookrun.run(overrides, dataset=pairs)
    assert result.path.is_relative_to(tmp_path / "outputs")
    stored = read(result.path)
    np.testing.assert_array_equal(stored["samples/label"], [0, 1, 0])
    np.testing.assert_array_equal(stored["captures/input/grad_output"], [[22, 26, 30]] * 3)


def test_bad_python_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(HookrunError, match=r"model: a str is not a torch.nn.Module"):
        hookrun.run(["experiment=saliency"], model="resnet18")
    with pytest.raises(HookrunError, match=r"dataset: a list of strings is a language model's"):
        hookrun.run(["experiment=saliency"], dataset=["not an image"], run_dir=tmp_path)
    assert not (tmp_path / "dataset.jsonl").exists()  # refused before anything is written
    with pytest.raises(HookrunError, match=r"experiment"):
        hookrun.run(["experiment=no_such_experiment"])


def test_compose_returns_the_frozen_validated_spec():
    spec = hookrun.compose(["experiment=grad_cam", "limit=2"])
    assert spec.experiment == "grad_cam" and spec.limit == 2
    assert [h.name for h in spec.hooks] == ["photo", "cam_activation", "cam_gradient"]
    assert spec.derive["grad_cam"].layer == "features.18"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.limit = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.sink.path = "elsewhere.h5"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dataset.crop = 10
    with pytest.raises(TypeError):
        spec.model.kwargs["num_classes"] = 10  # read-only mapping
    with pytest.raises(HookrunError, match=r"hooks.photo.action: 'captur' is not an action"):
        hookrun.compose(["experiment=grad_cam", "hooks.photo.action=captur"])


@pytest.mark.slow
def test_readme_from_python_example_runs(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    section = text.split("## From Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2  # images, and a language model
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
    assert len(list(tmp_path.glob("outputs/**/captures.h5"))) >= 4


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"overrides": "experiment=saliency"}, "overrides"),
        ({"overrides": ["experiment=saliency", 5]}, "overrides"),
        ({"overrides": ["experiment=saliency"], "run_dir": 5}, "run_dir"),
    ],
)
def test_api_arguments_of_the_wrong_type_are_refused_naming_them(kwargs, key):
    with pytest.raises(HookrunError, match=rf"^{key}: .*; valid: "):
        hookrun.run(**kwargs)


@pytest.mark.parametrize("where", ["own batch", "within a batch"])
def test_samples_of_another_shape_are_named_not_blamed_on_the_disk(tmp_path, where):
    big, small = torch.randn(3, 32, 32), torch.randn(3, 16, 16)
    data = [big] * 4 + [small] * 2 if where == "own batch" else [big] * 3 + [small] * 3
    overrides = ["model=resnet18", "model.weights=null", "batch_size=2", "render=false"]
    with pytest.raises(HookrunError, match=r"^dataset: .*valid: samples of one shape") as err:
        hookrun.run([*overrides, "experiment=saliency"], dataset=data, run_dir=tmp_path)
    assert "writing" not in str(err.value)
    with h5py.File(tmp_path / "captures.h5") as f:  # the rows before it are kept
        assert f.attrs["completed"] == (4 if where == "own batch" else 2)
