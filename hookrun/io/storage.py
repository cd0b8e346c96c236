"""HDF5 file mechanics under faults: room reserved before each write, a failed handle closed
without touching the disk again, and a cut file told from a killed writer's.

Why: once HDF5 has failed a write (full disk, file-size limit, I/O error) its metadata cache
holds entries it can no longer flush; closing the file, or the library's own clean-up at
interpreter exit, then fails again and can crash the process. So the sink asks the kernel for
the bytes a batch can need *before* handing the batch to HDF5 (`reserve`): a refusal there
leaves HDF5 untouched, and the file can still be closed cleanly with `status=failed`. When
HDF5 fails anyway (EIO), `abandon` points its descriptor at /dev/null so the clean-up writes
go nowhere: the disk keeps the file as it was after the last flushed batch.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
from pathlib import Path

import h5py
import numpy as np

from hookrun.errors import first_line

__all__ = [
    "allocated_bytes",
    "open_readonly",
    "disk_errno",
    "never_written",
    "missing_rows",
    "unreadable_rows",
    "torn_tail_rows",
    "CHUNK_BYTES",
    "chunk_shape",
    "RESERVE_MARGIN",
    "batch_need",
    "reserve",
    "abandon",
    "stored_eof",
    "cut_short",
    "trim",
]

# Chunks of about 1 MiB along the sample axis: large enough for fast appends, small
# enough that reading a few rows does not pull in much more than asked.
CHUNK_BYTES = 1 << 20


def chunk_shape(
    row_shape: tuple[int, ...],
    itemsize: int,
    max_rows: int | None = None,
    write_rows: int | None = None,
) -> tuple[int, ...]:
    """A chunk of ~CHUNK_BYTES: whole rows when a row is smaller, else a slab of one row.

    `write_rows`: the rows one append writes (a batch). The chunk's rows then divide it, so
    an append only ever writes chunks of its own and never rewrites one that holds rows
    already counted in `completed`: a SIGKILL can cut a chunk's write short (Linux stops a
    write on a fatal signal), and a torn chunk fails its checksum, taking every row in it.
    """
    row_bytes = max(1, math.prod(row_shape) * itemsize)
    if row_bytes <= CHUNK_BYTES:
        rows = max(1, CHUNK_BYTES // row_bytes)
        if write_rows:
            rows = max(d for d in range(1, min(rows, write_rows) + 1) if write_rows % d == 0)
        return (min(rows, max_rows) if max_rows else rows, *row_shape)
    chunk = [1, *row_shape]
    # Split the leading axes of a large row until the chunk fits (e.g. (1, 16, 112, 112)),
    # into equal parts so the last chunk along an axis is not mostly padding.
    for axis in range(1, len(chunk)):
        inner = math.prod(chunk[axis + 1 :]) * itemsize
        fits = max(1, CHUNK_BYTES // max(1, inner))
        parts = math.ceil(chunk[axis] / fits)
        chunk[axis] = math.ceil(chunk[axis] / parts)
        if math.prod(chunk) * itemsize <= CHUNK_BYTES:
            break
    return tuple(chunk)


def allocated_bytes(
    row_shape: tuple[int, ...], itemsize: int, rows: int, write_rows: int | None = None
) -> int:
    """The bytes the chunks of a dataset of `rows` rows take once written, uncompressed:
    whole chunks, shaped as the writer shapes them for that many expected rows written
    `write_rows` at a time."""
    if rows <= 0 or itemsize <= 0:
        return 0
    chunk = chunk_shape(row_shape, itemsize, rows, write_rows)
    full = (rows, *row_shape)
    count = math.prod(-(-size // part) for size, part in zip(full, chunk, strict=True))
    return count * math.prod(chunk) * itemsize


# Room kept beyond each batch for what HDF5 adds besides the chunks: chunk-index nodes,
# object headers, the final status and error attributes.
RESERVE_MARGIN = 256 << 10


def batch_need(datasets: list[h5py.Dataset], rows: int, count: int) -> int:
    """An upper bound on the bytes HDF5 allocates to write rows [rows, rows + count) of
    each dataset: every chunk those rows touch, whole, with its checksum."""
    total = RESERVE_MARGIN
    for ds in datasets:
        chunks = ds.chunks or ds.shape
        first, last = rows // chunks[0], (rows + count - 1) // chunks[0]
        across = math.prod(math.ceil(s / c) for s, c in zip(ds.shape[1:], chunks[1:], strict=True))
        total += (last - first + 1) * across * (math.prod(chunks) * ds.dtype.itemsize + 4)
    return total


def reserve(f: h5py.File, need: int) -> None:
    """Make the kernel allocate `need` bytes past HDF5's end of file; OSError (ENOSPC,
    EFBIG under `ulimit -f`, EIO) when it cannot. Filesystems without fallocate are
    written as before, guarded only by `abandon`."""
    fd = f.id.get_vfd_handle()
    try:
        os.posix_fallocate(fd, f.id.get_filesize(), need)
    except OSError as err:
        if err.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        raise


def abandon(f: h5py.File) -> None:
    """Close a handle HDF5 already failed to write, without writing to the file again: the
    library's remaining flushes go to /dev/null, so the file on disk stays as it was after
    its last successful flush (every row up to `completed` intact)."""
    try:
        fd = f.id.get_vfd_handle()
        null = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)
    except (OSError, ValueError, RuntimeError):
        pass  # the handle is already gone: nothing left to flush
    with contextlib.suppress(OSError, RuntimeError, ValueError):
        f.close()  # what it still writes goes to /dev/null; the file on disk is unchanged


# How HDF5 reports a failed write() of its own (h5py raises it as a RuntimeError, not an
# OSError): "... (file write failed: ..., errno = 5, error message = 'Input/output error', ...".
_HDF5_WRITE_ERRNO = re.compile(r"file (?:write|read) failed: .*?errno = (\d+)", re.DOTALL)


def disk_errno(err: BaseException) -> int | None:
    """The errno of a failed disk operation (full disk, file-size limit, I/O error), whether
    the OS raised it or HDF5 reported it from its own write; None for any other error."""
    if isinstance(err, OSError):
        return err.errno or None
    found = _HDF5_WRITE_ERRNO.search(str(err)) if isinstance(err, RuntimeError) else None
    return int(found.group(1)) if found else None


_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def stored_eof(path: Path) -> int | None:
    """The end-of-file address the file's superblock records (versions 2-4, 8-byte
    addresses, at offset 0: how hookrun writes), or None for another layout."""
    with open(path, "rb") as fh:
        head = fh.read(36)
    if len(head) < 36 or head[:8] != _SIGNATURE or head[8] not in (2, 3, 4) or head[9] != 8:
        return None
    return int.from_bytes(head[28:36], "little")


def trim(path: Path) -> None:
    """Give back the room `reserve` took and HDF5 did not use: cut a cleanly closed file at
    the end its superblock records (HDF5 itself only shrinks to its own idea of the end)."""
    eof = stored_eof(path)
    if eof is not None and path.stat().st_size > eof:
        os.truncate(path, eof)


def cut_short(path: Path) -> str | None:
    """Why `path` is not a whole HDF5 file (empty, cut before its recorded end), or None.

    HDF5 checks this itself, except when opening for SWMR reading, which is how a killed
    writer's file is read: a cut file would then read zeros where rows were."""
    size = path.stat().st_size
    if size == 0:
        return "the file is empty (0 bytes)"
    eof = stored_eof(path)
    if eof is not None and size < eof:
        return f"the file is cut short: {size} bytes on disk, its superblock records {eof}"
    return None


