"""Data-parallel extraction under torchrun (or Slurm with torchrun's environment variables).

Each rank takes a contiguous run of whole batches — exactly the batches a single process
would run, so every number is the same — writes its own shard file, and rank 0 then writes
captures.h5 whose datasets are HDF5 virtual datasets over the shards in global index order.
No sampler padding: no sample is duplicated or dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hookrun.data.shards import World, batch_shard, world_from_env
from hookrun.errors import HookrunError
from hookrun.io.appender import Summaries
from hookrun.io.layout import Provenance
from hookrun.io.stored import join_shards
from hookrun.io.whole_run import WholeRun

__all__ = [
    "World",
    "world_from_env",
    "start",
    "stop",
    "batch_shard",
    "shard_path",
    "merge_shards",
    "shard_world_sizes",
]


def start(world: World, device: torch.device, run_dir: Path) -> Path:
    """Join the process group (NCCL on CUDA, gloo on CPU); every rank gets rank 0's run dir,
    so all shards land next to the captures.h5 that joins them."""
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    shared = [str(run_dir)]
    dist.broadcast_object_list(shared, src=0)
    return Path(shared[0])


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_path(path: Path, world: World) -> Path:
    """`captures.h5` → `captures.rank0-of-2.h5`."""
    return path.with_name(f"{path.stem}.rank{world.rank}-of-{world.size}{path.suffix}")


def shard_world_sizes(path: Path) -> set[int]:
    """The world sizes of the shard files next to `path` (`captures.rank0-of-2.h5` → 2)."""
    sizes = set()
    for shard in path.parent.glob(f"{path.stem}.rank*-of-*{path.suffix}"):
        size = shard.name.removesuffix(path.suffix).rpartition("-of-")[2]
        if size.isdigit():
            sizes.add(int(size))
    return sizes


def merge_shards(
    path: Path,
    world: World,
    samples: int,
    batch_size: int,
    header: Provenance | Mapping[str, Any],
    *,
    replace: bool,
    summaries: Summaries | None = None,
    finishes: Mapping[str, WholeRun] | None = None,
    attrs: Mapping[str, Mapping[str, Any]] | None = None,
    written: Mapping[str, Any] | None = None,
) -> None:
    """Rank 0: write `path` as virtual datasets over every rank's shard, in index order;
    an existing `path` only with `replace`; `summaries`: what the file says of all its rows
    (io/appender.py), over every shard's; `finishes`: the whole-run datasets made pending
    (io/whole_run.py), with `attrs` (path → {name: value}) on them and their groups, and
    those of them already `written` (path → values)."""
    shards = []
    for rank in range(world.size):
        rank_world = World(rank, world.size)
        if not batch_shard(samples, batch_size, rank_world):
            continue  # more ranks than batches: this one had nothing to do
        shard = shard_path(path, rank_world)
        if not shard.is_file():
            raise HookrunError(f"merge: the shard {shard} of rank {rank} is missing")
        shards.append(shard)
    try:
        join_shards(path, shards, samples, header, replace, summaries, finishes, attrs, written)
    except ValueError as err:
        raise HookrunError(f"merge: {err}") from None
