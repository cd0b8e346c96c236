"""Named dimensions: a captures.h5 opens in xarray (`open_datatree(engine="h5netcdf")`) with
every axis named, no phony dimension anywhere, and every per-sample dataset on the one
`sample` dimension whose coordinate is the dataset indices. The reference for every value
is the file read with plain h5py; the names are the ones the issue asks for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import xarray
from any_models import images
from conftest import dimensions_of, run_config
from models_for_tests import WindowNet
from torch import nn

import hookrun
from hookrun.errors import HookrunError
from hookrun.io import dimensions, layout
from hookrun.io.dimensions import read_names
from hookrun.io.sink import HDF5Sink, SinkOptions
from hookrun.verify import verify

GRAD_CAM = [
    "experiment=grad_cam",
    "model=resnet18",
    "dataset=fake",
    "dataset.image_size=64",
    "batch_size=2",
    "render=false",
]


def _variables(tree: xarray.DataTree) -> dict[str, xarray.DataArray]:
    """Every data variable of the tree, by its HDF5 path."""
    return {
        f"{node.path.strip('/')}/{name}".lstrip("/"): node[name]
        for node in tree.subtree
        for name in node.data_vars
    }


def _check_tree(path, names: dict[str, tuple[str, ...]]) -> xarray.DataTree:
    """Open `path` as a user would and check what the issue promises; `names`: some
    datasets' expected dimension names."""
    tree = xarray.open_datatree(path, engine="h5netcdf")
    found = _variables(tree)
    with h5py.File(path, "r") as f:
        index = f["samples/index"][()]
        np.testing.assert_array_equal(tree["/"].sample.values, index)
        expected = set(layout.dataset_names(f)) - {"sample"}
        assert set(found) == expected
        for key, var in found.items():
            assert not any(d.startswith("phony_dim") for d in var.dims), (key, var.dims)
            assert len(var.dims) == f[key].ndim
            if not layout.per_batch(f[key]):
                assert var.dims[0] == "sample", key
                np.testing.assert_array_equal(var.sample.values, index)
            # The bytes xarray reads are the ones h5py reads.
            assert var.values.tobytes() == f[key][()].tobytes(), key
    for key, want in names.items():
        assert found[key].dims == want, key
    return tree


@pytest.mark.slow
def test_a_grad_cam_run_opens_aligned_on_sample(tmp_path):
    path = run_config(tmp_path / "many", [*GRAD_CAM, "dataset.size=5"]).path
    tree = _check_tree(
        path,
        {
            "captures/input/output": ("sample", "channel", "y", "x"),
            "captures/layer4/output": ("sample", "channel", "y", "x"),
            "captures/layer4/grad_output": ("sample", "channel", "y", "x"),
            "derived/grad_cam/layer4": ("sample", "y", "x"),
            "model/output": ("sample", "class"),
            "samples/index": ("sample",),
            "samples/target": ("sample",),
            "samples/label": ("sample",),
        },
    )
    with h5py.File(path, "r") as f:
        cam = f["derived/grad_cam/layer4"][3]
        top = f["model/output"][3]
    # "The Grad-CAM map, the target and the logits of sample 3", by label, not by hand.
    np.testing.assert_array_equal(tree["derived/grad_cam"].sel(sample=3)["layer4"], cam)
    np.testing.assert_array_equal(tree["model"].sel(sample=3)["output"], top)
    assert tree["captures/layer4"].sizes == {"sample": 5, "channel": 512, "y": 2, "x": 2}
    tree.close()
    assert verify(path)[0]
    with hookrun.open(path) as res:  # the file's own listing is unchanged by the names
        assert set(res.layers) == {"input", "layer4"}
        assert res.derived == {"grad_cam": {"layer4": (5, 2, 2)}}
        one = res.to_xarray()
        assert one["samples"].index.dims == ("sample",)
        one.close()

    single = run_config(tmp_path / "one", [*GRAD_CAM, "dataset.size=1"]).path
    _check_tree(single, {"derived/grad_cam/layer4": ("sample", "y", "x")}).close()
    assert dimensions_of(single) == dimensions_of(path)  # the same scales, 1 row or 5


def test_rows_per_batch_and_folded_rows_have_their_own_axes(tmp_path):
    xs = images(8, n=5)  # batches of 2, 2 and 1
    overrides = ["experiment=capture", "batch_size=2", "progress=false"]
    overrides += ["++hooks.t.select.name=bias", "++hooks.t.at=output", "++hooks.t.action=capture"]
    result = hookrun.run(overrides, model=WindowNet(), dataset=xs, run_dir=tmp_path)
    tree = _check_tree(
        result.path,
        {
            "captures/bias/output": ("batch", "dim_1", "dim_2"),
            "captures/proj/output": ("sample", "fold", "token", "feature"),
            "captures/conv/output": ("sample", "channel", "y", "x"),
            "captures/head/output": ("sample", "feature"),
        },
    )
    assert tree["captures/bias"].sizes["batch"] == 3
    assert tree["captures/proj"].sizes == {"sample": 5, "fold": 4, "token": 16, "feature": 6}
    tree.close()
    assert verify(result.path)[0]


