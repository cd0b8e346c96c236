"""The whole view written: checks first, then every page into a fresh folder beside the
target, swapped in only once complete, so a view killed halfway leaves the old one whole.

The target may be missing, empty, or a view this module wrote before (it holds MARKER);
any other folder is refused, since its files belong to someone else.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hookrun.errors import HookrunError
from hookrun.view.assets import CSS, CSS_FILE, JS, JS_FILE
from hookrun.view.feature import feature_html, top_patches
from hookrun.view.images import write_patch
from hookrun.view.index import IndexRow, index_html, index_row
from hookrun.view.paths import INDEX, VIEW_DIR, feature_file
from hookrun.view.source import Source, open_source, read_block
from hookrun.view.text import TokenTexts

__all__ = ["MARKER", "BLOCK", "ViewResult", "write_view", "check_out"]

# The file that says a folder is a view this module wrote (and may replace).
MARKER = ".hookrun-view"
BLOCK = 256  # units read at a time: memory bounded by a block, whatever the dictionary's size


@dataclass(frozen=True)
class ViewResult:
    """What `write_view` wrote."""

    index: Path
    sites: int
    pages: int


def check_out(out: Path) -> None:
    """Refuse a target folder that is neither missing, empty, nor a view written here.

    Args:
        out: The view's folder.

    Raises:
        HookrunError: `out` is a file, or a folder of someone else's files.
    """
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise HookrunError(f"--out {str(out)!r}: exists and is not a folder; name another")
    if any(out.iterdir()) and not (out / MARKER).is_file():
        raise HookrunError(
            f"--out {str(out)!r}: a folder of other files (no {MARKER}: not a view written by "
            "hookrun.view); name a new or empty folder, or remove it"
        )


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one step (Linux renameat2 RENAME_EXCHANGE); False where the
    system or the file system cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    rename = getattr(libc, "renameat2", None)
    if rename is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    done = rename(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _swap_in(tmp: Path, out: Path) -> None:
    if not out.exists() and not out.is_symlink():
        os.rename(tmp, out)
        return
    if _exchange(tmp, out):
        shutil.rmtree(tmp)  # the old view, now under the temporary name
        return
    # Two renames: between them `out` is missing for a moment, the old view whole beside it.
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, old / VIEW_DIR)
    os.rename(tmp, out)
    shutil.rmtree(old)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_site(source: Source, texts: TokenTexts, site, root: Path) -> list[IndexRow]:
    rows: list[IndexRow] = []
    for start in range(0, site.units, BLOCK):
        stop = min(start + BLOCK, site.units)
        block = read_block(source, site, start, stop)
        for i in range(stop - start):
            unit = start + i
            data = {name: values[i] for name, values in block.items()}
            path = feature_file(root, site.module, site.site, unit)
            path.parent.mkdir(parents=True, exist_ok=True)
            for rank in top_patches(site, unit, data):
                write_patch(data["top/patch"][rank], path.parent / str(unit) / f"top-{rank}.png")
            path.write_text(feature_html(texts, site, unit, data), encoding="utf-8")
            rows.append(index_row(texts, site, unit, data))
    return rows


def write_view(run_dir: Path, out: Path | None = None) -> ViewResult:
    """Write the static site of a features run: `index.html` and one page per unit.

    Args:
        run_dir: The run's folder (its captures.h5 holds /features).
        out: The view's folder; default `<run_dir>/view`.

    Returns:
        The index's path, the number of sites and of unit pages.

    Raises:
        HookrunError: bad input (see `open_source`, `check_out`), before any page is written.
    """
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / VIEW_DIR
    with open_source(run_dir) as source:
        check_out(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0o700 would hide it from a server
            texts = TokenTexts(source.vocab)
            (tmp / MARKER).write_text(f"written by python -m hookrun.view from {source.path}\n")
            (tmp / CSS_FILE).write_text(CSS, encoding="utf-8")
            (tmp / JS_FILE).write_text(JS, encoding="utf-8")
            tables = [(site, _write_site(source, texts, site, tmp)) for site in source.sites]
            title = run_dir.resolve().name
            (tmp / INDEX).write_text(index_html(title, tables), encoding="utf-8")
            _swap_in(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    pages = sum(site.units for site in source.sites)
    return ViewResult(index=out / INDEX, sites=len(source.sites), pages=pages)
