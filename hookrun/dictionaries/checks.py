"""Reading a dictionary's weights file and refusing a bad one, each refusal one line.

Both on-disk formats (SAELens's folders, circuit-tracer's per-layer files) read their
tensors through here, so a missing tensor, a wrong shape or a NaN is worded the same way
whichever format it came in, and is refused before any model runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from hookrun.errors import HookrunError

__all__ = ["read_tensors", "check_tensors"]


def read_tensors(file: Path, key: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, in the file's dtypes, on the CPU.

    Args:
        file: the .safetensors file.
        key: the config key that named it, for messages.

    Returns:
        The tensors by name.

    Raises:
        HookrunError: the file is not a readable safetensors file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise HookrunError(
            f"{key}: {str(file)!r} is not a readable safetensors file ({reason}); "
            "valid: a file safetensors wrote"
        ) from None


def check_tensors(
    tensors: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    file: Path,
    key: str,
) -> None:
    """Refuse a tensor that is missing, of another shape, or not finite.

    Args:
        tensors: the file's tensors, by the names `shapes` uses.
        shapes: each tensor the dictionary needs, and its shape.
        file: the weights file, for messages.
        key: the config key that named it.

    Raises:
        HookrunError: the first tensor that is missing, misshapen or holds NaN or inf.
    """
    for name, shape in shapes.items():
        if name not in tensors:
            raise HookrunError(
                f"{key}: {str(file)!r} has no tensor {name!r}; it has: "
                f"{', '.join(sorted(tensors)) or 'none'}"
            )
        if tuple(tensors[name].shape) != tuple(shape):
            raise HookrunError(
                f"{key}: {str(file)!r}'s tensor {name!r} has shape "
                f"{list(tensors[name].shape)}; valid: {list(shape)}"
            )
        if tensors[name].is_floating_point() and not torch.isfinite(tensors[name]).all():
            raise HookrunError(
                f"{key}: {str(file)!r}'s tensor {name!r} holds NaN or inf; valid: finite weights"
            )
