"""Device → host copies of captured tensors.

On the CPU a capture is a plain copy. On CUDA it goes into a pinned host buffer on a side
stream, so the copy overlaps the rest of the forward/backward pass; the writer thread waits
for the copy's event before it reads the buffer, and a buffer is handed out again only after
the writer has written it — never while a later copy could overwrite it.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

__all__ = ["HostCopier"]


class HostCopier:
    """Copies tensors to host memory in a given dtype; pools pinned buffers on CUDA."""

    def __init__(self) -> None:
        self._free: defaultdict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()  # the writer thread gives buffers back
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy(self, tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, object]:
        """A host copy of `tensor` and an event to wait for before reading it (or None)."""
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor.to("cpu", dtype=dtype, copy=True), None
        stream = self._streams.setdefault(tensor.device, torch.cuda.Stream(tensor.device))
        host = self._take(tuple(tensor.shape), dtype)
        # The copy starts only after the producing kernels on the current stream are done.
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # the allocator keeps `tensor` alive until the copy ends
        event = torch.cuda.Event()
        event.record(stream)
        return host, event

    def _take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            free = self._free[(shape, dtype)]
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def give_back(self, tensors: list) -> None:
        """Buffers the writer has finished with; only pinned ones are pooled (a batch also
        carries numpy rows, /samples/path, that were never on a device)."""
        with self._lock:
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_pinned():
                    self._free[(tuple(t.shape), t.dtype)].append(t)
