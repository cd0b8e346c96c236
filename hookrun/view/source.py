"""The features file read for the pages: `/features` of a run's captures.h5 (its layout is
the features job's contract, docs/reference/layout.md), checked before any page is written,
then read a block of units at a time so that memory stays bounded by the block, not by the
number of latents.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from hookrun.errors import HookrunError, first_line
from hookrun.io.layout import JOB_ATTR, attr, open_readonly, read_state

__all__ = [
    "CAPTURES_FILE",
    "FEATURES",
    "VOCAB",
    "SiteInfo",
    "Source",
    "open_source",
    "read_block",
]

CAPTURES_FILE = "captures.h5"
# The features job's group, and its vocabulary: each token id's text decoded alone.
FEATURES = "features"
VOCAB = f"{FEATURES}/vocab"
VOCAB_LENGTH = f"{FEATURES}/vocab_length"
# Every per-unit dataset a site may hold (the layout's names, relative to the site's group).
PER_UNIT = (
    "max",
    "density",
    "top/value",
    "top/row",
    "top/token",
    "top/context",
    "top/context_value",
    "top/patch",
    "top/box",
    "quantiles/edges",
    "quantiles/value",
    "quantiles/row",
    "quantiles/token",
    "quantiles/context",
    "quantiles/context_value",
    "histogram/edges",
    "histogram/counts",
    "logits/top_token",
    "logits/top_value",
    "logits/bottom_token",
    "logits/bottom_value",
)
REQUIRED = ("max", "density", "top/value", "top/row", "top/token")
MODALITIES = ("text", "image")


@dataclass(frozen=True)
class SiteInfo:
    """One feature site: its group's attributes and which parts it holds."""

    module: str
    site: str
    group: str  # the HDF5 path of its group
    kind: str  # sae | units
    units: int
    modality: str  # text | image
    dictionary: str
    hook_name: str
    k: int
    window_before: int
    window_after: int
    tokens: int
    rows: int
    grouping: str  # quantiles | intervals: how the sample groups were cut
    parts: tuple[str, ...]  # the PER_UNIT datasets present

    @property
    def title(self) -> str:
        """`module · site`, how the pages name the site."""
        return f"{self.module} · {self.site}"

    def has(self, part: str) -> bool:
        """Whether the site holds the dataset `part` (e.g. `logits/top_token`)."""
        return part in self.parts


@dataclass
class Source:
    """An open features file: its sites and vocabulary (the file stays open)."""

    path: Path
    file: h5py.File
    sites: list[SiteInfo]
    vocab: list[str]


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _int(value: object, default: int = 0) -> int:
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return default


def _site(f: h5py.File, module: str, site: str) -> SiteInfo:
    path = f"{FEATURES}/{module}/{site}"
    group = f[path]
    parts = tuple(p for p in PER_UNIT if isinstance(group.get(p), h5py.Dataset))
    missing = [p for p in REQUIRED if p not in parts]
    if missing:
        raise HookrunError(f"/{path}: no {missing[0]} dataset (a features site holds {REQUIRED})")
    units = group["max"].shape[0]
    for part in parts:
        if group[part].shape[:1] != (units,):
            raise HookrunError(
                f"/{path}/{part}: shape {group[part].shape}, its first axis not the site's "
                f"{units} units"
            )
    modality = _text(attr(group, "modality", "text"))
    if modality not in MODALITIES:
        raise HookrunError(f"/{path} modality {modality!r}: valid choices are {MODALITIES}")
    if {".", ".."} & {*module.split("/"), site}:
        raise HookrunError(f"/{path}: {module!r}/{site!r} cannot name a folder of pages")
    k = group["top/value"].shape[1]
    return SiteInfo(
        module=module,
        site=site,
        group=path,
        kind=_text(attr(group, "kind", "units")),
        units=units,
        modality=modality,
        dictionary=_text(attr(group, "dictionary", "")),
        hook_name=_text(attr(group, "hook_name", "")),
        k=_int(attr(group, "k", k), k),
        window_before=_int(attr(group, "window_before", 0)),
        window_after=_int(attr(group, "window_after", 0)),
        tokens=_int(attr(group, "tokens", 0)),
        rows=_int(attr(group, "rows", 0)),
        grouping=_text(attr(group, "grouping", "quantiles")),
        parts=parts,
    )


