"""Where this process stands among torchrun's processes, and the rows it runs: a contiguous
run of whole batches, exactly the batches one process would run (so every number is the
same). The torchrun join itself is hookrun/scale/distributed.py's; a stage's job of its own
(experiment=features) shards its rows here too."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

__all__ = ["World", "world_from_env", "batch_shard"]


@dataclass(frozen=True)
class World:
    """This process's place among the processes of one run."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def parallel(self) -> bool:
        return self.size > 1


def world_from_env() -> World:
    """RANK / WORLD_SIZE / LOCAL_RANK as torchrun sets them; one process without them."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    return World(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))


def batch_shard(samples: int, batch_size: int, world: World) -> range:
    """The sample positions this rank runs: a contiguous run of whole batches."""
    batches = math.ceil(samples / batch_size)
    first = batches * world.rank // world.size
    last = batches * (world.rank + 1) // world.size
    return range(first * batch_size, min(last * batch_size, samples))
