"""`device.name` → a torch.device that exists on this machine (under torchrun, each rank's
own GPU), and the model's devices put back after a run on the caller's model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hookrun.config.schema import DeviceConfig
from hookrun.errors import HookrunError
from hookrun.scale.distributed import World

__all__ = ["resolve_device", "devices_kept"]


def resolve_device(cfg: DeviceConfig, world: World | None = None) -> torch.device:
    """`cpu`, `cuda`, `cuda:N` or `auto`, checked against this machine; under torchrun,
    `cuda` is each rank's local GPU."""
    name = cfg.name
    parallel = world is not None and world.parallel
    if parallel and name in ("cuda", "auto") and torch.cuda.is_available():
        name = f"cuda:{world.local_rank}"
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise HookrunError(
                f"device.name: {cfg.name!r} but CUDA is not available here (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda}); valid here: cpu, auto"
            )
        index = int(name.partition(":")[2] or torch.cuda.current_device())
        if index >= torch.cuda.device_count():
            raise HookrunError(
                f"device.name: {cfg.name!r} but this machine has {torch.cuda.device_count()} "
                f"CUDA device(s); valid: cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
        torch.backends.cuda.matmul.allow_tf32 = cfg.allow_tf32
        torch.backends.cudnn.allow_tf32 = cfg.allow_tf32
        return torch.device("cuda", index)
    return torch.device("cpu")


@contextmanager
def devices_kept(model: nn.Module | None) -> Iterator[None]:
    """Every parameter and buffer of the caller's `model` back on its own device when the
    run ends, by error or not (the run moves the model to `device.name`)."""
    if model is None:
        yield
        return
    tensors = [*model.named_parameters(), *model.named_buffers()]
    before = {name: t.device for name, t in tensors}
    try:
        yield
    finally:
        if len(set(before.values())) == 1:
            model.to(next(iter(before.values())))
        else:  # a model spread over devices: each tensor back where it was
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if t.device != before.get(name, t.device):
                    t.data = t.data.to(before[name])