def missing_rows(datasets: list[h5py.Dataset], rows: int, size: int) -> str | None:
    """Why the first `rows` rows of these datasets are not all in a file of `size` bytes
    (a chunk holding one of them lies past the end: the file was cut), or None."""
    for ds in datasets:
        if ds.chunks is None or ds.is_virtual:
            continue
        past: list[int] = []

        def visit(info: h5py.h5d.StoreInfo, past: list[int] = past) -> None:
            if info.chunk_offset[0] < rows and info.byte_offset + info.size > size:
                past.append(info.chunk_offset[0])

        ds.id.chunk_iter(visit)
        if past:
            return (
                f"the file is cut short: {ds.name} row {min(past)} lies past its end ({size} bytes)"
            )
    return None


# Rows read at a time from a dataset without chunks (a virtual dataset over torchrun shards).
_SLAB = 256


def torn_tail_rows(ds: h5py.Dataset, start: int, stop: int) -> np.ndarray | None:
    """Rows [start, stop) of a 1-D dataset read past the checksum of the chunk that holds
    them, or None where that cannot be done (compressed, several chunks, none stored).

    Why: a 1-D dataset appended at any length (a sparse record's entries) rewrites its last,
    partly filled chunk with every append. A SIGKILL can cut that write short, and the chunk
    then fails its checksum although its first entries, those `completed` counts, were
    rewritten with the bytes they had: unfiltered but for fletcher32, they are read as they
    lie (the checksum's 4 bytes follow the data)."""
    chunk = (ds.chunks or (0,))[0]
    if ds.ndim != 1 or not chunk or ds.compression or start // chunk != (stop - 1) // chunk:
        return None
    first = start // chunk * chunk
    try:
        _, raw = ds.id.read_direct_chunk((first,))
    except (OSError, RuntimeError, ValueError, KeyError):
        return None
    data = np.frombuffer(raw, dtype=ds.dtype, count=min(chunk, len(raw) // ds.dtype.itemsize))
    return data[start - first : stop - first].copy() if len(data) >= stop - first else None


def unreadable_rows(ds: h5py.Dataset, rows: int, torn_tail: bool = False) -> str | None:
    """Why the first `rows` rows of `ds` cannot be read back (a chunk failing its fletcher32
    checksum, a missing shard), or None: every chunk holding one of them is read. With
    `torn_tail` (a killed writer's sparse entries) the last chunk, only partly counted, may
    be read past its checksum (`torn_tail_rows`)."""
    if torn_tail and ds.chunks is not None and ds.ndim == 1 and rows % ds.chunks[0]:
        whole = rows - rows % ds.chunks[0]
        reason = unreadable_rows(ds, whole)
        if reason or torn_tail_rows(ds, whole, rows) is not None:
            return reason
    try:
        if ds.chunks is not None and ds.shape:
            if rows > 0:
                first = tuple(slice(0, rows if axis == 0 else n) for axis, n in enumerate(ds.shape))
                for chunk in ds.iter_chunks(first):
                    ds[chunk]
        elif ds.shape:
            for start in range(0, rows, _SLAB):
                ds[start : min(start + _SLAB, rows)]
        else:
            ds[()]
    except (OSError, RuntimeError, ValueError, KeyError) as err:
        return f"{ds.name}: unreadable: {first_line(err)}"
    return None


def open_readonly(path: Path) -> h5py.File:
    """Open a captures.h5 for reading, also one whose writer was killed mid-run; OSError
    with the reason for a cut or damaged file."""
    try:
        return h5py.File(path, "r")
    except OSError:
        reason = cut_short(Path(path))  # SWMR reading skips HDF5's own EOF check
        if reason:
            raise OSError(reason) from None
        return h5py.File(path, "r", swmr=True)  # still marked open by a killed SWMR writer


def never_written(err: OSError) -> bool:
    """Whether opening failed because the writer died before its first row: it had not yet
    switched to SWMR (which it does once the first batch's datasets exist), so no row can
    be in the file and it may be started over."""
    return "not already open for SWMR writing" in str(err)
