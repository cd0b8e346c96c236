"""A file stored in bfloat16 (sink.dtype=bfloat16 or a hook's args.dtype=bfloat16) holds each
float as its 16 raw bits (uint16) marked dtype=bfloat16. Every reader inside hookrun must
decode them: read as integers, they are numbers in the tens of thousands. Each test reads a
bfloat16 file through one reader and compares it with the same run stored in float32, the
float32 values rounded to bfloat16 by torch (the reference)."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from conftest import hook, read, resnet18_file, run_config
from PIL import Image

import hookrun
from hookrun.stages.evaluate.ranking import job_means

DIGITS = ["model=digits_cnn", "dataset=digits", "limit=3", "render=false"]


def as_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 as torch rounds them, back as float32."""
    return torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16).float().numpy()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """resnet18's layer3 stored by one run in float32 and by another in bfloat16."""
    root = tmp_path_factory.mktemp("bf16")
    model, overrides = resnet18_file(root, seed=5)
    capture = hook("l3", "layer3", "output", "capture")
    f32 = run_config(root / "f32", [*overrides, *capture]).path
    bf16 = run_config(root / "bf16", [*overrides, *capture, "sink.dtype=bfloat16"]).path
    return model, overrides, f32, bf16


def head(model, layer3: torch.Tensor) -> torch.Tensor:
    """What follows layer3 in torchvision's resnet18."""
    with torch.no_grad():
        return model.fc(torch.flatten(model.avgpool(model.layer4(layer3)), 1))


@pytest.mark.slow
def test_the_stored_bits_are_bfloat16_of_the_float32_run(sources):
    _, _, f32, bf16 = sources
    with h5py.File(bf16) as f:
        ds = f["captures/layer3/output"]
        assert ds.dtype == np.uint16 and ds.attrs["dtype"] == "bfloat16"
        bits = ds[()]
    want = torch.from_numpy(read(f32)["captures/layer3/output"]).to(torch.bfloat16)
    np.testing.assert_array_equal(bits, want.view(torch.uint16).numpy())


@pytest.mark.parametrize("args", [{}, {"reduce": "mean"}, {"row": 1, "mode": "add"}])
@pytest.mark.slow
def test_a_patch_from_a_bfloat16_source_equals_the_float32_source_rounded(sources, tmp_path, args):
    model, overrides, f32, bf16 = sources
    stored = torch.from_numpy(as_bfloat16(read(f32)["captures/layer3/output"]))
    patch = hook("p", "layer3", "output", "patch", file=bf16, **args)
    got = read(run_config(tmp_path, [*overrides, *patch]).path)["model/output"]
    if args.get("reduce") == "mean":
        mean = stored.double().mean(0).float()
        want = head(model, mean.expand(len(stored), *mean.shape))
    elif args.get("mode") == "add":
        # The same images as the source run: layer3 is the source's float32 layer3 there.
        clean = torch.from_numpy(read(f32)["captures/layer3/output"])
        want = head(model, clean + stored[1])
    else:
        want = head(model, stored)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


def test_hookrun_open_reads_bfloat16_as_numbers_and_raw_as_bits(sources):
    _, _, f32, bf16 = sources
    want = as_bfloat16(read(f32)["captures/layer3/output"])
    with hookrun.open(bf16) as res:
        ds = res["captures/layer3/output"]
        assert ds.dtype == np.float32 and ds.shape == want.shape and len(ds) == len(want)
        np.testing.assert_array_equal(ds[()], want)
        np.testing.assert_array_equal(ds[1:3, 0], want[1:3, 0])
        np.testing.assert_array_equal(np.asarray(ds), want)
        np.testing.assert_array_equal(ds.astype(np.float64)[0], want[0].astype(np.float64))
        np.testing.assert_array_equal(np.stack(list(ds)), want)
        np.testing.assert_array_equal(res.capture("layer3", "output")[0], want[0])
        assert ds.raw.dtype == np.uint16  # the bits, for whoever wants them
        # Datasets that are not bfloat16 are h5py's own, as before.
        assert isinstance(res["samples/index"], h5py.Dataset)


