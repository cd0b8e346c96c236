"""The dry run's text: each hook with the modules it reached, their shapes and bytes, and the
size of the file the run would write — counted as the writer allocates it (whole chunks,
io/storage.py), what the stages store included, so the estimate is what the disk will
hold."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from hookrun.io.layout import MODEL_OUTPUT, capture_key
from hookrun.io.storage import allocated_bytes
from hookrun.memory import format_bytes
from hookrun.runtime.actions import Output
from hookrun.runtime.plan import CallShapes, HookPlan

__all__ = ["FileShape", "describe_plan", "format_bytes"]


@dataclass(frozen=True)
class FileShape:
    """What a run's file holds besides the plan's captures."""

    samples: int  # rows of the whole run
    batch_size: int  # rows per batch (a tensor with no batch axis is stored once per batch)
    itemsize: int  # bytes of one stored float (sink.dtype)
    output: tuple[int, ...]  # the model output per sample
    path_bytes: int = 0  # the width of /samples/path (file datasets), 0 for none
    labelled: bool = True  # whether /samples/label is written
    # Each derived result's per-sample shape, by its captures.h5 path.
    derived: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # Rows of each shard file under torchrun: each is chunked for its own rows, so the disk
    # holds their chunks, not those of one file of `samples` rows. Empty: one file.
    shards: tuple[int, ...] = ()
    # Captures stored in another float than sink.dtype (a hook's args.dtype): path → bytes.
    itemsizes: Mapping[str, int] = field(default_factory=dict)
    counter_target: bool = False  # whether /samples/counterfactual_target is written
    # Sparse records (a dictionary's latents): path → the non-zeros of one sample, as the
    # plan's hooks gave them on the probe's sample (what the file holds grows with L0).
    entries: Mapping[str, float] = field(default_factory=dict)

    def size_of(self, key: str) -> int:
        """Bytes of one stored float of the dataset at `key`."""
        return self.itemsizes.get(key, self.itemsize)


# HDF5's own metadata (superblock, object headers, chunk indexes, attributes), which small
# files are mostly made of: measured 15-19.5 KiB for files of 4 to 7 datasets, so about
# 12 KiB a file and 1 KiB a dataset (in 2 KiB blocks, hence not exactly linear).
_FILE_METADATA = 12 << 10
_DATASET_METADATA = 1 << 10


def describe_plan(
    plan: HookPlan, shapes: Mapping[str, list[CallShapes]], target: str, file: FileShape
) -> str:
    """The dry-run text: hooks → modules, shapes, bytes per sample (per batch for tensors
    with no batch axis), and the estimated file size."""
    backward = f"yes, from target.kind={target}" if plan.needs_backward else "no"
    lines = [*plan.notes, f"HookPlan: {len(plan.hooks)} hook(s); backward pass: {backward}"]
    stored = plan.capture_shapes(shapes)
    folds = plan.folds(shapes)
    # What each hook records at each of its sites (Action.outputs): a capture its site's own
    # tensor, a splice tensors of other shapes at paths of their own.
    recorded = {(h.name, key): found for h, key, _, found in plan.site_outputs(shapes)}
    for hook in plan.hooks:
        in_pass = ""
        if hook.site.is_grad and len(plan.backward_passes) > 1:
            in_pass = f" (backward pass {hook.backward})"
        lines.append(f"  {hook.name}: {hook.action.describe()} at {hook.site.value}{in_pass}")
        for layer in hook.layers:
            for call, call_shapes in enumerate(shapes.get(layer, [])):
                for leaf in call_shapes.at(hook.site):
                    key = capture_key(layer, hook.site, call, leaf=leaf.name)
                    label = f"{layer} (call {call})" if call else layer
                    per = "batch" if folds.get(key) == 0 else "sample"
                    outputs = recorded.get((hook.name, key), {})
                    if key not in outputs:  # the site itself is acted on, not stored
                        size = format_bytes(math.prod(leaf.shape) * file.size_of(key))
                        shown = f"{str(list(leaf.shape)):<20} {size:>11}/{per}  (not stored)"
                        lines.append(f"    {label:<32} {shown}")
                        label = ""
                    for path, output in outputs.items():
                        size = _output_bytes(output, file.size_of(path), file.entries.get(path))
                        lines.append(
                            f"    {label:<32} {str(list(output.shape)):<20} "
                            f"{size:>11}/{per}  /{path}"
                        )
                        label = ""
            if not shapes.get(layer):
                lines.append(f"    {layer:<32} (not called in the probe forward pass)")
            elif not any(c.at(hook.site) for c in shapes[layer]):
                # Token ids, or a module whose outputs hold no floating-point tensor.
                lines.append(f"    {layer:<32} (no floating-point tensor here: nothing stored)")
    sparse = {p: o for p, o in plan.outputs(shapes).items() if o.sparse}
    lines.append(_size_line(stored, folds, file, sparse))
    return "\n".join(lines)


def _output_bytes(output: Output, itemsize: int, entries: float | None) -> str:
    """One sample's bytes of a record: dense, its shape's; sparse, each non-zero's value and
    index and each row's count (io/sparse.py), in proportion to L0, not the width."""
    if not output.sparse:
        return format_bytes(math.prod(output.shape) * itemsize)
    if entries is not None:
        return f"{format_bytes(sparse_bytes(output, itemsize, entries))} (sparse)"
    rows = math.prod(output.shape[:-1])
    return f"sparse: {format_bytes(itemsize + 4)} x L0 x {rows} + {format_bytes(4 * rows)}"


