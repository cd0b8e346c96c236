"""Install anywhere: the sdist, built into a wheel, installed non-editable into a fresh venv,
runs `python -m hookrun experiment=guided_bp` from a folder that is not the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import h5py

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (args, proc.stdout[-1500:], proc.stderr[-3000:])
    return proc


def test_sdist_to_wheel_installs_and_runs_from_anywhere(tmp_path):
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
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(sdist)], src)
    (wheel,) = dist.glob("hookrun-*.whl")

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    purelib = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            tmp_path,
        ).stdout.strip()
    )
    # The dependencies (torch, hydra, ...) from this environment, after the venv's own
    # site-packages, so the installed wheel is the hookrun that runs.
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([*pip, "install", "--no-deps", "--target", str(purelib), str(wheel)], tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    where = run(
        [str(python), "-c", "import hookrun.api as a; print(a.__file__, a.conf_dir())"],
        elsewhere,
        env,
    )
    module, conf = where.stdout.split()
    assert module.startswith(str(purelib)) and conf == str(purelib / "hookrun" / "conf")
    run(
        [
            str(python),
            "-m",
            "hookrun",
            "experiment=guided_bp",
            "render=false",
            "progress=false",
            "hydra.run.dir=out",
        ],
        elsewhere,
        env,
    )
    with h5py.File(elsewhere / "out" / "captures.h5") as f:
        assert f.attrs["status"] == "complete" and f.attrs["completed"] == 3
