"""Sweeps (joblib, submitit_local), kill -9 then resume, torchrun shards, reproducibility."""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import xarray
from conftest import dimensions_of, hook, hookrun_cli, killed_after, read, run_config, torchrun

from hookrun.errors import HookrunError
from hookrun.io.layout import open_readonly
from hookrun.scale.launchers import with_resume
from hookrun.verify import verify

SEED_MLP_SCALED = [
    "model=seed_mlp",
    "dataset=constant",
    "dataset.shape=[3]",
    "target.kind=sum",
    *hook("s", "relu1", "grad_output", "scale", factor="1,2,3"),
    *hook("x", "input", "grad_output", "capture"),
    "progress=false",
]


def sweep_rows(cwd: Path) -> list[dict]:
    (summary,) = cwd.glob("multirun/*/*/sweep_summary.csv")
    with summary.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
@pytest.mark.slow
def test_sweep_jobs_get_their_own_complete_runs(tmp_path, launcher):
    proc = hookrun_cli(["-m", f"hydra/launcher={launcher}", *SEED_MLP_SCALED], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = sweep_rows(tmp_path)
    assert [r["status"] for r in rows] == ["complete"] * 3
    files = [Path(r["file"]) for r in rows]
    assert len({f.parent for f in files}) == 3
    for factor, path in zip((1, 2, 3), files, strict=True):
        with h5py.File(path) as f:
            assert f.attrs["status"] == "complete"
            assert f"factor: {factor}" in f.attrs["config"]
            got = f["captures/input/grad_output"][()]
        np.testing.assert_array_equal(got, [[22 * factor, 26 * factor, 30 * factor]])


@pytest.mark.slow
def test_a_failing_job_does_not_hide_the_others(tmp_path):
    args = [
        "-m",
        "hydra/launcher=joblib",
        *SEED_MLP_SCALED[:4],
        *hook("s", "relu1,nope", "grad_output", "scale", factor=2),
        *hook("x", "input", "grad_output", "capture"),
        "progress=false",
    ]
    proc = hookrun_cli(args, tmp_path)
    assert proc.returncode == 1  # the sweep says something failed...
    rows = sweep_rows(tmp_path)
    assert [r["status"] for r in rows] == ["complete", "failed"]  # ...and which
    assert "hooks.s.select" in rows[1]["error"]
    assert Path(rows[0]["file"]).is_file()
    (log,) = tmp_path.glob("multirun/*/*/1/*.log")
    assert "Traceback" in log.read_text() and "matches no module" in log.read_text()


def test_requeued_slurm_jobs_resume():
    assert with_resume(["model=resnet18", "resume=false"]) == ["model=resnet18", "resume=true"]
    assert with_resume(["seed=1"]) == ["seed=1", "resume=true"]


KILLABLE = [
    "model=resnet18",
    "model.weights=null",
    "dataset=fake",
    "dataset.size=1600",
    "dataset.image_size=32",
    "batch_size=4",
    *hook("c", "layer1", "output", "capture"),
    *hook("n", "layer2", "output", "noise", std=0.1),
    "progress=false",
    "render=false",
]


@pytest.mark.slow
def test_kill_9_then_resume_gives_the_uninterrupted_bytes(tmp_path):
    reference = read(run_config(tmp_path / "reference", KILLABLE).path)
    run_dir = tmp_path / "killed"
    path = run_dir / "captures.h5"
    args = [*KILLABLE, f"hydra.run.dir={run_dir}"]
    completed = killed_after(KILLABLE, tmp_path, run_dir, 40)
    assert 40 <= completed < 1600, "the run must be killed mid-way"

    with open_readonly(path) as f:  # a killed file opens read-only, rows intact
        done = int(f.attrs["completed"])
        assert f.attrs["status"] == "running" and done >= completed
        for key, expected in reference.items():
            np.testing.assert_array_equal(f[key][:done], expected[:done])

    proc = hookrun_cli([*args, "resume=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = read(path)
    assert resumed.keys() == reference.keys()
    for key in reference:
        assert resumed[key].tobytes() == reference[key].tobytes(), key
    with h5py.File(path) as f:
        assert f.attrs["status"] == "complete" and f.attrs["completed"] == 1600
    # The same dimension names, on the same scales, as the uninterrupted run's.
    named = dimensions_of(path)
    assert named == dimensions_of(tmp_path / "reference" / "captures.h5")
    assert named["captures/layer1/output"] == (
        "/sample",
        "/captures/layer1/channel",
        "/captures/layer1/y",
        "/captures/layer1/x",
    )


def test_resume_starts_missing_keeps_complete_refuses_foreign_and_changed(tmp_path):
    small = ["dataset.size=2", "dataset.image_size=32", "render=false"]
    # A requeued job killed before its file existed starts it (the Slurm preset's requeue).
    started = run_config(tmp_path / "none", [*small, "resume=true"])
    with h5py.File(started.path) as f:
        assert f.attrs["status"] == "complete" and f.attrs["completed"] == 2
    done = run_config(tmp_path / "done", small).path
    # A requeued job that had finished: nothing computed, the file left as it was.
    before = done.read_bytes()
    again = run_config(tmp_path / "done", [*small, "resume=true"])
    assert again.rows == 2 and "is already complete (2 rows): nothing computed" in again.summary
    assert done.read_bytes() == before
    with pytest.raises(HookrunError, match=r"resume: the config differs .* in seed"):
        run_config(tmp_path / "done", [*small, "resume=true", "seed=7"])  # still checked
    foreign = tmp_path / "foreign" / "captures.h5"
    foreign.parent.mkdir()
    with h5py.File(foreign, "w") as f:
        f["x"] = [1, 2]
    with pytest.raises(HookrunError, match=r"resume: .* was not written by hookrun"):
        run_config(tmp_path / "foreign", [*small, "resume=true"])
    with h5py.File(done, "r+") as f:
        f.attrs["status"] = "failed"
    with pytest.raises(HookrunError, match=r"resume: the config differs .* in seed"):
        run_config(tmp_path / "done", [*small, "resume=true", "seed=7"])


@pytest.mark.slow
def test_torchrun_two_processes_read_as_one_file(tmp_path):
    overrides = [
        "model=resnet18",
        "model.weights=null",
        "dataset=fake",
        "dataset.size=10",
        "dataset.image_size=32",
        "batch_size=3",
        "render=false",
        "progress=false",
        *hook("c", "layer1", "output", "capture"),
        *hook("x", "input", "grad_output", "capture"),
    ]
    # conftest.torchrun gives each process one thread; the same for the reference makes
    # every summation order, and so every bit, the same.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = read(run_config(tmp_path / "single", overrides).path)
    finally:
        torch.set_num_threads(threads)
    proc = torchrun(overrides, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (merged,) = tmp_path.glob("outputs/*/*/captures.h5")
    shards = sorted(p.name for p in merged.parent.glob("captures.rank*.h5"))
    assert shards == ["captures.rank0-of-2.h5", "captures.rank1-of-2.h5"]
    with h5py.File(merged) as f:
        assert f["captures/layer1/output"].is_virtual
        assert f.attrs["world_size"] == 2 and f.attrs["status"] == "complete"
        with h5py.File(merged.parent / shards[0]) as s0:
            assert len(s0["samples/index"]) == 6  # two whole batches of 3; rank 1 has 4 rows
    data = read(merged)
    assert data.keys() == single.keys()
    np.testing.assert_array_equal(data["samples/index"], np.arange(10))
    for key in single:
        assert data[key].tobytes() == single[key].tobytes(), key


def test_provenance_attributes(tmp_path):
    path = run_config(
        tmp_path, ["dataset.size=1", "dataset.image_size=32", "render=false", "deterministic=true"]
    ).path
    with h5py.File(path) as f:
        attrs = dict(f.attrs)
    for key in (
        "hookrun_version",
        "torch_version",
        "torchvision_version",
        "h5py_version",
        "hookrun_git_commit",
        "weights_sha256",
        "device",
        "hostname",
        "world_size",
    ):
        assert key in attrs
    assert attrs["device"] == "cpu" and attrs["world_size"] == 1 and attrs["hostname"]


@pytest.mark.parametrize("samples,batch,world", [(10, 3, 2), (7, 2, 4), (5, 4, 3), (100, 8, 3)])
def test_batch_shards_cover_every_sample_once(samples, batch, world):
    from hookrun.scale.distributed import World, batch_shard

    shards = [batch_shard(samples, batch, World(r, world)) for r in range(world)]
    assert [i for s in shards for i in s] == list(range(samples))  # in order, no padding
    assert all(s.start % batch == 0 for s in shards if len(s))  # whole batches only


def test_merge_names_a_missing_shard(tmp_path):
    from hookrun.io.sink import HDF5Sink
    from hookrun.scale.distributed import World, merge_shards, shard_path

    final = tmp_path / "captures.h5"
    with HDF5Sink(shard_path(final, World(0, 2))) as sink:
        sink.write({"samples/index": torch.arange(2)})
    with pytest.raises(HookrunError, match=r"merge: the shard .*captures.rank1-of-2.h5 of rank 1"):
        merge_shards(final, World(0, 2), samples=4, batch_size=2, header={}, replace=False)
    assert not final.exists()


def test_slurm_preset_builds_the_resuming_launcher():
    from conftest import CONF
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from hookrun.scale.launchers import ResumingSlurmLauncher

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher.array_parallelism == 16 and launcher.gpus_per_node == 1
    assert isinstance(instantiate(launcher), ResumingSlurmLauncher)


@pytest.mark.slow
def test_torchrun_joins_per_batch_rows_in_global_batch_order(tmp_path):
    # WindowNet's bias table has no batch axis: one row per batch, in every shard and in
    # the joined file, next to per-sample windows (N, 4, 16, 6).
    overrides = [
        "model=custom",
        "model._target_=models_for_tests.WindowNet",
        "dataset=fake",
        "dataset.size=7",
        "dataset.image_size=8",
        "batch_size=2",
        "render=false",
        "progress=false",
        "experiment=capture",
        *hook("t", "bias", "output", "capture"),  # the experiment captures proj (a Linear)
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[1])] + [os.environ.get("PYTHONPATH", "")]
        ),
    }
    proc = torchrun(overrides, tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (merged,) = tmp_path.glob("outputs/*/*/captures.h5")
    single = hookrun_cli([*overrides, "hydra.run.dir=single"], tmp_path)
    assert single.returncode == 0, single.stderr[-2000:]
    reference = read(tmp_path / "single" / "captures.h5")
    with h5py.File(merged) as f:
        table = f["captures/bias/output"]
        assert table.is_virtual and table.shape == (4, 3, 5)  # batches of 2, 2, 2, 1
        assert table.attrs["per_batch"] == 2
        with h5py.File(merged.parent / "captures.rank0-of-2.h5") as s0:
            assert s0["captures/bias/output"].shape[0] == 2  # rank 0: batches 0 and 1
    data = read(merged)
    assert data.keys() == reference.keys() and data["captures/proj/output"].shape == (7, 4, 16, 6)
    for key in reference:
        np.testing.assert_allclose(data[key], reference[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # The join's virtual datasets carry the single run's dimension names, and xarray reads
    # them aligned on one `sample` axis (tests/io/test_dimensions.py checks the rest).
    assert dimensions_of(merged) == dimensions_of(tmp_path / "single" / "captures.h5")
    assert verify(merged)[0]
    tree = xarray.open_datatree(merged, engine="h5netcdf")
    assert tree["captures/bias/output"].dims == ("batch", "dim_1", "dim_2")
    assert tree["captures/proj/output"].dims == ("sample", "fold", "token", "feature")
    np.testing.assert_array_equal(tree["captures/proj"].sample, np.arange(7))
    np.testing.assert_array_equal(
        tree["captures/proj"].sel(sample=5).output, data["captures/proj/output"][5]
    )
    tree.close()


@pytest.mark.slow
def test_dry_run_estimate_under_torchrun_counts_each_shards_chunks(tmp_path):
    """Each shard is chunked for its own rows: 6 and 4 rows of 200 KiB, 5 rows to a chunk
    for the whole run, make 3 chunks on disk (5+5 and 4), not the 2 one file would hold."""
    overrides = [
        "model=resnet18",
        "model.weights=null",
        "dataset=fake",
        "dataset.size=10",
        "dataset.image_size=112",
        "batch_size=3",
        "render=false",
        "progress=false",
        *hook("c", "layer1", "output", "capture"),
    ]
    dry = torchrun([*overrides, "dry_run=true", "hydra.run.dir=dry"], tmp_path)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "dry run: nothing written" in dry.stdout and not list((tmp_path / "dry").glob("*.h5"))
    number, unit = re.search(r"estimated file size ([\d.]+) (\w+)", dry.stdout).groups()
    estimate = float(number) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    real = torchrun([*overrides, "hydra.run.dir=real"], tmp_path)
    assert real.returncode == 0, real.stderr[-3000:]
    size = sum(p.stat().st_size for p in (tmp_path / "real").glob("captures*.h5"))
    assert len(list((tmp_path / "real").glob("captures*.h5"))) == 3
    assert abs(estimate - size) <= 0.1 * size, (estimate, size)
