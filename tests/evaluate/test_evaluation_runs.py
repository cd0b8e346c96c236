"""Evaluation as any other result: every bad `evaluate.*` / `sanity.*` value refused in one
line before any work, the dry run's estimate with the new datasets, kill -9 then resume to
the same bytes, torchrun shards joined with the verdicts over every row, hookrun.verify."""

from __future__ import annotations

import re

import h5py
import numpy as np
import pytest
import torch
import xarray
from conftest import compose_config, hookrun_cli, killed_after, read, run_config, torchrun

from hookrun.config.build import build_spec
from hookrun.errors import HookrunError
from hookrun.io.layout import open_readonly
from hookrun.stages.evaluate.ranking import job_means
from hookrun.verify import verify

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

SMALL = [
    "model=resnet18",
    "model.weights=null",
    "dataset=fake",
    "dataset.image_size=32",
    "render=false",
    "progress=false",
]
EVALUATE = [
    "experiment=grad_cam",
    "model.cam_layer=layer3",
    "evaluate=faithfulness",
    "evaluate.deletion.steps=3",
    "evaluate.insertion.steps=3",
    "evaluate.road.fractions=[0.3,0.6]",
    "++sanity.methods=[saliency]",
    "++sanity.layers=[fc,layer4]",
]


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "evaluate.metrics=[deletion,nope]",
            "evaluate.metrics[1]: 'nope' is not a metric; valid: deletion, insertion, road",
        ),
        ("evaluate.reduce=median", "evaluate.reduce: 'median'; valid: abs_sum, sum, max_abs"),
        ("evaluate.deletion.steps=0", "evaluate.deletion.steps: 0 is out of range; valid: >= 1"),
        (
            "evaluate.insertion.baseline=noise",
            "evaluate.insertion.baseline: 'noise'; valid: zeros, blur, mean",
        ),
        (
            "evaluate.road.fractions=[0.5,1.0]",
            "evaluate.road.fractions: 1.0 is out of range; valid: fractions in [0, 1)",
        ),
        ("evaluate.road.noise=-1", "evaluate.road.noise: -1.0; valid: a number >= 0"),
        ("evaluate.rank_by=road", None),
        ("evaluate.batch_size=0", "evaluate.batch_size: 0 is out of range; valid: an integer >= 1"),
        ("+evaluate.stepz=3", "evaluate.stepz: unknown key"),
        (
            "++sanity.methods=[capture]",
            "sanity.methods[0]: 'capture' is not an experiment that makes one attribution; "
            "valid: ablation_cam, attention_rollout, cam, feature_ablation, grad_cam",
        ),
        (
            "++sanity.methods=[logit_lens]",  # a table of tokens, not a map to randomise
            "sanity.methods[0]: 'logit_lens' is not an experiment that makes one attribution; "
            "valid: ablation_cam, attention_rollout, cam, feature_ablation, grad_cam, "
            "grad_cam_pp, grad_scale, guided_bp, guided_grad_cam, integrated_gradients, "
            "kernel_shap, layer_cam, lrp, occlusion, rise, saliency, score_cam, smoothgrad",
        ),
        ("++sanity.mode=sideways", "sanity.mode: 'sideways'; valid: cascading, independent"),
        ("++sanity.threshold=2", "sanity.threshold: 2.0; valid: a number in [-1, 1]"),
        ("++sanity.layers=3", "sanity.layers: 3; valid: auto, or a list of module names"),
        (
            "++sanity.derive.smothgrad.samples=3",
            "sanity.derive.smothgrad: 'smothgrad' is not a method; valid: grad_cam",
        ),
        ("target.kind=sum", "target.kind: 'sum' has no class for evaluate"),
    ],
)
def test_bad_values_stop_before_any_work_in_one_line(override, message):
    args = ["experiment=grad_cam", "evaluate=faithfulness", override]
    if override == "evaluate.rank_by=road":
        args.append("evaluate.metrics=[deletion]")
        message = "evaluate.rank_by: 'road' is not computed; valid: deletion"
    with pytest.raises(HookrunError) as err:
        build_spec(compose_config(args))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["experiment=grad_cam", "evaluate.of=[derived/grad_cam/layer9]"],
            "evaluate.of[0]: 'derived/grad_cam/layer9' is not an attribution this run makes; "
            "valid: derived/grad_cam/layer3",
        ),
        (["experiment=capture"], "evaluate: the run makes no attribution to evaluate; valid: none"),
        (
            ["experiment=sanity_check", "++sanity.layers=[fc,nope]"],
            "sanity.layers[1]: 'nope' is not a module",
        ),
        (
            ["experiment=sanity_check", "++sanity.layers=[relu]"],
            "sanity.layers[0]: 'relu' has no parameters",
        ),
    ],
)
def test_what_needs_the_model_is_refused_before_the_file(tmp_path, args, message):
    evaluate = [] if "experiment=sanity_check" in args else ["evaluate=faithfulness"]
    overrides = [*SMALL, "dataset.size=2", "model.cam_layer=layer3", *evaluate, *args]
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path, overrides)
    assert str(err.value).startswith(message)
    assert not (tmp_path / "captures.h5").exists()


