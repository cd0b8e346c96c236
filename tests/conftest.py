"""Shared helpers: compose the real config tree and run it in-process."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from PIL import Image

from hookrun.config.build import build_spec
from hookrun.config.schema import register_configs
from hookrun.io.layout import is_dimension, open_readonly
from hookrun.pipeline.finish import Result
from hookrun.pipeline.runner import execute
from hookrun.runtime.hookspec import HookSpec

CONF = Path(__file__).resolve().parents[1] / "conf"
TESTS = Path(__file__).resolve().parent
register_configs()

# The seed MLP on its one input [1, 1, 1] (tests/seeds/README.md).
SEED_MLP = ["model=seed_mlp", "dataset=constant", "dataset.shape=[3]", "dataset.size=1"]
SEED_CONVNET = ["model=seed_convnet", "dataset=constant", "dataset.shape=[1,4,4]", "dataset.size=1"]


def hook(name: str, select: str, at: str, action: str, **args: float) -> list[str]:
    """Command-line overrides that add one hook (as a user would type them)."""
    key = "name" if not select.startswith("type=") else "type"
    value = select.removeprefix("type=")
    out = [
        f"++hooks.{name}.select.{key}={value}",
        f"++hooks.{name}.at={at}",
        f"++hooks.{name}.action={action}",
    ]
    out += [f"++hooks.{name}.args.{k}={v}" for k, v in args.items()]
    return out


def hookrun_cli(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m hookrun ARGS` in a subprocess, as a user runs it (tests/ importable for
    `model._target_=models_for_tests...`, no HYDRA_FULL_ERROR)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    # tests/ importable, in front of whatever PYTHONPATH already says (a worktree's hookrun).
    paths = [str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return subprocess.run(
        [sys.executable, "-m", "hookrun", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def run_config(tmp_path: Path, overrides: list[str], experiment: str | None = None) -> Result:
    """Run like `python -m hookrun OVERRIDES`, with the file in `tmp_path`."""
    cfg = compose_config([*overrides, "progress=false"])
    return execute(build_spec(cfg, experiment), tmp_path)


def specs(hooks: dict) -> tuple[HookSpec, ...]:
    """{name: HookConfig} → the HookSpecs a plan is compiled from."""
    return tuple(HookSpec.from_config(name, cfg) for name, cfg in hooks.items())


def read(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of an HDF5 file that holds data, by path (not the empty datasets that
    only name a dimension: `dimensions_of` compares those)."""
    out: dict[str, np.ndarray] = {}

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset) and not is_dimension(obj):
            out[name] = obj[()]

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return out


def dimensions_of(path: Path) -> dict[str, tuple]:
    """Every dataset's dimensions as HDF5 stores them: the path of the scale attached to
    each axis (None where none is), read with plain h5py, not hookrun."""
    out: dict[str, tuple] = {}

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset) and not obj.is_scale:
            out[name] = tuple(d[0].name if len(d) else None for d in obj.dims)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return out


@pytest.fixture
def run_hookrun(tmp_path: Path):
    """run_hookrun(overrides) → (Result, datasets of its captures.h5)."""
    counter = iter(range(1000))

    def _run(overrides: list[str]) -> tuple[Result, dict[str, np.ndarray]]:
        result = run_config(tmp_path / f"run{next(counter)}", overrides)
        return result, (read(result.path) if result.path else {})

    return _run


def resnet18_file(folder: Path, seed: int) -> tuple:
    """A resnet18 (10 classes) with seeded random weights saved to a file, and the overrides
    that run it on 3 small fake images: (model, overrides)."""
    import torch
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=10).eval()
    torch.save(model.state_dict(), folder / "resnet18.pt")
    overrides = [
        "model=resnet18",
        f"model.weights={folder / 'resnet18.pt'}",
        "+model.kwargs.num_classes=10",
        "dataset=fake",
        "dataset.size=3",
        "dataset.image_size=32",
        "dataset.num_classes=10",
        "batch_size=2",
        "render=false",
    ]
    return model, overrides


def photo_folder(root: Path, count: int) -> list[str]:
    """`count` small PNGs in two class folders, names of several lengths and one non-ASCII
    letter; the files in dataset order, worked out here from the folder (classes sorted,
    files sorted within each), as absolute paths."""
    rng = np.random.default_rng(1)
    for i in range(count):
        folder = root / ("cats" if i % 2 else "dogs")
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{'é' * (i % 3)}{i:0{1 + i % 4}d}.png"
        Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(folder / name)
    return [
        os.path.abspath(folder / name)
        for folder in sorted(p for p in root.iterdir())
        for name in sorted(os.listdir(folder))
    ]


def folder_resnet(root: Path, pixels: int, batch_size: int) -> list[str]:
    """Overrides that run a random resnet18 over the image folder `root` at `pixels` px,
    capturing layer1's output (no pictures)."""
    return [
        "model=resnet18",
        "model.weights=null",
        "dataset=image_folder",
        f"dataset.root={root}",
        f"dataset.resize={pixels}",
        f"dataset.crop={pixels}",
        f"batch_size={batch_size}",
        "render=false",
        "progress=false",
        *hook("c", "layer1", "output", "capture"),
    ]


def spawn(args: list[str], cwd: Path, limit_bytes: int | None = None) -> subprocess.Popen:
    """`python -m hookrun ARGS` as a user starts it; with `limit_bytes`, under `ulimit -f`
    with SIGXFSZ ignored, so a write past the limit fails with EFBIG instead of killing."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS), env.get("PYTHONPATH", "")] if p)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return subprocess.Popen(
        [sys.executable, "-m", "hookrun", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limit if limit_bytes else None,
    )


def wait_rows(proc: subprocess.Popen, path: Path, rows: int, timeout: float = 120) -> int:
    """Poll the running file until `completed` reaches `rows`; the rows seen."""
    completed, deadline = 0, time.monotonic() + timeout
    while completed < rows and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
        try:
            with open_readonly(path) as f:
                completed = int(f.attrs["completed"])
        except (OSError, KeyError):
            pass  # not created yet, or not yet in SWMR mode
    return completed


def killed_after(args: list[str], cwd: Path, run_dir: Path, rows: int) -> int:
    """`python -m hookrun ARGS` into `run_dir`, SIGKILLed once its file holds `rows` rows;
    the rows seen before the kill."""
    proc = spawn([*args, f"hydra.run.dir={run_dir}"], cwd)
    seen = wait_rows(proc, run_dir / "captures.h5", rows)
    proc.kill()
    proc.wait()
    assert seen >= rows
    return seen


# One thread in each torchrun process, as the one-thread runs its bytes are compared with.
# torchrun sets OMP_NUM_THREADS=1 only when the caller's environment has none, and torch
# takes its thread count from MKL_NUM_THREADS before OMP_NUM_THREADS: a shell that sets
# either (common on a shared, busy machine) changes every summation order.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def torchrun(
    overrides: list[str], cwd: Path, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=2 -m hookrun OVERRIDES`, to its end, with one
    thread in each process."""
    args = ["--standalone", "--nproc_per_node=2", "-m", "hookrun", *overrides]
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**(os.environ if env is None else env), **ONE_THREAD},
    )
