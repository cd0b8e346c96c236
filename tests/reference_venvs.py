"""Virtual environments of their own for references whose pins clash with hookrun's.

SAELens 6.54.0 needs transformer-lens<4 (hookrun's dev extra pins 4.3.0), so it cannot live
in the main venv. `saelens_python()` returns the python of `<repo>/.venv-saelens`, building
it on first use: a venv whose site-packages has a `.pth` line naming the main venv's
site-packages, so torch (~5 GB) is reused rather than downloaded again, while what pip
installs there (sae-lens, transformer-lens 3.x, ...) comes first on sys.path and shadows the
main venv's. Tests only ever run that python in a subprocess: hookrun never imports SAELens.

Run as a script (`python tests/reference_venvs.py`), it builds the venv and prints its
python: .ci/run does that before pytest, so CI pays the build once, visibly.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

__all__ = ["SAELENS", "saelens_python"]

ROOT = Path(__file__).resolve().parents[1]
SAELENS = "sae-lens==6.54.0"
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


def _check(python: Path, torch_dir: Path | None) -> None:
    """sae_lens imports, and (with `torch_dir`) torch is the one found there."""
    out = _run([str(python), "-c", "import sae_lens, torch; print(torch.__file__)"])
    torch_file = Path(out.strip().splitlines()[-1]).resolve()
    if torch_dir is not None and not torch_file.is_relative_to(torch_dir.resolve()):
        raise RuntimeError(f"torch in {python} is {torch_file}, not the main venv's {torch_dir}")


def _build(venv: Path) -> None:
    main_site = Path(sysconfig.get_paths()["purelib"])
    shutil.rmtree(venv, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    (_site_packages(python) / "hookrun-main-venv.pth").write_text(f"{main_site}\n")
    try:
        # pip sees the main venv's torch through the .pth and keeps it; whatever it must
        # change there it installs here instead ("outside environment": never uninstalled).
        _run([str(python), "-m", "pip", "install", "-q", SAELENS])
        _check(python, main_site)
    except RuntimeError as shared:
        # The fallback: a venv of its own with the torch hookrun's constraints pin.
        import torch

        print(f"the shared-torch venv failed ({shared}); building a plain one", file=sys.stderr)
        shutil.rmtree(venv, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(venv)])
        torch_pin = f"torch=={torch.__version__.split('+')[0]}"
        _run([str(python), "-m", "pip", "install", "-q", SAELENS, torch_pin])
        _check(python, None)
    (venv / _READY).write_text(SAELENS + "\n")


def saelens_python() -> Path:
    """The python of `<repo>/.venv-saelens`, with sae-lens 6.54.0 importable.

    Built on first use under a file lock: two pytest-xdist workers asking at once build it
    once (the second waits, then finds it ready).

    Returns:
        The path of the venv's python.

    Raises:
        RuntimeError: a build step failed (its output in the message).
    """
    venv = ROOT / ".venv-saelens"
    python = venv / "bin" / "python"
    with open(ROOT / ".venv-saelens.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not (venv / _READY).exists():
            _build(venv)
    return python


if __name__ == "__main__":
    print(saelens_python())
