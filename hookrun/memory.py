"""Sizes that cannot fit: a key whose value makes one allocation larger than the machine's
memory is refused before any work, naming the key, the value, the bytes and the memory.

The memory is the machine's physical memory (MemTotal in /proc/meminfo, else sysconf), or
the cgroup's limit when one is set and smaller (a container, a Slurm job): what the process
could ever get, not what happens to be free now — so the same config is refused, or not,
whatever else runs. What is compared is a lower bound of what the key makes torch or numpy
allocate at once (one batch of input tensors, one pass of extra rows), so a refusal is
certain; a value under the bound may still run out of memory later.
"""

from __future__ import annotations

import os
from pathlib import Path

from hookrun.errors import HookrunError

__all__ = ["format_bytes", "machine_memory", "check_fits"]

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def format_bytes(n: float) -> str:
    """1536 → '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _meminfo_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine_memory() -> int | None:
    """Bytes of memory this process could ever use (None when the system does not say)."""
    sizes = [_meminfo_total()]
    for limit in _CGROUP_LIMITS:
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            sizes.append(int(text))
    known = [s for s in sizes if s]
    return min(known) if known else None


def check_fits(key: str, value: object, nbytes: int, what: str) -> None:
    """Refuse `key`=`value` when it makes `what` (at least `nbytes` at once) larger than the
    machine's memory. The check any key that sizes an allocation calls (image sizes, batch
    sizes, rows per extra pass, a language model's context)."""
    memory = machine_memory()
    if memory is not None and nbytes > memory:
        raise HookrunError(
            f"{key}: {value} makes {what} need {format_bytes(nbytes)} at once, more than this "
            f"machine's {format_bytes(memory)} of memory; valid: a smaller value"
        )
