"""Reproducibility: every seed a run depends on, and where its numbers came from.

Same config + same seed → the same numbers in every dataset: torch, numpy and Python's
`random` are seeded here, DataLoader workers from the loader's generator, and
`deterministic=true` makes PyTorch refuse nondeterministic kernels.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import random
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np
import torch

from hookrun.config.build import RunSpec
from hookrun.io.layout import Provenance
from hookrun.models.weights import sha256_of
from hookrun.version import __version__

__all__ = ["reproducible", "provenance"]


def _torchvision_version() -> str:
    """torchvision's `__version__` (its local build tag too, e.g. 0.29.1+cu130) without
    importing it: a language-model run never loads torchvision (about 1 s)."""
    loaded = sys.modules.get("torchvision")
    if loaded is not None:
        return str(loaded.__version__)
    spec = importlib.util.find_spec("torchvision")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", _text(Path(folder) / "version.py"))
        if found:
            return found.group(1)
    return importlib.metadata.version("torchvision")


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@contextmanager
def reproducible(seed: int, deterministic: bool) -> Iterator[None]:
    """Seed torch, numpy and Python; with `deterministic`, forbid nondeterministic kernels
    for the run, and put PyTorch's determinism switches back as they were afterwards."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    )
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; set before the first matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    try:
        yield
    finally:
        # Only when it moved: torch's switch imports torch._inductor (2.8 s on two busy
        # cores), which a run without it would pay on its way out, also inside the grace
        # a SIGTERM leaves before SIGKILL.
        if before[:2] != (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ):
            torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[2:]


def _git(root: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
    )
    return out.stdout.strip() if out.returncode == 0 else ""


def _git_commit() -> str:
    """The commit of the hookrun checkout this code runs from (+dirty with local changes)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return ""
    try:
        commit = _git(root, "rev-parse", "HEAD")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return ""
    return commit + ("+dirty" if commit and dirty else "")


def provenance(
    spec: RunSpec,
    weights_file: Path | None,
    device: torch.device,
    world_size: int,
    sources: dict[str, dict[str, str]] | None = None,
) -> Provenance:
    """The root attributes of captures.h5: config, versions and where the numbers came from
    (`sources`: files hooks read, e.g. patch's {hook: {file, sha256}})."""
    return Provenance(
        config=spec.config_yaml,
        experiment=spec.experiment or "",
        hookrun_version=__version__,
        hookrun_git_commit=_git_commit(),
        torch_version=str(torch.__version__),
        torchvision_version=_torchvision_version(),
        h5py_version=h5py.__version__,
        seed=spec.seed,
        weights_file=str(weights_file or ""),
        weights_sha256=sha256_of(weights_file) if weights_file else "",
        device=str(device),
        hostname=socket.gethostname(),
        world_size=world_size,
        patch_sources=json.dumps(sources, sort_keys=True) if sources else "",
    )