def test_to_xarray_reads_bfloat16_as_numbers(sources):
    pytest.importorskip("xarray")
    _, _, f32, bf16 = sources
    want = as_bfloat16(read(f32)["captures/layer3/output"])
    with hookrun.open(bf16) as res:
        tree = res.to_xarray()
        try:
            var = tree["captures/layer3"]["output"]
            assert var.dtype == np.float32
            np.testing.assert_array_equal(var.isel(sample=[1]).values, want[1:2])
            np.testing.assert_array_equal(var.values, want)
            assert "dtype" not in var.attrs  # the values are float32 now
        finally:
            tree.close()


@pytest.mark.slow
def test_the_summary_names_the_float32_top1_classes(tmp_path):
    f32 = run_config(tmp_path / "f32", [*DIGITS, "experiment=saliency"])
    bf16 = run_config(tmp_path / "bf16", [*DIGITS, "experiment=saliency", "sink.dtype=bfloat16"])
    # The digits model's own predictions for the first three digits, stated by the float32 run.
    top = [line.split(" (p=")[0] for line in f32.summary.splitlines() if "top-1" in line]
    assert top == [line.split(" (p=")[0] for line in bf16.summary.splitlines() if "top-1" in line]
    logits = read(f32.path)["model/output"]
    assert [f"  sample {i}: top-1 {int(k)}" for i, k in enumerate(logits.argmax(1))] == top


@pytest.mark.slow
def test_pictures_and_evaluation_means_of_a_bfloat16_run_are_the_float32_runs(tmp_path):
    overrides = [
        "experiment=grad_cam",
        "model=digits_cnn",
        "dataset=digits",
        "limit=2",
        "evaluate=faithfulness",
        "evaluate.deletion.steps=4",
        "evaluate.insertion.steps=4",
        "render=true",
    ]
    f32 = run_config(tmp_path / "f32", overrides)
    bf16 = run_config(tmp_path / "bf16", [*overrides, "sink.dtype=bfloat16"])
    pictures = sorted(p.name for p in f32.images.glob("*.png"))
    assert pictures and pictures == sorted(p.name for p in bf16.images.glob("*.png"))
    for name in pictures:
        a = np.asarray(Image.open(f32.images / name).convert("RGB"), dtype=np.float64)
        b = np.asarray(Image.open(bf16.images / name).convert("RGB"), dtype=np.float64)
        assert a.shape == b.shape, name
        # bfloat16 keeps 8 bits of mantissa: a colour may move a level; raw bits would
        # saturate every picture.
        assert np.abs(a - b).mean() < 2.0, name
    means32, means16 = job_means(f32.path)["means"], job_means(bf16.path)["means"]
    assert means32.keys() == means16.keys() and means32
    for key, value in means32.items():
        assert means16[key] == pytest.approx(value, rel=2e-2, abs=2e-2), key


BF16_KEYS = ["captures/input/output", "captures/input/grad_output", "model/output"]


@pytest.fixture(scope="module")
def digits_bf16(tmp_path_factory):
    """A saliency run of the digits model stored in bfloat16 (input, its gradient and the
    logits are bfloat16), and each bfloat16 dataset's values decoded by hand from its words
    read with plain h5py."""
    root = tmp_path_factory.mktemp("bf16groups")
    path = run_config(root, [*DIGITS, "experiment=saliency", "sink.dtype=bfloat16"]).path
    want = {}
    with h5py.File(path) as f:
        for key in BF16_KEYS:
            words = f[key][()]
            assert words.dtype == np.uint16 and f[key].attrs["dtype"] == "bfloat16"
            want[key] = (words.astype(np.uint32) << 16).view(np.float32)
    assert all(np.any(values != 0) for values in want.values())
    return path, want


