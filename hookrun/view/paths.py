"""Where each page of a view lies: stable paths other stages may link to.

A feature's page is `features/<module>/<site>/<unit>.html` under the view's folder (by
default `<run dir>/view/`), the module's name kept as the file spells it, dots and all
(`features/transformer.h.1/output/12.html`). These paths are a contract: the circuit and
patching pictures may link to a feature by them, so they never change between versions.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from urllib.parse import quote

__all__ = [
    "VIEW_DIR",
    "INDEX",
    "FEATURES_DIR",
    "feature_page",
    "feature_file",
    "patch_page_relative",
    "to_root",
]

# The view's folder inside a run folder, its index page, and the folder of feature pages.
VIEW_DIR = "view"
INDEX = "index.html"
FEATURES_DIR = "features"


def _part(name: str) -> str:
    # Percent-encoded so that any character a module's name holds survives in a URL; the
    # names PyTorch gives (letters, digits, `_`, `.`) come out unchanged. A `/` (a function
    # site's `<module>/<function>.<k>`) stays a folder, on disk as in the URL.
    return "/".join(quote(part, safe="") for part in name.split("/"))


def feature_page(module: str, site: str, unit: int) -> str:
    """The URL of a unit's page, relative to the view's folder (POSIX, percent-encoded).

    `feature_page("transformer.h.1", "output", 12)` is
    `"features/transformer.h.1/output/12.html"` (a function site's module,
    `transformer.h.1/matmul.0`, is one folder more); from another page of the same view, or from
    a picture beside the view's folder, join it to the relative path of that folder
    (`"view/" + feature_page(...)` from the run folder).

    Args:
        module: The module's path as the features file names its group (dots kept).
        site: `input` or `output`.
        unit: The unit's (latent's, neuron's, channel's) index.

    Returns:
        The page's relative URL.
    """
    return f"{FEATURES_DIR}/{_part(module)}/{_part(site)}/{int(unit)}.html"


def feature_file(view_dir: Path, module: str, site: str, unit: int) -> Path:
    """The file of a unit's page on disk inside `view_dir` (names not percent-encoded).

    Args:
        view_dir: The view's folder.
        module: The module's path (dots kept).
        site: `input` or `output`.
        unit: The unit's index.

    Returns:
        The page's path.
    """
    return Path(view_dir) / FEATURES_DIR / module / site / f"{int(unit)}.html"


def patch_page_relative(unit: int, rank: int) -> str:
    """An image site's top patch, relative to its unit's page: `<unit>/top-<rank>.png`."""
    return f"{int(unit)}/top-{int(rank)}.png"


def to_root(page: str) -> str:
    """The relative URL from a page (a path under the view's folder) back to that folder."""
    depth = posixpath.dirname(page).count("/") + 1 if posixpath.dirname(page) else 0
    return "../" * depth
