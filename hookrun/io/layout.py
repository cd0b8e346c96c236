"""The captures.h5 layout — the one module that spells its core paths and reads and writes
attributes (the README's "captures.h5" table is the user's copy): /captures/<layer>/<site>,
/samples/*, /model/output, /derived/<method>/<layer>, and /sample, the `sample` dimension's
coordinate. A stage's own group (/evaluate, /sanity, /patching, /induction) is named in the
stage's keys module and read and written through the helpers here (`attr`, `set_attrs`).
Every axis is a named dimension (io/dimensions.py attaches the scales).

Root attributes: the provenance fields below, then `error`, `status` (running → complete |
failed | interrupted; running until every row and every whole-run dataset is in) and
`completed` (rows written *and flushed*, never ahead of the data). Captures not stored one
row per sample carry PER_BATCH or FOLDED, whole-run datasets WRITTEN (below).

Crash safety (io/appender.py appends the rows): SWMR mode once the first batch's datasets
exist, a flush every batch; a killed writer's file opens read-only (`open_readonly`) with
every row up to `completed` intact, and io/stored.py copies them into a fresh file.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hookrun.io import storage
from hookrun.io.storage import CHUNK_BYTES, chunk_shape, open_readonly

__all__ = [
    "LISTED_POSITIONS",
    "CHUNK_BYTES", "CAPTURES", "SAMPLES", "DERIVED", "SAMPLES_INDEX", "SAMPLES_LABEL",
    "SAMPLES_TARGET", "SAMPLES_COUNTER_TARGET", "SAMPLES_PATH", "SAMPLES_TOKENS",
    "SAMPLES_MASK", "SAMPLES_LINE",
    "mark_bfloat16", "is_bfloat16", "marks_bfloat16",
    "without_bfloat16_mark", "read_paths", "MODEL_OUTPUT", "INPUT_PHOTO", "INPUT_GRAD",
    "Provenance", "FileState", "PER_BATCH", "FOLDED", "per_batch", "folded", "rows_for",
    "rows_note", "copy_attrs", "drop_scale_attrs", "capture_key", "derived_key", "gap_key",
    "GAP_SUFFIX", "chunk_shape", "open_readonly", "read_state", "read_provenance",
    "dataset_names", "write_header", "mark_status", "mark_completed", "mark_rows",
    "mark_complete", "SAMPLE", "NOT_A_VARIABLE", "SCALE_ATTRS", "is_dimension",
    "write_attrs", "copy_group_attrs", "pattern_key", "WHOLE_RUN", "whole_run",
    "attr", "has_attrs", "set_attrs", "modify_attrs", "WRITTEN", "is_whole_run",
    "mark_pending", "mark_written", "is_pending", "pending", "MODEL_VOCABULARY",
    "vocabulary_arrays", "read_vocabulary", "MODEL_VOCABULARY_LENGTH",
    "SPARSE", "SPARSE_ROWS", "SPARSE_COUNTS", "SPARSE_VALUES", "SPARSE_LATENT",
    "SPARSE_PARTS", "mark_sparse", "sparse_spec", "sparse_groups", "sparse_part",
    "sparse_entries", "SAE", "layer_of", "splice_key",
]  # fmt: skip

# The groups of captured tensors, of each row's facts, and of derived results.
CAPTURES, SAMPLES, DERIVED = "captures", "samples", "derived"
# A capture of listed positions (args.positions: [i, ...], (N, P, ...)): its attribute, the list.
LISTED_POSITIONS = "positions"
SAMPLES_INDEX = "samples/index"
SAMPLES_LABEL = "samples/label"
SAMPLES_TARGET = "samples/target"
# target.kind=logit_diff: the token whose logit is subtracted (the counterfactual answer).
SAMPLES_COUNTER_TARGET = "samples/counterfactual_target"
SAMPLES_PATH = "samples/path"
SAMPLES_TOKENS = "samples/tokens"  # token ids (N, T) of token data
SAMPLES_MASK = "samples/mask"  # (N, T) bool, True at real tokens, when rows are padded
SAMPLES_LINE = "samples/line"  # token data: each row's 1-based line in its /samples/path file
# (dataset=hf_disk: its 0-based row in the /samples/path folder)
MODEL_OUTPUT = "model/output"
# Token data: each token id's text as the run's tokenizer decodes it alone (V,) UTF-8, so the
# summary and the pictures label tokens from the file (a caller's tokenizer, another machine).
MODEL_VOCABULARY = "model/vocabulary"
MODEL_VOCABULARY_LENGTH = "model/vocabulary_length"  # each text's UTF-8 bytes


def capture_key(
    layer: str,
    site: str,
    call: int = 0,
    tensor: int = 0,
    n_tensors: int = 1,
    leaf: str | None = None,
) -> str:
    """The HDF5 path of one captured tensor.

    `/captures/<layer>/<site>`; a module with several floating-point tensors at a site gets
    `_<i>` per tensor, a structured output (dict, namedtuple, ModelOutput) `.<key>` per leaf
    (`leaf` is that suffix, runtime/leaves.py), and every call of a module after its first in
    one forward pass gets `.call<k>` (ResNet blocks call their one ReLU twice).
    """
    site = getattr(site, "value", site)
    if site == PATTERN and "/" in layer:  # the attention module's softmax call k
        module, call_site = layer.rsplit("/", 1)
        return pattern_key(module, int(call_site.rsplit(".", 1)[1]))
    part = leaf if leaf is not None else (f"_{tensor}" if n_tensors > 1 else "")
    name = f"{site}{part}" + (f".call{call}" if call else "")
    return f"{CAPTURES}/{layer}/{name}"


PATTERN = "pattern"
# The root attribute of a file a stage's job of its own wrote instead of rows (Stage.job:
# `train_sae`); such a file has no /samples or /model/output.
JOB_ATTR = "job"

# A dictionary spliced into a site (runtime/splice.py) records beside it, under its own group.
SAE = "sae"


def layer_of(key: str) -> str:
    """The <layer> of a capture path `captures/<layer>/<site>` (a function site's layer holds
    a `/`: `<module>/<function>.<k>`)."""
    return key.split("/", 1)[1].rsplit("/", 1)[0]


def splice_key(site: str, output: str) -> str:
    """`/sae/<layer>/<site>/<output>`: what a dictionary spliced at the capture path `site`
    records (latents, reconstruction, error)."""
    return f"{SAE}/{site.split('/', 1)[1]}/{output}"


def pattern_key(module: str, call: int = 0) -> str:
    """`/captures/<module>/pattern`: an attention module's probabilities (N, heads, query,
    key), from its softmax call `call` of one forward (`.call<k>` after the first)."""
    return f"{CAPTURES}/{module}/{PATTERN}" + (f".call{call}" if call else "")


def derived_key(method: str, layer: str) -> str:
    """The HDF5 path of one derived result."""
    return f"{DERIVED}/{method}/{layer}"


GAP_SUFFIX = ".completeness_gap"


def gap_key(method: str, layer: str) -> str:
    """The path of a result's completeness gap (N,): Σ attributions − (f(x) − f(baseline))."""
    return f"{derived_key(method, layer)}{GAP_SUFFIX}"