@pytest.mark.slow
def test_the_cli_says_it_in_one_line_with_exit_2(tmp_path):
    proc = hookrun_cli(
        ["experiment=saliency", "evaluate=faithfulness", "evaluate.reduce=x"], tmp_path
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "hookrun: error: evaluate.reduce: 'x'; valid: abs_sum, sum, max_abs"
    ]


UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def test_the_dry_run_lists_and_counts_the_new_datasets(tmp_path):
    args = [*SMALL, *EVALUATE, "dataset.size=40", "batch_size=8", "++sanity.keep_maps=true"]
    dry = run_config(tmp_path / "dry", [*args, "dry_run=true"])
    assert "/evaluate/road/derived/grad_cam/layer3.score" in dry.plan_text
    assert re.search(r"\[3, 32, 32\] .* /sanity/saliency/maps", dry.plan_text)
    assert "Sanity check (cascading) randomises: fc, layer4" in dry.plan_text
    number, unit = re.search(r"estimated file size ([\d.]+) (\w+)", dry.plan_text).groups()
    path = run_config(tmp_path / "real", args).path
    assert abs(float(number) * UNITS[unit] - path.stat().st_size) <= 0.05 * path.stat().st_size


def attributes(path) -> dict:
    """Every group's and dataset's attributes, by path."""
    out = {}
    with open_readonly(path) as f:
        f.visititems(lambda n, o: out.__setitem__(n, {k: str(v) for k, v in o.attrs.items()}))
    return out


@pytest.mark.slow
def test_kill_9_then_resume_gives_the_same_bytes_and_verdicts(tmp_path):
    args = [*SMALL, *EVALUATE, "dataset.size=48", "batch_size=4"]
    reference = run_config(tmp_path / "reference", args).path
    run_dir = tmp_path / "killed"
    seen = killed_after(args, tmp_path, run_dir, 8)
    assert seen < 48, "the run must be killed mid-way"
    proc = hookrun_cli([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed, expected = read(run_dir / "captures.h5"), read(reference)
    assert resumed.keys() == expected.keys()
    assert any(k.startswith("evaluate/road_morf") for k in expected)
    for key in expected:
        assert resumed[key].tobytes() == expected[key].tobytes(), key
    assert attributes(run_dir / "captures.h5") == attributes(reference)
    assert attributes(reference)["sanity/saliency"].keys() == {"passed", "score"}
    assert verify(run_dir / "captures.h5")[0]
    with h5py.File(reference, "r+") as f:  # a complete file without its verdict is damaged
        del f["sanity/saliency"].attrs["passed"]
    ok, lines = verify(reference)
    assert not ok and "  damaged: /sanity/saliency: no verdict (attributes passed, score)" in lines


@pytest.mark.slow
def test_torchrun_shards_join_with_verdicts_over_every_row(tmp_path):
    args = [*SMALL, *EVALUATE, "dataset.size=10", "batch_size=3"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun process: the same summation order
    try:
        single = run_config(tmp_path / "single", args).path
    finally:
        torch.set_num_threads(threads)
    proc = torchrun(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (merged,) = tmp_path.glob("outputs/*/*/captures.h5")
    with h5py.File(merged) as f:
        assert f["evaluate/road/derived/grad_cam/layer3.score"].is_virtual
    joined, expected = read(merged), read(single)
    assert joined.keys() == expected.keys()
    for key in expected:
        assert joined[key].tobytes() == expected[key].tobytes(), key
    assert attributes(merged) == attributes(single)  # verdicts over all 10 rows, not a shard's
    assert verify(merged)[0]
    means = job_means(merged)["means"]
    score = np.mean(expected["evaluate/road/derived/grad_cam/layer3.score"].astype(np.float64))
    assert means["road:derived/grad_cam/layer3"] == score


def test_evaluation_and_sanity_axes_are_named_on_the_one_sample_dimension(tmp_path):
    """xarray reads /evaluate and /sanity aligned on `sample` (issue 21's names): a curve's
    columns are `fraction`, the sanity check's `step`, its maps `step y x`."""
    path = run_config(tmp_path, [*SMALL, *EVALUATE, "limit=3", "batch_size=2"]).path
    tree = xarray.open_datatree(path, engine="h5netcdf")
    dims = {
        f"{node.path}/{name}": var.dims
        for node in tree.subtree
        for name, var in node.data_vars.items()
    }
    tree.close()
    evaluate = {k: v for k, v in dims.items() if k.startswith("/evaluate/")}
    sanity = {k: v for k, v in dims.items() if k.startswith("/sanity/")}
    assert evaluate and sanity
    for key, names in evaluate.items():
        rest = () if key.endswith((".auc", ".score")) else ("fraction",)
        assert names == ("sample", *rest), key
    for key, names in sanity.items():
        assert names == (
            ("sample", "step", "y", "x") if key.endswith("/maps") else ("sample", "step")
        ), key
    assert not [k for k, v in dims.items() if any(d.startswith("phony") for d in v)]
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["sample"][()], f["samples/index"][()])
