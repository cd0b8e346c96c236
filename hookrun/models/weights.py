"""Weights into a model: a torchvision weights name (found offline in a search path of
folders, else through torchvision's hub cache and download), or a state_dict file."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookrun.errors import HookrunError

__all__ = ["find_checkpoint", "load_weights", "sha256_of"]


def _vision_models() -> Any:
    """torchvision.models, imported when a torchvision model is asked for (about 1 s that a
    language-model run never pays)."""
    import torchvision.models

    return torchvision.models


# torchvision names checkpoints `<name>-<sha256 prefix>.pth` (torch.hub's convention).
_HASH_IN_NAME = re.compile(r"-([a-f0-9]{6,})\.")


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def find_checkpoint(filename: str, folders: list[str]) -> Path | None:
    """The first `folders/filename` whose SHA-256 starts with the hash in its name.

    A file whose hash does not match is an error naming it: it is not the file torchvision
    published, and loading it would silently give other numbers.
    """
    match = _HASH_IN_NAME.search(filename)
    for folder in folders:
        path = Path(folder).expanduser() / filename
        if not path.is_file():
            continue
        if match and not sha256_of(path).startswith(match.group(1)):
            raise HookrunError(
                f"weights_path: {path} does not have the SHA-256 prefix {match.group(1)} its "
                "name promises (a partial or different file); replace or remove it"
            )
        return path
    return None


def _torchvision_state_dict(
    model_name: str, weights_name: str, folders: list[str]
) -> tuple[dict, Path]:
    enum = _vision_models().get_model_weights(model_name)
    weights = enum.DEFAULT if weights_name == "DEFAULT" else enum[weights_name]
    filename = os.path.basename(weights.url)
    found = find_checkpoint(filename, folders)
    if found is not None:
        return _file_state_dict(found, "model.weights"), found
    hub = Path(torch.hub.get_dir()) / "checkpoints"
    try:
        # torchvision's own loader: reads the hub cache, downloads only when it is missing.
        return weights.get_state_dict(progress=False, check_hash=True), hub / filename
    except (OSError, RuntimeError) as err:
        first = Path(folders[0]).expanduser() if folders else hub
        searched = ", ".join([*folders, str(hub)])
        raise HookrunError(
            f"model.weights: {weights_name} of {model_name} needs {filename}; it is in none of "
            f"[{searched}] and could not be downloaded ({type(err).__name__}); put the file "
            f"at {first / filename} (from {weights.url})"
        ) from None


def _file_state_dict(path: Path, key: str) -> dict:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types for a bad file
        raise HookrunError(
            f"{key}: {path} is not a readable state_dict file ({type(err).__name__}: "
            f"{(str(err).splitlines() or ['empty or unreadable'])[0][:200]})"
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]  # a training checkpoint that wraps the weights
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise HookrunError(f"{key}: {path} holds a {type(obj).__name__}, not a state_dict")
    return obj


def _load(model: nn.Module, state: dict, label: str, weights: str) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or wrong:
        parts = []
        for name, items in (("missing", missing), ("unexpected", unexpected), ("shape", wrong)):
            if items:
                more = f" (+{len(items) - 3} more)" if len(items) > 3 else ""
                parts.append(f"{name}: {', '.join(items[:3])}{more}")
        raise HookrunError(f"model.weights: {weights} does not fit {label}; {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)


def load_weights(
    model: nn.Module, weights: str, label: str, torchvision_name: str | None, folders: list[str]
) -> Path:
    """Load `weights` (a torchvision weights name of `torchvision_name`, or a file path);
    returns the file the weights came from."""
    names: list[str] = []
    if torchvision_name is not None:
        names = [w.name for w in _vision_models().get_model_weights(torchvision_name)]
        names.append("DEFAULT")
    if weights in names:
        state, path = _torchvision_state_dict(str(torchvision_name), weights, folders)
    else:
        path = Path(weights).expanduser()
        if not path.is_file():
            choices = ", ".join(names) if names else "none for this model"
            raise HookrunError(
                f"model.weights: {weights!r} is neither a file nor a weights name of {label}; "
                f"valid: a path to a state_dict file, null, or a torchvision weights name "
                f"({choices})"
            )
        state = _file_state_dict(path, "model.weights")
    _load(model, state, label, weights)
    return path