# Dataset attributes of captures not stored one row per sample (runtime/shape_probe.py): a tensor
# with no batch axis has one row per batch of PER_BATCH samples (the last may be shorter);
# one with k rows per sample folded into the batch axis is stored (N, k, ...), FOLDED = k.
PER_BATCH = "per_batch"
FOLDED = "folded_rows"


def per_batch(ds: h5py.Dataset) -> int:
    """The batch size of a dataset stored one row per batch; 0 for one row per sample."""
    return int(ds.attrs.get(PER_BATCH, 0))


def folded(ds: h5py.Dataset) -> int:
    """The rows per sample a dataset stored (N, k, ...) folds (0: not folded)."""
    return int(ds.attrs.get(FOLDED, 0))


# A sparse record (io/sparse.py: SAE latents, ~32 of 16k non-zero per token) is a GROUP at
# its path P holding P/counts (N, *lead) int32, each row's non-zeros per token, one row per
# sample; P/values (nnz,) and P/latent (nnz,) int32, the non-zeros and their index along the
# last axis, in row-major order. No offsets are stored: row i's entries start at
# sum(counts[:i]), so a file's first `completed` rows hold sum(counts[:completed]) entries and
# the torchrun join concatenates shards as they are. The group says what it is in its
# attributes (made before SWMR): SPARSE = SPARSE_ROWS, `shape` (the dense per-sample shape)
# and `dims` (the dense axes' names, the sample axis first).
SPARSE, SPARSE_ROWS = "sparse", "rows"
SPARSE_COUNTS, SPARSE_VALUES, SPARSE_LATENT = "counts", "values", "latent"
SPARSE_PARTS = (SPARSE_COUNTS, SPARSE_VALUES, SPARSE_LATENT)