def _sink(path, records: dict[str, np.ndarray], axes: dimensions.AxisFacts | None = None) -> None:
    with HDF5Sink(path, SinkOptions(axes=axes or dimensions.AxisFacts())) as sink:
        sink.write(records)


def test_unknown_datasets_get_dim_k_and_a_table_entry_names_them(tmp_path, monkeypatch):
    index = np.arange(3, dtype=np.int64)
    scores = np.ones((3, 5), np.float32)
    records = {layout.SAMPLES_INDEX: index, "extra/deletion/auc": scores}
    _sink(tmp_path / "plain.h5", records)
    with h5py.File(tmp_path / "plain.h5") as f:
        assert read_names(f)["extra/deletion/auc"] == ("sample", "dim_1")
    # Another branch's group is one line in the table.
    monkeypatch.setitem(dimensions.AXES, "extra/*/*", "sample step")
    _sink(tmp_path / "named.h5", records)
    tree = xarray.open_datatree(tmp_path / "named.h5", engine="h5netcdf")
    assert tree["extra/deletion"].auc.dims == ("sample", "step")
    tree.close()


def test_one_name_with_two_sizes_along_groups_gets_its_size(tmp_path):
    """xarray's DataTree wants one size per name in a group and the groups above it: a
    module's own output and a function call inside it, two tensors of one site."""
    n = 2
    records = {
        layout.SAMPLES_INDEX: np.arange(n, dtype=np.int64),
        "captures/block/output": np.zeros((n, 8, 4, 4), np.float32),
        "captures/block/output_1": np.zeros((n, 3, 2, 2), np.float32),
        "captures/block/gelu.0/output": np.zeros((n, 5, 4, 4), np.float32),
    }
    nchw = dimensions.LAYOUT_AXES["nchw"]
    facts = dimensions.AxisFacts(nchw, {k: nchw for k in records if k.startswith("captures")})
    _sink(tmp_path / "f.h5", records, facts)
    tree = xarray.open_datatree(tmp_path / "f.h5", engine="h5netcdf")  # aligned, or it raises
    assert tree["captures/block"].output.dims == ("sample", "channel", "y", "x")
    assert tree["captures/block"].output_1.dims == ("sample", "channel_3", "y_2", "x_2")
    assert tree["captures/block/gelu.0"].output.dims == ("sample", "channel_5", "y", "x")
    tree.close()


def test_verify_checks_the_names_and_old_files_still_pass(tmp_path):
    path = run_config(tmp_path, [*GRAD_CAM, "dataset.size=2"]).path
    with h5py.File(path, "r+") as f:
        ds = f["derived/grad_cam/layer4"]
        ds.dims[1].detach_scale(ds.dims[1][0])
        f["sample"][1] = 7
    ok, lines = verify(path)
    assert not ok
    assert "  damaged: derived/grad_cam/layer4: axis 1 has no dimension name" in lines
    assert "  damaged: /sample: its values are not /samples/index's" in lines
    legacy = Path(__file__).resolve().parents[1] / "data" / "legacy_grad_cam.h5"
    assert verify(legacy)[0]  # hookrun 0.1.0 named no axes: nothing to check, nothing wrong


@pytest.mark.slow
def test_to_xarray_without_the_extra_says_how_to_install_it(tmp_path, monkeypatch):
    path = run_config(tmp_path, [*GRAD_CAM, "dataset.size=1"]).path
    monkeypatch.setitem(sys.modules, "xarray", None)
    with hookrun.open(path) as res, pytest.raises(HookrunError) as err:
        res.to_xarray()
    assert str(err.value) == "to_xarray() needs the xarray extra: pip install 'hookrun[xarray]'"


@pytest.mark.slow
def test_a_killed_writers_file_opens_in_xarray(tmp_path):
    """A file still marked open by its SWMR writer, killed: to_xarray reads it as h5py does
    (with swmr=True), names and all."""
    path = run_config(tmp_path, [*GRAD_CAM, "dataset.size=2"]).path
    kill = (
        "import h5py, os, signal, sys\n"
        "f = h5py.File(sys.argv[1], 'r+', libver='latest')\n"
        "f.swmr_mode = True\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    subprocess.run([sys.executable, "-c", kill, str(path)], check=False)
    with pytest.raises(OSError):
        h5py.File(path, "r").close()  # HDF5 still marks it open for writing
    with hookrun.open(path) as res:
        tree = res.to_xarray()
        assert tree["derived/grad_cam"].layer4.dims == ("sample", "y", "x")
        np.testing.assert_array_equal(tree["/"].sample, [0, 1])
        tree.close()


class _Tokens(nn.Module):
    """Token ids (T,) → an embedding per token (T, D) → a class score from their mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.proj = nn.Embedding(10, 4), nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(ids)).mean(1)


def test_a_sequence_of_token_ids_names_tokens_and_features(tmp_path):
    ids = [torch.randint(10, (5,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    hooks = ["++hooks.e.select.name=emb", "++hooks.e.at=output", "++hooks.e.action=capture"]
    overrides = ["target.kind=none", "render=false", "progress=false", *hooks]
    result = hookrun.run(overrides, model=_Tokens(), dataset=ids, run_dir=tmp_path)
    _check_tree(
        result.path,
        {
            "captures/emb/output": ("sample", "token", "feature"),
            "model/output": ("sample", "class"),
        },
    ).close()
