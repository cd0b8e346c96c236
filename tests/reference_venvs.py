"""Virtual environments of their own for references whose pins clash with hookrun's.

SAELens 6.54.0 needs transformer-lens<4 (hookrun's dev extra pins 4.3.0), so it cannot live
in the main venv. `saelens_python()` returns the python of `<repo>/.venv-saelens`, building
it on first use: a venv whose site-packages has a `.pth` line naming the main venv's
site-packages, so torch (~5 GB) is reused rather than downloaded again, while what pip
installs there (sae-lens, transformer-lens 3.x, ...) comes first on sys.path and shadows the
main venv's. Tests only ever run that python in a subprocess: hookrun never imports SAELens.

SAEDashboard 0.8.0 (the feature dashboards' reference, tests/features) pins
transformer-lens<3, transformers<4.57, datasets<4 and jaxtyping<0.3, all older than what
.venv-saelens holds (transformer-lens 3.9, transformers 5.x), so `saedashboard_python()`
builds a second venv the same way, `<repo>/.venv-saedashboard`, with sae-lens pinned to the
same 6.54.0. transformer-lens 2.x pins numpy<2, and the main venv's pyarrow (which
`datasets` imports) refuses a numpy 1: pyarrow<22 (built for numpy 1 and 2) goes there too.

LXT 2.1 (AttnLRP's reference, tests/lm/test_attnlrp.py) installs from an sdist and adds only
bitsandbytes, open_clip_torch, tabulate, ftfy and wcwidth next to the main venv's torch and
transformers: `lxt_python()` builds `<repo>/.venv-lxt` the same way, so it never enters the
main venv.

circuit-tracer 0.5.0 (the attribution graphs' reference, tests/graph) pins
transformers<=4.57.3 and huggingface-hub<1 against the main venv's transformers 5:
`circuit_tracer_python()` builds `<repo>/.venv-circuit-tracer` the same way, with
transformer-lens held below 4 (the main venv's 4.3 wants transformers 5, so pip would pick a
3.x anyway; the pin keeps the pick from drifting). numpy 2 and pyarrow are the main venv's:
transformer-lens 3 accepts numpy 2, so no pyarrow pin is needed here.

Run as a script (`python tests/reference_venvs.py`), it builds the venvs and prints their
pythons: .ci/run does that before pytest, so CI pays the builds once, visibly.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

__all__ = [
    "CIRCUIT_TRACER", "LXT", "SAEDASHBOARD", "SAELENS", "circuit_tracer_python", "lxt_python",
    "saedashboard_python", "saelens_python",
]  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]
SAELENS = "sae-lens==6.54.0"
# What .venv-saedashboard installs: SAEDashboard with the SAELens the other venv holds, and a
# pyarrow that accepts the numpy 1 transformer-lens 2.x pins (the main venv's wants numpy 2).
SAEDASHBOARD = ("sae-dashboard==0.8.0", SAELENS, "pyarrow<22")
LXT = "lxt==2.1"
# What .venv-circuit-tracer installs: circuit-tracer with a transformer-lens that still takes
# transformers 4 (circuit-tracer needs >=2.16; 4.x needs transformers 5).
CIRCUIT_TRACER = ("circuit-tracer==0.5.0", "transformer-lens>=2.16,<4")
# Written last, once the checks passed: a venv without it was left half built (a killed
# build, a failed pip) and is built again.
_READY = ".hookrun-ready"


def _run(args: list[str]) -> str:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return done.stdout


def _site_packages(python: Path) -> Path:
    out = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    return Path(out.strip())


def _check(python: Path, torch_dir: Path | None, module: str) -> None:
    """`module` imports, and (with `torch_dir`) torch is the one found there."""
    out = _run([str(python), "-c", f"import {module}, torch; print(torch.__file__)"])
    torch_file = Path(out.strip().splitlines()[-1]).resolve()
    if torch_dir is not None and not torch_file.is_relative_to(torch_dir.resolve()):
        raise RuntimeError(f"torch in {python} is {torch_file}, not the main venv's {torch_dir}")


def _build(venv: Path, requirements: tuple[str, ...], module: str) -> None:
    main_site = Path(sysconfig.get_paths()["purelib"])
    shutil.rmtree(venv, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    (_site_packages(python) / "hookrun-main-venv.pth").write_text(f"{main_site}\n")
    try:
        # pip sees the main venv's torch through the .pth and keeps it; whatever it must
        # change there it installs here instead ("outside environment": never uninstalled).
        _run([str(python), "-m", "pip", "install", "-q", *requirements])
        _check(python, main_site, module)
    except RuntimeError as shared:
        # The fallback: a venv of its own with the torch hookrun's constraints pin.
        import torch

        print(f"the shared-torch venv failed ({shared}); building a plain one", file=sys.stderr)
        shutil.rmtree(venv, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(venv)])
        torch_pin = f"torch=={torch.__version__.split('+')[0]}"
        _run([str(python), "-m", "pip", "install", "-q", *requirements, torch_pin])
        _check(python, None, module)
    (venv / _READY).write_text(_marker(requirements))


def _marker(requirements: tuple[str, ...]) -> str:
    return "".join(f"{r}\n" for r in requirements)


def _venv_python(name: str, requirements: tuple[str, ...], module: str) -> Path:
    """The python of `<repo>/<name>`, built first unless its ready marker names exactly
    `requirements` (a venv of other pins, or half built, is built again), under a file
    lock: two pytest-xdist workers asking at once build it once (the second waits, then
    finds it ready)."""
    venv = ROOT / name
    with open(ROOT / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        ready = venv / _READY
        if not ready.exists() or ready.read_text() != _marker(requirements):
            _build(venv, requirements, module)
    return venv / "bin" / "python"


def saelens_python() -> Path:
    """The python of `<repo>/.venv-saelens`, with sae-lens 6.54.0 importable.

    Built on first use under a file lock: two pytest-xdist workers asking at once build it
    once (the second waits, then finds it ready).

    Returns:
        The path of the venv's python.

    Raises:
        RuntimeError: a build step failed (its output in the message).
    """
    return _venv_python(".venv-saelens", (SAELENS,), "sae_lens")


def saedashboard_python() -> Path:
    """The python of `<repo>/.venv-saedashboard`, with sae-dashboard 0.8.0 and sae-lens
    6.54.0 importable; built on first use as `saelens_python`'s.

    Returns:
        The path of the venv's python.

    Raises:
        RuntimeError: a build step failed (its output in the message).
    """
    return _venv_python(".venv-saedashboard", SAEDASHBOARD, "sae_dashboard.sae_vis_runner")


def lxt_python() -> Path:
    """The python of `<repo>/.venv-lxt`, with lxt 2.1 importable; built on first use as
    `saelens_python`'s.

    Returns:
        The path of the venv's python.

    Raises:
        RuntimeError: a build step failed (its output in the message).
    """
    return _venv_python(".venv-lxt", (LXT,), "lxt")


def circuit_tracer_python() -> Path:
    """The python of `<repo>/.venv-circuit-tracer`, with circuit-tracer 0.5.0 (transformers
    4.57, transformer-lens 3.x, nnsight) importable; built on first use as `saelens_python`'s.

    Returns:
        The path of the venv's python.

    Raises:
        RuntimeError: a build step failed (its output in the message).
    """
    return _venv_python(".venv-circuit-tracer", CIRCUIT_TRACER, "circuit_tracer")


if __name__ == "__main__":
    print(saelens_python())
    print(saedashboard_python())
    print(lxt_python())
    print(circuit_tracer_python())