def mark_sparse(group: h5py.Group, shape: tuple[int, ...], dims: tuple[str, ...]) -> None:
    """A new group as a sparse record of dense per-sample `shape`, axes `dims` (before SWMR)."""
    group.attrs.update(
        {SPARSE: SPARSE_ROWS, "shape": np.asarray(shape, dtype=np.int64), "dims": list(dims)}
    )


def sparse_spec(obj: Any) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """(dense per-sample shape, axis names) of a sparse record's group; None for anything
    else (a dataset, a plain group)."""
    if not isinstance(obj, h5py.Group) or obj.attrs.get(SPARSE) != SPARSE_ROWS:
        return None
    dims = tuple(str(d.decode() if isinstance(d, bytes) else d) for d in obj.attrs["dims"])
    return tuple(int(n) for n in obj.attrs["shape"]), dims


def sparse_groups(f: h5py.File) -> list[str]:
    """Every sparse record's group path in `f`."""
    found: list[str] = []
    f.visititems(lambda n, o: found.append(n) if sparse_spec(o) is not None else None)
    return found


def sparse_part(ds: h5py.Dataset) -> str | None:
    """Which part of a sparse record `ds` is (SPARSE_COUNTS, _VALUES, _LATENT); None when
    it is no part of one."""
    name = ds.name.rsplit("/", 1)[-1]
    if name not in SPARSE_PARTS or sparse_spec(ds.parent) is None:
        return None
    return name


def sparse_entries(group: h5py.Group, completed: int) -> int:
    """The entries (values, latent) a sparse record's first `completed` rows hold."""
    counts = group[SPARSE_COUNTS]
    return int(counts[: min(completed, len(counts))].sum(dtype=np.int64)) if completed else 0


# Datasets of a whole run, with no sample axis (a stage's result over every row, e.g. the
# induction score per head): path → registered.
WHOLE_RUN: set[str] = set()

# A whole-run dataset a stage computes once every row is in the file (its `finish`) is made
# with the file, holding its fill value, with WRITTEN = 0; once the stage's values are in it
# and flushed, WRITTEN = 1. A file is marked complete only when none says 0. A dataset without
# the attribute was written whole when it was made (files of hookrun before the mark).
WRITTEN = "written"


def whole_run(*paths: str) -> None:
    """Register datasets a stage writes once for the whole run (no sample axis): paths, or
    fnmatch patterns (`*` crosses `/`) for those named at run time."""
    WHOLE_RUN.update(paths)


def is_whole_run(ds: h5py.Dataset) -> bool:
    """Whether `ds` is a dataset of the whole run (no sample axis): registered, or made to
    be written once every row is in (it carries WRITTEN)."""
    name = ds.name.lstrip("/")
    return WRITTEN in ds.attrs or any(fnmatch.fnmatchcase(name, p) for p in WHOLE_RUN)


