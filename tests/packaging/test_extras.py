"""A missing extra is one line naming the extra and the pip command (the module made
unimportable with sys.modules[name] = None, as when it is not installed); pyproject.toml's
extras are the ones the messages name, and the dev extra refers to them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import compose_config

from hookrun.config.build import build_spec
from hookrun.errors import HookrunError
from hookrun.extras import missing_extra, refuse_missing_launcher
from hookrun.models import sources

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_message_names_what_asked_the_extra_and_the_command():
    assert str(missing_extra("logger=tensorboard", "tensorboard")) == (
        "logger=tensorboard needs the tensorboard extra: pip install 'hookrun[tensorboard]'"
    )
    assert str(missing_extra("model.source: 'timm'", "timm", "model=torchvision")) == (
        "model.source: 'timm' needs the timm extra: pip install 'hookrun[timm]' "
        "(or model=torchvision)"
    )


def test_timm_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(HookrunError) as err:
        sources._timm()
    assert str(err.value) == (
        "model.source: 'timm' needs the timm extra: pip install 'hookrun[timm]' "
        "(or model=torchvision)"
    )


def test_tensorboard_missing_is_refused_before_the_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(HookrunError) as err:
        build_spec(compose_config(["logger=tensorboard"]))
    assert str(err.value) == (
        "logger=tensorboard needs the tensorboard extra: pip install 'hookrun[tensorboard]' "
        "(or logger=null)"
    )
    monkeypatch.delitem(sys.modules, "tensorboard")
    if "tensorboard" in sys.modules or _importable("tensorboard"):
        build_spec(compose_config(["logger=tensorboard"]))  # installed: no refusal


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


@pytest.mark.parametrize(
    ("choice", "module"),
    [
        ("joblib", "hydra_plugins.hydra_joblib_launcher"),
        ("slurm", "hydra_plugins.hydra_submitit_launcher"),
        ("slurm_cpu", "hydra_plugins.hydra_submitit_launcher"),
        ("submitit_local", "hydra_plugins.hydra_submitit_launcher"),
    ],
)
def test_launchers_missing(monkeypatch, choice, module):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(HookrunError) as err:
        refuse_missing_launcher(["-m", f"hydra/launcher={choice}", "seed=0,1"])
    assert str(err.value) == (
        f"hydra/launcher={choice} needs the launchers extra: pip install 'hookrun[launchers]'"
    )
    refuse_missing_launcher(["-m", "hydra/launcher=basic", "seed=0,1"])  # Hydra's own


@pytest.mark.slow  # a hookrun process: ~5 s idle
def test_the_cli_says_it_in_one_line_and_exits_2(tmp_path):
    """The shim as a sitecustomize on PYTHONPATH: `python -m hookrun` as a user runs it."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['tensorboard'] = None\n")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT)])
    out = subprocess.run(
        [sys.executable, "-m", "hookrun", "logger=tensorboard", "hydra.run.dir=out"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr == (
        "hookrun: error: logger=tensorboard needs the tensorboard extra: pip install "
        "'hookrun[tensorboard]' (or logger=null)\n"
    )


def test_every_extra_a_message_names_is_declared_and_dev_refers_to_them():
    extras = PYPROJECT["optional-dependencies"]
    named = set()
    for path in (ROOT / "hookrun").rglob("*.py"):
        text = path.read_text()
        # missing_extra(WHAT, "extra", ...) and require_extra([modules], WHAT, "extra", ...)
        calls = r"_extra\(\s*(?:\[[^\]]*\],\s*)?f?\"[^\"]*\",\s*\"(\w+)\""
        named |= set(re.findall(calls, text))
    named.add("launchers")  # extras.py: missing_extra(f"hydra/launcher={choice}", "launchers")
    assert {"hf", "timm", "xarray", "tensorboard"} <= named
    assert named <= set(extras), named - set(extras)
    (self_ref,) = [r for r in extras["dev"] if r.startswith("hookrun[")]
    referred = set(self_ref[len("hookrun[") : -1].split(","))
    assert referred == set(extras) - {"dev", "bench"}
    copied = {r for name in referred for r in extras[name]} & set(extras["dev"])
    assert not copied, copied  # refer to the extra, don't copy its list


def test_core_dependencies_hold_no_extra():
    core = {re.split(r"[<>=\[ ]", r)[0].lower() for r in PYPROJECT["dependencies"]}
    for name in ("tensorboard", "hydra-joblib-launcher", "hydra-submitit-launcher"):
        assert name not in core
    for extra in ("hf", "timm", "xarray", "tensorboard", "launchers"):
        listed = PYPROJECT["optional-dependencies"][extra]
        reqs = {re.split(r"[<>=\[ ]", r)[0].lower() for r in listed}
        assert not reqs & core, (extra, reqs & core)
