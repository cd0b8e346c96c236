"""Reading a captures.h5: `hookrun.open(path)`, and the end-of-run summary.

The file stays plain HDF5 — everything here is a convenience over h5py, never a
requirement for reading it.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import h5py
import numpy as np
from omegaconf import DictConfig, OmegaConf

from hookrun.errors import did_you_mean
from hookrun.extras import missing_extra
from hookrun.io import features as feature_layout
from hookrun.io import layout, walk
from hookrun.io.encoding import bits_to_float32, decoded, decoded_node, read_floats
from hookrun.io.sparse_record import SparseRecord


class RunResult(Protocol):
    """What `hookrun.run` returns (pipeline/finish.py: Result), as this reader uses it.

    The pipeline imports this module, so the result is named by its shape, not imported.
    """

    path: Path | None
    memory: bytes | None


__all__ = ["Results", "open_results", "summary"]


class Results:
    """A finished (or interrupted) run's captures.h5, opened read-only.

    Opened from a path, or from the file's bytes (a run with sink.path=memory:
    `result.open()`); a file whose writer was killed mid-way opens too. Use it as a context
    manager, or call `close()`.

    `results.layers` lists `{layer: {site: shape}}` (`repr` also says which datasets are
    not one row per sample: layout.rows_note); `results[path]` (a path such as
    captures/layer4/output, or `results.capture("layer4", "output")`) is an h5py dataset,
    read lazily by slicing (a bfloat16 one reads as the float32 numbers it holds, its raw
    bits are `.raw`: io/encoding.py); a group is an h5py group through which every
    bfloat16 dataset decodes the same way (`results["captures"]["layer4/output"]`), and
    `results.file` is the plain h5py file (the words as stored);
    `results.config` is the resolved run config.

    Attributes:
        path: The file's path (`memory` for a file opened from bytes).
        file: The plain h5py file, read-only: the words as stored.
        image: The file's bytes when opened from memory, else None.
    """

    def __init__(self, path: str | Path | bytes | memoryview | RunResult) -> None:
        """Open a captures.h5 read-only.

        Args:
            path: The file's path, its bytes (`Result.memory` of a sink.path=memory run),
                or the `Result` that `hookrun.run` returned.

        Raises:
            OSError: No such file, not a readable HDF5 file (the message says why: a file
                cut short, for one), or a dry run's Result.
        """
        if hasattr(path, "memory") and hasattr(path, "path"):  # hookrun.run's Result
            path = path.memory if path.memory is not None else path.path
            if path is None:
                raise OSError("this Result holds no file: it was a dry run")
        if isinstance(path, bytes | bytearray | memoryview):  # a file in memory
            self.image: bytes | None = bytes(path)
            self.path = Path("memory")
            try:
                self.file = h5py.File(io.BytesIO(self.image), "r")
            except OSError:
                raise OSError(
                    f"these {len(self.image)} bytes are not a whole HDF5 file (cut short, or "
                    "never one): hookrun.open takes a sink.path=memory run's Result.memory"
                ) from None
            return
        self.image = None
        self.path = Path(path)
        self.file = layout.open_readonly(self.path)  # also a run killed mid-way

    def __enter__(self) -> Results:
        """The results themselves: `with hookrun.open(path) as res: ...`."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the file on leaving the `with` block."""
        self.close()

    def close(self) -> None:
        """Close the file; the datasets and groups read from it become unreadable."""
        self.file.close()

    def __getitem__(self, key: str) -> Any:
        """A dataset or group by its path in the file, e.g. captures/layer4/output.

        Args:
            key: The path inside the file, with or without a leading `/`.

        Returns:
            An h5py dataset, read lazily by slicing (a bfloat16 one reads as float32, its
            raw bits as `.raw`), an h5py group that decodes its datasets the same way, or,
            for a sparse record's group, a `SparseRecord` (io/sparse_record.py: its rows
            read as dense float32 by slicing, `.to_scipy()`, `.nnz`; its parts as stored
            at `<key>/counts`, `<key>/values`, `<key>/latent`).

        Raises:
            KeyError: No such path in the file (the message names the nearest one, or the
                dataset whose path ends with `key`), or a whole-run result the run has not
                written yet (resume=true computes it).
        """
        path = str(key).lstrip("/") or "/"
        if path not in self.file:
            raise KeyError(f"{key!r}: no such dataset or group in {self.path}{self._near(path)}")
        node = self.file[path]
        if isinstance(node, h5py.Dataset) and layout.is_pending(node):
            raise KeyError(
                f"{key!r}: not written yet: the {path.split('/')[0]} stage's whole-run work is "
                f"not in {self.path} (status {self.status}; resume=true computes it)"
            )
        if layout.sparse_spec(node) is not None:
            return SparseRecord(node, self.completed)
        return decoded_node(node)

    def __contains__(self, key: str) -> bool:
        """Whether `results[key]` opens: the path is in the file and written."""
        path = str(key).lstrip("/") or "/"
        node = self.file.get(path)
        return node is not None and not (isinstance(node, h5py.Dataset) and layout.is_pending(node))

    def keys(self) -> list[str]:
        """Every dataset `results[key]` opens, by path.

        Returns:
            The datasets' paths; those only naming a dimension, and whole-run results not
            written yet, left out; a sparse record once, by its group's path (not its
            three datasets).
        """
        groups = layout.sparse_groups(self.file)
        parts = {f"{g}/{p}": g for g in groups for p in layout.SPARSE_PARTS}
        keys: dict[str, None] = {}  # in the file's order, a record where its parts are
        for path in layout.dataset_names(self.file):
            if path in parts:
                keys[parts[path]] = None
            elif path in self:
                keys[path] = None
        return list(keys)

    def _near(self, path: str) -> str:
        """The hint for a path that is not in the file.

        A dataset whose path ends with it (`feature_ablation/input` →
        `derived/feature_ablation/input`), else the closest.
        """
        keys = self.keys()
        ending = [k for k in keys if k.endswith("/" + path)]
        if ending:
            return f" (did you mean '{ending[0]}'?)"
        return did_you_mean(path, keys)

    def capture(self, layer: str, site: str) -> Any:
        """The dataset of one capture, e.g. `capture("layer4", "grad_output")`.

        Args:
            layer: The module's name as the file stores it (`results.layers` lists them).
            site: The hook site: `input`, `output`, `grad_input`, `grad_output`, ...

        Returns:
            The h5py dataset at captures/<layer>/<site>.

        Raises:
            KeyError: The file holds no such capture (the message names the nearest).
        """
        return self[layout.capture_key(layer, site)]

    @property
    def layers(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """Every captured layer → its sites → dataset shape (N, ...)."""
        captured = walk.captures_of(self.file)
        return {layer: {site: ds.shape for site, ds in g.items()} for layer, g in captured.items()}

    @property
    def derived(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """Every derived method → its layers → dataset shape."""
        derived = walk.derived_of(self.file)
        return {m: {layer: ds.shape for layer, ds in g.items()} for m, g in derived.items()}

    def features(self) -> list[tuple[str, str]]:
        """The sites a features run (experiment=features) made dashboards of.

        Returns:
            (module, site) pairs, e.g. [("transformer.h.1", "output")]; their groups are at
            `features/<module>/<site>`.
        """
        return feature_layout.feature_sites(self.file)

    def feature(
        self, module: str, site: str, unit: int, part: str = "top"
    ) -> list[feature_layout.Context]:
        """One unit's contexts (a latent of a dictionary, a neuron, a channel) as text.

        Args:
            module: The module, as `features()` names it.
            site: `input` or `output`.
            unit: The latent's (or unit's) index.
            part: `top` (the top-activating contexts, largest first) or `quantiles` (each
                activation group's samples, the lowest group first).

        Returns:
            A `Context` each (value, row, token, text): `text` is the window of tokens with
            the maximum token between `[[` and `]]`; on image data `box` (y0, x0, y1, x1) is
            the receptive field in the input instead. Entries that never fired are left out.

        Raises:
            KeyError: No dashboards of that site, or the unit is past its units.
        """
        if part not in ("top", "quantiles"):
            raise KeyError(f"part: {part!r}; valid: top, quantiles")
        return feature_layout.feature_contexts(self.file, module, site, unit, part)

    @property
    def config(self) -> DictConfig:
        """The resolved config the run was made with."""
        return OmegaConf.create(layout.read_state(self.file).config or "{}")

    @property
    def paths(self) -> list[str] | None:
        """The source file of each complete row, for datasets read from files; else None."""
        return layout.read_paths(self.file)

    @property
    def status(self) -> str:
        """The run's state as the file records it (`complete`, `running`, ...; `unknown`)."""
        return layout.read_state(self.file).status or "unknown"

    @property
    def completed(self) -> int:
        """Rows written and flushed."""
        return layout.read_state(self.file).completed

    def to_xarray(self) -> Any:
        """The file as an `xarray.DataTree`, read lazily; close it when done.

        Every per-sample dataset is on the one `sample` dimension, whose coordinate is the
        dataset indices, so a group selects by index (`tree[group].sel(sample=7)`);
        bfloat16 datasets read as float32. A file of hookrun 0.1.0, written before axes had
        names, opens with netCDF's phony names (`phony_dim_k`).

        Returns:
            The `xarray.DataTree` of the file's groups.

        Raises:
            HookrunError: xarray or h5netcdf is not installed (the extra:
                `pip install 'hookrun[xarray]'`).
        """
        try:
            import h5netcdf  # noqa: F401  (xarray's engine; imported here to name it if missing)
            import xarray
        except ImportError:
            raise missing_extra("to_xarray()", "xarray") from None
        swmr = {"swmr": True} if self.file.swmr_mode else None  # a killed or running writer
        source = io.BytesIO(self.image) if self.image is not None else self.path
        tree = xarray.open_datatree(source, engine="h5netcdf", phony_dims="sort", driver_kwds=swmr)
        return tree.map_over_datasets(_decode_bfloat16)

    def __repr__(self) -> str:
        """The file's status and every dataset by the key `results[key]` opens it with."""
        lines = [f"<hookrun results {self.path} status={self.status} rows={self.completed}>"]
        for path in layout.dataset_names(self.file):
            ds = self.file[path]
            if layout.is_pending(ds):
                note = "not written yet: resume=true computes it"
            else:
                note = layout.rows_note(ds)
            lines.append(f"  {path}: {ds.shape}" + (f" ({note})" if note else ""))
        return "\n".join(lines)


def _decode_bfloat16(ds: Any) -> Any:
    """A node's variables with bfloat16 bits (attribute dtype=bfloat16) as float32.

    Decoded lazily where xarray allows it (its own element-wise decoding), else on reading.
    """
    import xarray

    try:
        from xarray.coding.variables import lazy_elemwise_func
    except ImportError:  # xarray moved it: decode eagerly
        lazy_elemwise_func = None
    changed = {}
    for name, var in ds.variables.items():
        if not layout.marks_bfloat16(var.attrs):
            continue
        attrs = layout.without_bfloat16_mark(var.attrs)
        data = (
            lazy_elemwise_func(var._data, bits_to_float32, np.dtype(np.float32))
            if lazy_elemwise_func is not None
            else bits_to_float32(var.values)
        )
        changed[name] = xarray.Variable(var.dims, data, attrs, var.encoding)
    return ds.assign(changed) if changed else ds


def open_results(path: str | Path | bytes | memoryview | RunResult) -> Results:
    """Open a captures.h5 for reading; `hookrun.open` is this function.

    Args:
        path: The file's path, its bytes (`Result.memory` of a sink.path=memory run), or
            the `Result` that `hookrun.run` returned.

    Returns:
        The file as `Results`, read-only (`with hookrun.open(path) as res: ...`).

    Raises:
        OSError: No such file, or not a readable HDF5 file (the message says why: a file
            cut short, for one).
    """
    return Results(path)


def summary(
    path: Path,
    seconds: float,
    class_names: list[str] | None,
    images: Path | None,
    show: int = 8,
    computed: int | None = None,
    more: Callable[[h5py.File, int], list[str]] | None = None,
    name: str | None = None,
) -> str:
    """The end-of-run text: where things are, rows, top-1 classes, time and throughput.

    Args:
        path: The complete captures.h5.
        seconds: How long the run took.
        class_names: The model's class names, to name each top-1 class; None: by index
            (a language model's from the vocabulary the file stores).
        images: The pictures' folder, or None when none were drawn.
        show: How many samples' top-1 classes to list.
        computed: The rows this process computed (a resumed run found the others done),
            which is what the throughput counts; None: every row.
        more: `more(file, rows)`: the lines the stages add.
        name: What to call the file instead of its path (`memory`).

    Returns:
        The summary, one line per item.
    """
    with Results(path) as res:
        rows = res.completed
        size = path.stat().st_size / 2**20
        lines = [f"captures: {name or path} ({rows} rows, {size:.1f} MiB, {res.status})"]
        if images is not None:
            count = len(list(images.glob("*.png"))) if images.is_dir() else 0
            lines.append(f"pictures: {images} ({count} files)")
        if layout.MODEL_OUTPUT in res and rows:
            logits = read_floats(res.file[layout.MODEL_OUTPUT], slice(0, min(rows, show)))
            logits = logits.reshape(len(logits), -1)
            index = res[layout.SAMPLES_INDEX][: len(logits)]
            for i, row in zip(index, logits.astype(np.float64), strict=True):
                prob = np.exp(row - row.max())
                prob /= prob.sum()
                top = int(row.argmax())
                if class_names and top < len(class_names):
                    name = class_names[top]
                else:  # a language model's run from its file alone (a resume): its vocabulary
                    text = (layout.read_vocabulary(res.file, [top]) or [None])[0]
                    name = f"class {top}" if text is None else f"token {top} {text!r}"
                lines.append(f"  sample {int(i)}: top-1 {name} (p={prob[top]:.2f})")
            if rows > show:
                lines.append(f"  ... {rows - show} more")
        never_ran = layout.read_state(res.file).never_ran
        if never_ran:
            lines.append(f"selected but never ran (nothing stored there): {never_ran}")
        lines += _vanished(res.file, min(rows, show))
        lines += more(res.file, rows) if more is not None else []
    done_here = rows if computed is None else computed
    rate = done_here / seconds if seconds > 0 else float("inf")
    note = "" if done_here == rows else f" ({done_here} rows computed here, {rows} in the file)"
    lines.append(f"time: {seconds:.1f} s, {rate:.1f} samples/s{note}")
    return "\n".join(lines)


def _vanished(f: h5py.File, rows: int) -> list[str]:
    """A warning for each attribution that is exactly zero in its first `rows` rows.

    The target's gradient vanished (torchvision ViT's zero-initialised head with random
    weights gives zeros everywhere); numbers that are right but say nothing should not pass
    unseen.
    """
    found = [ds for group in walk.derived_of(f).values() for ds in group.values()]
    if layout.INPUT_GRAD in f:
        found.append(decoded(f[layout.INPUT_GRAD]))
    return [
        f"warning: /{ds.name.lstrip('/')} is exactly zero in its first {rows} rows (often "
        "the target's gradient vanishing: a zero-initialised head, as torchvision's ViT has "
        "with model.weights=null, gives zeros)"
        for ds in found
        if rows
        and not ds.name.endswith(layout.GAP_SUFFIX)
        and ds.dtype.kind == "f"
        and not np.any(ds[:rows])
    ]
