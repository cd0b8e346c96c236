"""A disk that answers EIO: a FUSE file system in memory, spoken straight over /dev/fuse.

    python eio_disk.py MOUNTPOINT FAIL_PAST

Mounts an empty, flat file system at MOUNTPOINT (root only: it calls mount(2)) and serves
it until unmounted. Every write to a file named captures.h5 that reaches past byte
FAIL_PAST fails with EIO, as a failing disk's would; `fallocate` succeeds (the disk has
room), so the error reaches HDF5's own write, not hookrun's room check. SIGUSR1 heals the
disk: writes succeed from then on. Prints "mounted" once it serves requests.

Written against the kernel's FUSE protocol (include/uapi/linux/fuse.h, 7.31 replies), so
it needs no libfuse and no package: only the requests a file written by HDF5 needs are
served, everything else is answered ENOSYS.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import struct
import sys

IN_HEADER = struct.Struct("<IIQQIIII")  # len, opcode, unique, nodeid, uid, gid, pid, pad
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr, 88 bytes
FILE_MODE, DIR_MODE = 0o100644, 0o040755
MAX_WRITE = 128 << 10

LOOKUP, FORGET, GETATTR, SETATTR, UNLINK, RENAME, OPEN, READ, WRITE = 1, 2, 3, 4, 10, 12, 14, 15, 16
STATFS, RELEASE, FSYNC, FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR = 17, 18, 20, 25, 26, 27, 28, 29
ACCESS, CREATE, DESTROY, FALLOCATE, BATCH_FORGET, RENAME2 = 34, 35, 38, 43, 42, 45
NO_REPLY = {FORGET, BATCH_FORGET}


class Disk:
    def __init__(self, fail_past: int) -> None:
        self.fail_past = fail_past
        self.names: dict[str, int] = {}
        self.data: dict[int, bytearray] = {}
        self.next_id = 2  # 1 is the root

    def attr(self, node: int) -> bytes:
        if node == 1:
            return ATTR.pack(1, 0, 0, 0, 0, 0, 0, 0, 0, DIR_MODE, 2, 0, 0, 0, 4096, 0)
        size = len(self.data[node])
        blocks = (size + 511) // 512
        return ATTR.pack(node, size, blocks, 0, 0, 0, 0, 0, 0, FILE_MODE, 1, 0, 0, 0, 4096, 0)

    def entry(self, node: int) -> bytes:
        return struct.pack("<QQQQII", node, 0, 0, 0, 0, 0) + self.attr(node)

    def attr_out(self, node: int) -> bytes:
        return struct.pack("<QII", 0, 0, 0) + self.attr(node)

    def name_of(self, node: int) -> str:
        return next((n for n, i in self.names.items() if i == node), "")

    def handle(self, op: int, node: int, body: bytes) -> bytes | int:
        """The reply's body, or an errno."""
        if op == INIT:
            flags = 1 << 5  # FUSE_BIG_WRITES: writes of up to MAX_WRITE bytes at once
            # fuse_init_out: 7.31, readahead, flags, background, congestion, max_write, ...
            init = (7, 31, MAX_WRITE, flags, 16, 12, MAX_WRITE, 1, 32, 0, 0, *[0] * 7)
            return struct.pack("<IIIIHHIIHHI7I", *init)
        if op == LOOKUP:
            name = body.split(b"\0")[0].decode()
            return self.entry(self.names[name]) if name in self.names else -errno.ENOENT
        if op == GETATTR:
            return self.attr_out(node)
        if op == SETATTR:
            valid, _, _, size = struct.unpack_from("<IIQQ", body)
            if valid & (1 << 3):  # FATTR_SIZE: truncate or extend
                data = self.data[node]
                del data[size:]
                data.extend(bytes(size - len(data)))
            return self.attr_out(node)
        if op == CREATE:
            name = body[16:].split(b"\0")[0].decode()
            node = self.names.get(name) or self.new(name)
            return self.entry(node) + struct.pack("<QII", node, 0, 0)
        if op == OPEN:
            return struct.pack("<QII", node, 0, 0)
        if op == READ:
            _, offset, size = struct.unpack_from("<QQI", body)
            return bytes(self.data[node][offset : offset + size])
        if op == WRITE:
            _, offset, size = struct.unpack_from("<QQI", body)
            if self.name_of(node) == "captures.h5" and offset + size > self.fail_past:
                return -errno.EIO
            data = self.data[node]
            if len(data) < offset:
                data.extend(bytes(offset - len(data)))
            data[offset : offset + size] = body[40 : 40 + size]
            return struct.pack("<II", size, 0)
        if op == FALLOCATE:
            _, offset, length, mode = struct.unpack_from("<QQQI", body)
            data = self.data[node]
            if not mode & 1 and len(data) < offset + length:  # not FALLOC_FL_KEEP_SIZE
                data.extend(bytes(offset + length - len(data)))
            return b""
        if op == UNLINK:
            name = body.split(b"\0")[0].decode()
            return b"" if self.names.pop(name, None) else -errno.ENOENT
        if op in (RENAME, RENAME2):
            old, new = body[8 if op == RENAME else 16 :].split(b"\0")[:2]
            self.names[new.decode()] = self.names.pop(old.decode())
            return b""
        if op == STATFS:
            return struct.pack("<QQQQQIIII6I", 1 << 20, 1 << 19, 1 << 19, 1000, 900, 4096, 255,
                               4096, 0, *[0] * 6)  # fmt: skip
        if op in (RELEASE, FLUSH, FSYNC, ACCESS, RELEASEDIR):
            return b""
        if op == OPENDIR:
            return struct.pack("<QII", 0, 0, 0)
        if op == READDIR:
            return b""  # hookrun lists no folder on this disk
        return -errno.ENOSYS

    def new(self, name: str) -> int:
        node, self.next_id = self.next_id, self.next_id + 1
        self.names[name] = node
        self.data[node] = bytearray()
        return node


def mount(fd: int, where: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    if libc.mount(b"eio-disk", where.encode(), b"fuse", 0, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount: {os.strerror(err)}")


def serve(where: str, fail_past: int) -> None:
    disk = Disk(fail_past)

    def heal(*_: object) -> None:
        disk.fail_past = 1 << 62

    signal.signal(signal.SIGUSR1, heal)
    fd = os.open("/dev/fuse", os.O_RDWR)
    mount(fd, where)
    print("mounted", flush=True)
    while True:
        try:
            request = os.read(fd, MAX_WRITE + 4096)
        except InterruptedError:
            continue
        except OSError as err:
            if err.errno == errno.ENOENT:  # the request was interrupted: the next one
                continue
            return  # ENODEV: unmounted
        _, op, unique, node, *_ = IN_HEADER.unpack_from(request)
        if op == DESTROY:
            return
        reply = disk.handle(op, node, request[IN_HEADER.size :])
        if op in NO_REPLY:
            continue
        body, error = (b"", reply) if isinstance(reply, int) else (reply, 0)
        with contextlib.suppress(OSError):  # ENOENT: the caller was interrupted meanwhile
            os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), error, unique) + body)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