def reached(res, key: str) -> dict:
    """The dataset `key` (captures/<layer>/<site> or model/output) by every route a reader
    can take through `hookrun.open`'s groups."""
    group, name = key.rsplit("/", 1)
    top, rest = key.split("/", 1)
    routes = {
        "res[key]": res[key],
        "group[name]": res[group][name],
        "top[rest]": res[top][rest],
        "root[key]": res["/"][key],
        "group.get": res[group].get(name),
        "group.items": dict(res[group].items())[name],
        "group.values": dict(zip(res[group].keys(), res[group].values(), strict=True))[name],
        "parent[name]": res[key].parent[name],
        "group.parent": res[group].parent[group.rsplit("/", 1)[-1]][name],
        "file[key]": res[group].file[key],
    }
    seen = {}
    res[top].visititems(lambda n, o: seen.__setitem__(n, o))
    routes["visititems"] = seen[rest]
    nested = key.split("/")
    step = res[nested[0]]
    for part in nested[1:]:
        step = step[part]
    routes["step by step"] = step
    return routes


@pytest.mark.parametrize("key", BF16_KEYS)
def test_every_route_through_open_s_groups_reads_bfloat16_as_numbers(digits_bf16, key):
    path, wanted = digits_bf16
    want = wanted[key]
    with hookrun.open(path) as res:
        for route, ds in reached(res, key).items():
            assert ds.dtype == np.float32, route
            assert ds.shape == want.shape and len(ds) == len(want) and ds.size == want.size, route
            assert ds.nbytes == want.size * 4 == want.nbytes, route
            np.testing.assert_array_equal(ds[()], want, err_msg=route)
            np.testing.assert_array_equal(ds[...], want, err_msg=route)
            np.testing.assert_array_equal(ds[1:3], want[1:3], err_msg=route)
            np.testing.assert_array_equal(np.asarray(ds), want, err_msg=route)
            np.testing.assert_array_equal(np.stack(list(ds)), want, err_msg=route)
            np.testing.assert_array_equal(ds.astype(np.float64)[0], want[0].astype(np.float64))
            as64 = np.asarray(ds.astype(np.float64))
            np.testing.assert_array_equal(as64, want.astype(np.float64), err_msg=route)
            assert ds.astype(np.float64)[()].dtype == np.float64
            assert ds.raw.dtype == np.uint16, route
            dest = np.zeros(want.shape, np.float32)
            ds.read_direct(dest)
            np.testing.assert_array_equal(dest, want, err_msg=route)
            part = np.zeros((2, *want.shape[1:]), np.float64)
            ds.read_direct(part, np.s_[1:3], np.s_[0:2])
            np.testing.assert_array_equal(part, want[1:3].astype(np.float64), err_msg=route)
            assert bool(ds), route
            assert float(ds.fillvalue) == 0.0 and ds.fillvalue.dtype == np.float32, route


def test_open_s_groups_leave_other_datasets_as_h5py_gives_them(digits_bf16):
    path, _ = digits_bf16
    with h5py.File(path) as f:
        index = f["samples/index"][()]
        scale = f["captures/input/x"][()]
    with hookrun.open(path) as res:
        group = res["samples"]
        assert isinstance(group["index"], h5py.Dataset)
        np.testing.assert_array_equal(group["index"][()], index)
        assert isinstance(res["captures/input"]["x"], h5py.Dataset)
        np.testing.assert_array_equal(res["captures"]["input/x"][()], scale)
        # A group still says what h5py's does.
        names = ["channel", "grad_output", "output", "x", "y"]
        assert sorted(res["captures/input"]) == names
        assert "output" in res["captures/input"] and len(res["captures/input"]) == 5
        assert res["captures/input"].name == "/captures/input"
        assert res["captures"].attrs.keys() == h5py.File(path)["captures"].attrs.keys()