def _sites(f: h5py.File) -> list[SiteInfo]:
    """Every group under /features holding `max` and a `top` group: its path less the last
    part is the module (a function site's module has a `/` of its own), the last the site."""
    found: list[tuple[str, str]] = []

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Group) and "max" in obj and isinstance(obj.get("top"), h5py.Group):
            module, _, site = name.rpartition("/")
            if module:
                found.append((module, site))

    f[FEATURES].visititems(visit)
    return [_site(f, module, site) for module, site in found]


def _vocab(f: h5py.File) -> list[str]:
    """Each token id's text: fixed-length UTF-8 as /model/vocabulary is stored, its bytes'
    count in VOCAB_LENGTH (the trailing NULs a fixed-length string drops), or variable-length
    strings."""
    ds = f.get(VOCAB)
    if not isinstance(ds, h5py.Dataset) or ds.dtype.kind not in "SOU":
        return []
    lengths = f.get(VOCAB_LENGTH)
    lengths = lengths[()] if isinstance(lengths, h5py.Dataset) else None
    out = []
    for i, raw in enumerate(ds[()]):
        if isinstance(raw, bytes) and lengths is not None:
            raw = raw.ljust(int(lengths[i]), b"\0")
        out.append(_text(raw))
    return out


def _refuse_run_dir(run_dir: Path) -> Path:
    if not run_dir.exists():
        raise HookrunError(f"RUN_DIR {str(run_dir)!r}: no such folder (a run folder of hookrun)")
    if not run_dir.is_dir():
        raise HookrunError(
            f"RUN_DIR {str(run_dir)!r}: not a folder (give the run folder that holds "
            f"{CAPTURES_FILE})"
        )
    path = run_dir / CAPTURES_FILE
    if not path.is_file():
        raise HookrunError(
            f"RUN_DIR {str(run_dir)!r}: no {CAPTURES_FILE} in it (run experiment=features "
            "there first)"
        )
    return path


@contextmanager
def open_source(run_dir: Path) -> Iterator[Source]:
    """The run folder's features file, opened read-only and checked before any page.

    Args:
        run_dir: The run's folder, which holds captures.h5.

    Yields:
        Its sites and vocabulary, the file open until the block ends.

    Raises:
        HookrunError: a missing folder or file, a file that is not HDF5, has no /features
            group, is not complete, or a site missing a dataset the pages need.
    """
    path = _refuse_run_dir(Path(run_dir))
    try:
        f = open_readonly(path)
    except OSError as err:
        raise HookrunError(f"{path}: not a readable HDF5 file ({first_line(err)})") from None
    try:
        if not isinstance(f.get(FEATURES), h5py.Group):
            job = _text(attr(f, JOB_ATTR, "")) or _text(attr(f, "experiment", "")) or "none"
            raise HookrunError(
                f"{path}: no /{FEATURES} group (job {job!r}): run experiment=features first"
            )
        status = read_state(f).status
        if status != "complete":
            raise HookrunError(
                f"{path}: status {status!r}, not 'complete': the features are whole only once "
                "every row is in (resume=true finishes it), then view it"
            )
        sites = _sites(f)
        if not sites:
            raise HookrunError(
                f"{path}: /{FEATURES} holds no site (/{FEATURES}/<module>/<site>/max): "
                "run experiment=features first"
            )
        vocab = _vocab(f)
        if any(s.modality == "text" for s in sites) and not vocab:
            raise HookrunError(f"{path}: no /{VOCAB} for the text sites' tokens")
        yield Source(path=path, file=f, sites=sites, vocab=vocab)
    finally:
        f.close()


def read_block(source: Source, site: SiteInfo, start: int, stop: int) -> dict[str, np.ndarray]:
    """Every per-unit dataset of `site` for the units `start` to `stop` (exclusive).

    Args:
        source: The open file.
        site: The site.
        start: The first unit.
        stop: One past the last unit.

    Returns:
        The layout's relative name (`top/value`, ...) → its rows for those units.
    """
    group = source.file[site.group]
    return {part: group[part][start:stop] for part in site.parts}