def mark_pending(ds: h5py.Dataset) -> None:
    """A new whole-run dataset holds no values yet (before SWMR: the attribute is new)."""
    ds.attrs[WRITTEN] = np.int8(0)


def mark_written(ds: h5py.Dataset) -> None:
    """A whole-run dataset's values are in the file and flushed (in place: SWMR allows it)."""
    ds.attrs.modify(WRITTEN, np.int8(1))


def is_pending(ds: h5py.Dataset) -> bool:
    """Whether a whole-run dataset still waits for its values (WRITTEN = 0)."""
    return int(ds.attrs.get(WRITTEN, 1)) == 0


def pending(f: h5py.File) -> list[str]:
    """The whole-run datasets of `f` that wait for their values, by path."""
    return [name for name in dataset_names(f) if is_pending(f[name])]


whole_run(MODEL_VOCABULARY, MODEL_VOCABULARY_LENGTH)


def vocabulary_arrays(texts: list[str]) -> dict[str, np.ndarray]:
    """Texts as the file stores them: /model/vocabulary, fixed-length UTF-8 (checksummed:
    HDF5 filters no variable-length data, which takes no NUL either), and each text's length
    in bytes, /model/vocabulary_length: a fixed-length string loses its trailing NULs, and
    every byte-level BPE vocabulary has a token that decodes to a NUL."""
    encoded = [t.encode("utf-8", errors="surrogateescape") for t in texts]
    width = max((len(e) for e in encoded), default=1) or 1
    return {
        MODEL_VOCABULARY: np.array(encoded, dtype=f"S{width}"),
        MODEL_VOCABULARY_LENGTH: np.array([len(e) for e in encoded], dtype=np.int32),
    }


def read_vocabulary(f: h5py.File, ids: Any) -> list[str | None] | None:
    """The texts of token `ids` from /model/vocabulary (None for an id past it), reading
    only those; None for a file without one."""
    if MODEL_VOCABULARY not in f:
        return None
    ds = f[MODEL_VOCABULARY]
    wanted = [int(i) for i in np.asarray(ids).reshape(-1)]
    inside = sorted({i for i in wanted if 0 <= i < len(ds)})
    texts = ds[inside] if inside else []
    lengths = (
        f[MODEL_VOCABULARY_LENGTH][inside] if inside and MODEL_VOCABULARY_LENGTH in f else None
    )
    found = {}
    for n, (i, raw) in enumerate(zip(inside, texts, strict=True)):
        raw = bytes(raw)
        if lengths is not None:  # the trailing NULs numpy's fixed-length strings drop
            raw = raw.ljust(int(lengths[n]), b"\0")
        found[i] = raw.decode("utf-8", errors="replace")
    return [found.get(i) for i in wanted]


