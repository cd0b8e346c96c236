"""An image site's top patches written as PNG files (PIL, from the file's uint8 arrays)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["write_patch"]


def write_patch(patch: np.ndarray, path: Path) -> None:
    """One receptive-field crop, (3, P, P) uint8 (or (1, P, P): grey), as a PNG.

    Args:
        patch: The crop, channels first.
        path: The PNG to write (its folder made).
    """
    array = np.ascontiguousarray(np.moveaxis(np.asarray(patch, dtype=np.uint8), 0, -1))
    path.parent.mkdir(parents=True, exist_ok=True)
    # (P, P) uint8 is read as grey, (P, P, 3) as RGB.
    Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array[..., :3]).save(path)