def sparse_bytes(output: Output, itemsize: int, entries: float) -> float:
    """One sample's bytes of a sparse record with `entries` non-zeros: a value and an int32
    index each, and an int32 count per row of the dense shape but its last axis."""
    return entries * (itemsize + 4) + 4 * math.prod(output.shape[:-1])


def _size_line(
    stored: dict[str, tuple[int, ...]],
    folds: dict[str, int],
    file: FileShape,
    sparse: Mapping[str, Output],
) -> str:
    """`Stored per sample: …; N sample(s) → estimated file size …` (a sparse record counted
    at the probe sample's non-zeros, where known)."""
    n = file.samples
    floats = {**stored, MODEL_OUTPUT: file.output, **file.derived}
    per_sample = sum(math.prod(s) * file.size_of(k) for k, s in floats.items() if folds.get(k) != 0)
    sparse_sample = sum(
        sparse_bytes(o, file.size_of(p), file.entries[p])
        for p, o in sparse.items()
        if p in file.entries
    )
    per_sample += sparse_sample
    # /samples/index, /samples/target, /sample (the `sample` coordinate), /samples/label,
    # /samples/counterfactual_target
    ints = 3 + file.labelled + file.counter_target
    per_sample = per_sample + ints * 8 + file.path_bytes
    total = 0
    for rows in file.shards or (n,):
        blocks = -(-rows // file.batch_size)  # shards hold whole batches
        batch = file.batch_size  # the rows one append writes: chunks divide it
        total += sum(
            allocated_bytes(shape, file.size_of(key), blocks, 1)
            if folds.get(key) == 0
            else allocated_bytes(shape, file.size_of(key), rows, batch)
            for key, shape in floats.items()
        )
        total += ints * allocated_bytes((), 8, rows, batch)
        total += allocated_bytes((), file.path_bytes, rows, batch)
        total += int(rows * sparse_sample)
    datasets = len(floats) + ints + (1 if file.path_bytes else 0) + 3 * len(sparse)
    files = len(file.shards) + 1 if file.shards else 1  # the shards and the file joining them
    total += files * (_FILE_METADATA + datasets * _DATASET_METADATA)
    derived = ", derived results" if file.derived else ""
    paths = f", source path {file.path_bytes} B" if file.path_bytes else ""
    return (
        f"Stored per sample: {format_bytes(per_sample)} (captures, /model/output "
        f"{list(file.output)}{derived}{paths}); {n} sample(s) → estimated file size "
        f"{format_bytes(total)} before compression"
    )