def rows_for(ds: h5py.Dataset, completed: int) -> int:
    """The rows `ds` holds once `completed` samples are: one per sample, or one per batch
    (a whole-run dataset holds the rows it has: it has no sample axis); a sparse record's
    values and latent hold the entries of its first `completed` rows."""
    if is_whole_run(ds):
        return ds.shape[0]
    if sparse_part(ds) in (SPARSE_VALUES, SPARSE_LATENT):  # entries, not rows
        return sparse_entries(ds.parent, completed)
    size = per_batch(ds)
    return -(-completed // size) if size else completed


def rows_note(ds: h5py.Dataset) -> str:
    """How a dataset's rows map to samples, when not one row per sample ('' otherwise)."""
    if per_batch(ds):
        return f"one row per batch of {per_batch(ds)} samples (no batch axis)"
    fold = folded(ds)
    return f"axis 1: the {fold} rows per sample folded into the batch axis" if fold else ""


def copy_attrs(src: h5py.HLObject, dst: h5py.HLObject) -> None:
    """A file's or dataset's attributes onto its copy (a resumed file, the torchrun join), less
    the dimension-scale ones: they point into `src`'s file (the copy gets its own scales)."""
    for name, value in src.attrs.items():
        if name not in SCALE_ATTRS:
            dst.attrs[name] = value


def drop_scale_attrs(ds: h5py.Dataset) -> None:
    """The dimension-scale attributes off a dataset copied whole from another file (h5py's
    `copy` keeps them, pointing into that file); `attach` gives it this file's own."""
    for name in SCALE_ATTRS:
        if name in ds.attrs:
            del ds.attrs[name]


def read_paths(f: h5py.File) -> list[str] | None:
    """The source file of each complete row, or None for a dataset not read from files."""
    if SAMPLES_PATH not in f:
        return None
    return [str(p) for p in f[SAMPLES_PATH].asstr(errors="surrogateescape")[: _state(f).completed]]


# The model input's pseudo-layer: the batch itself, and the input gradient.
INPUT_PHOTO = capture_key("input", "output")
INPUT_GRAD = capture_key("input", "grad_output")


@dataclass(frozen=True)
class Provenance:
    """The root attributes that say where the numbers came from (written once, at creation)."""

    config: str  # the resolved config, YAML
    experiment: str
    hookrun_version: str
    hookrun_git_commit: str
    torch_version: str
    torchvision_version: str
    h5py_version: str
    seed: int
    weights_file: str
    weights_sha256: str
    device: str
    hostname: str
    world_size: int
    # sha256 over the source files' (path, size, label), for file datasets ("" otherwise)
    data_files_sha256: str = ""
    # Modules a glob/type/regex selector matched that never ran: "hook: a, b; hook2: c".
    never_ran: str = ""
    # Files read during the run (the `patch` action), JSON {hook: {file, sha256}}; "" if none.
    patch_sources: str = ""
    # Where each module ran under model.device_map (Accelerate's map: JSON {module: device,
    # "cpu" or "disk"}); "" for a model on one device.
    device_map: str = ""


@dataclass(frozen=True)
class FileState:
    """What a captures.h5 says about itself."""

    status: str | None
    completed: int
    config: str | None
    experiment: str
    error: str
    never_ran: str = ""


def _state(f: h5py.File) -> FileState:
    attrs, config, status = f.attrs, f.attrs.get("config"), f.attrs.get("status")
    return FileState(
        status=None if status is None else str(status),
        completed=int(attrs.get("completed", 0)),
        config=None if config is None else str(config),
        experiment=str(attrs.get("experiment", "")),
        error=str(attrs.get("error", "")),
        never_ran=str(attrs.get("never_ran", "")),
    )


def read_state(source: Path | h5py.File) -> FileState:
    """A file's status, rows, config and experiment; OSError when rows it counts are missing."""
    if isinstance(source, h5py.File):
        return _state(source)
    with open_readonly(source) as f:
        state = _state(f)
        size = Path(source).stat().st_size
        for ds in (f[name] for name in dataset_names(f) if not is_pending(f[name])):
            reason = storage.missing_rows([ds], rows_for(ds, state.completed), size)
            if reason:
                raise OSError(reason)
    return state


def read_provenance(path: Path) -> dict[str, str]:
    """The provenance attributes a file records, as text (absent ones left out)."""
    names = [field.name for field in dataclasses.fields(Provenance)]
    with open_readonly(path) as f:
        return {n: str(f.attrs[n]) for n in names if n in f.attrs}


def dataset_names(f: h5py.File) -> list[str]:
    """Every data-holding dataset's path (not the empty ones that only name a dimension)."""
    names: list[str] = []

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and not is_dimension(obj):
            names.append(name)

    f.visititems(visit)
    return names


def write_header(f: h5py.File, header: Provenance | Mapping[str, Any]) -> None:
    """The provenance attributes (or any mapping of them) onto a new file."""
    f.attrs.update(dataclasses.asdict(header) if isinstance(header, Provenance) else header)


def mark_status(f: h5py.File, status: str, error: str = "") -> None:
    """The file's `status` (running, complete, failed, interrupted) and its `error`."""
    f.attrs.update({"error": error, "status": status})


def mark_completed(f: h5py.File, rows: int) -> None:
    """`completed`: the rows written; set only once they are flushed, never ahead of them."""
    f.attrs["completed"] = rows


def mark_rows(ds: h5py.Dataset, fold: int, batch_size: int) -> None:
    """How a new dataset's rows map to samples (`fold` as FOLDED; 0: per batch), before SWMR."""
    if fold != 1:
        ds.attrs[PER_BATCH if fold == 0 else FOLDED] = batch_size if fold == 0 else fold


def mark_bfloat16(ds: h5py.Dataset) -> None:
    ds.attrs["dtype"] = "bfloat16"  # its uint16 values are bfloat16 bits (io/encoding.py)


def is_bfloat16(ds: h5py.Dataset) -> bool:
    return marks_bfloat16(ds.attrs)


def marks_bfloat16(attrs: Mapping[str, Any]) -> bool:
    """Whether a dataset's attributes (h5py's, or xarray's copy of them) say its uint16
    values are bfloat16 bits."""
    return attrs.get("dtype") == "bfloat16"


def without_bfloat16_mark(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The attributes of a bfloat16 dataset once its bits are decoded to float32."""
    return {k: v for k, v in attrs.items() if k != "dtype"}


def mark_complete(f: h5py.File, rows: int) -> None:
    """The final attributes of a file written whole in one go (the torchrun join)."""
    mark_completed(f, rows)
    f.attrs.update({"error": "", "status": "complete"})


# The coordinate of the `sample` dimension (io/dimensions.py names every axis).
SAMPLE = "sample"

# A dimension with no values of its own is an empty dataset marked as a scale, whose NAME
# starts with netCDF's sentence (h5netcdf and netCDF-C skip such datasets as variables).
NOT_A_VARIABLE = "This is a netCDF dimension but not a netCDF variable."
# Attributes the HDF5 dimension-scale API writes (references into their own file).
SCALE_ATTRS = ("CLASS", "NAME", "REFERENCE_LIST", "DIMENSION_LIST", "DIMENSION_LABELS")


def is_dimension(ds: h5py.Dataset) -> bool:
    """Whether `ds` only names a dimension (holds no data)."""
    return NOT_A_VARIABLE in str(ds.attrs.get("NAME", ""))  # bytes or str, as written


def write_attrs(f: h5py.File, attrs: Mapping[str, Mapping[str, Any]]) -> None:
    """Attributes (path → {name: value}) onto `f`'s datasets and groups, before SWMR."""
    for path, values in attrs.items():
        for name, value in values.items() if path in f else ():
            f[path].attrs[name] = value


def copy_group_attrs(src: h5py.File, dst: h5py.File) -> None:
    """Every group's attributes of `src` onto `dst` (a resumed copy, the torchrun join)."""
    src.visititems(
        lambda n, o: copy_attrs(o, dst[n]) if isinstance(o, h5py.Group) and n in dst else None
    )


def attr(obj: h5py.Dataset | h5py.Group, name: str, default: Any = None) -> Any:
    """One attribute of a dataset or group (`default` where it has none)."""
    return obj.attrs.get(name, default)


def has_attrs(obj: h5py.Dataset | h5py.Group, *names: str) -> bool:
    """Whether a dataset or group has every one of the attributes `names`."""
    return all(name in obj.attrs for name in names)


def set_attrs(obj: h5py.Dataset | h5py.Group, values: Mapping[str, Any]) -> None:
    """Attributes onto a dataset or group (before SWMR, or when a file is closed)."""
    obj.attrs.update(values)


def modify_attrs(obj: h5py.Dataset | h5py.Group, values: Mapping[str, Any]) -> None:
    """New values of attributes a dataset or group has already, in place: what SWMR allows
    (it refuses a new attribute on a dataset, and `attrs[name] =` makes a new one)."""
    for name, value in values.items():
        obj.attrs.modify(name, value)
