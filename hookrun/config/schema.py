"""The config schema Hydra composes into (registered in Hydra's ConfigStore).

The top level is a structured config, so Hydra itself rejects an unknown top-level key or a
wrongly typed value. `model`, `dataset`, `derive` and each entry of `hooks` are free-form
nodes here (Hydra cannot add new keys under a typed dict from the command line); the spec
builder (`hookrun/config/build.py`) merges each into its own dataclass — model here, dataset
kinds in `hookrun/data/kinds.py`, action args in `hookrun/runtime/actions.py`, derived
methods in `hookrun/stages/derive/registry.py` — and turns OmegaConf's errors into one-line
messages.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
from dataclasses import dataclass, field, make_dataclass
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from hookrun.models.config import ModelConfig
from hookrun.runtime.hookspec import HookConfig
from hookrun.runtime.selectors import SelectConfig
from hookrun.runtime.sites import Site
from hookrun.runtime.targets import TargetConfig, TargetKind
from hookrun.stage import stage_nodes
from hookrun.typed import Frozen

__all__ = [
    "Site",
    "TargetKind",
    "StoreDtype",
    "Compression",
    "ModelConfig",
    "SelectConfig",
    "HookConfig",
    "TargetConfig",
    "SinkConfig",
    "DeviceConfig",
    "RunConfig",
    "run_schema",
    "conf_dir",
    "register_configs",
]


class StoreDtype(str, Enum):
    float32 = "float32"
    float16 = "float16"
    # Stored as its raw 16 bits (uint16) with the attribute dtype=bfloat16 (io/layout.py):
    # h5py and numpy have no bfloat16, and the bits read back exactly.
    bfloat16 = "bfloat16"


class Compression(str, Enum):
    lzf = "lzf"
    gzip = "gzip"


@dataclass
class SinkConfig(Frozen):
    path: str | None = None
    """Where captures.h5 goes; null = <run dir>/captures.h5; memory = kept in the calling Python
    process (hookrun.run's result.open() reads it; written to a private temporary folder while
    the run streams it, removed at its end), not from the command line.
    """
    dtype: StoreDtype = StoreDtype.float32
    """The floating-point type every dataset is stored in (a run computes in float32; values are
    rounded once, when written).
    """
    compression: Compression | None = None
    """HDF5 compression filter of every chunk; null: none."""
    overwrite: bool = False
    """Replace an existing file at `path` (otherwise an existing file stops the run)."""
    queue_depth: int = 4
    """Batches waiting for the writer thread before the producer blocks."""
    checksum: bool = True
    """HDF5 fletcher32 checksum on every chunk: a damaged chunk fails loudly when read. false
    trades that for write speed (the checksum halves the writer's MiB/s).
    """


@dataclass
class DeviceConfig(Frozen):
    name: str = "cpu"
    """cpu | cuda | cuda:N | auto (cuda when available, else cpu)"""
    allow_tf32: bool = False
    """TF32 convolutions/matmuls change numbers at the 1e-3 level; off unless asked for."""


@dataclass
class RunConfig(Frozen):
    model: Any = MISSING
    dataset: Any = MISSING
    device: DeviceConfig = field(default_factory=DeviceConfig)
    seed: int = 0
    """Seeds every random draw of the run (random weights, fake data, noise, masks), so a run
    repeats.
    """
    deterministic: bool = False
    """Make PyTorch refuse nondeterministic kernels (torch.use_deterministic_algorithms)."""
    batch_size: int = 32
    """Samples per forward (and backward) pass."""
    limit: int | None = None
    """At most this many samples (the first ones, in dataset order); null = all."""
    num_workers: int = 0
    """Data-loader worker processes; 0 reads the data in the run's own process."""
    dry_run: bool = False
    """Print the plan (matched modules, sites, shapes, estimated file size) and stop before any
    batch runs.
    """
    resume: bool = False
    """Continue the interrupted captures.h5 at `sink.path` (or the run dir): the rows already
    written are kept, the rest computed.
    """
    target: TargetConfig = field(default_factory=TargetConfig)
    hooks: dict[str, Any] = field(default_factory=dict)
    sink: SinkConfig = field(default_factory=SinkConfig)
    weights_path: list[str] = field(default_factory=list)
    """Folders searched, in order, for torchvision checkpoint files before the torch hub cache and
    a download; a file counts only if its SHA-256 matches its name's hash.
    """
    progress: bool = True
    """Show a tqdm progress bar."""
    profile: bool = False
    """Time every stage (data, forward, backward, copy, write, queue wait) and print it."""
    render: bool = True
    """Pictures from the finished captures.h5 into <run dir>/images/<experiment>/."""
    render_max: int = 16
    """Pictures for at most this many samples (the first rows)."""
    render_style: str = "auto"
    """How attribution maps are drawn: clipped (at the 99th percentile of |value|, over the photo),
    seed (the seed tutorials' normalize), or auto: seed for the seeds' gradient experiments
    (guided_bp, guided_grad_cam, grad_scale), clipped for every other.
    """
    logger: str | None = None
    """null, or tensorboard: the pictures and the plan also go to <run dir>/tensorboard."""
    # Beside these, one free-form node per stage (hookrun/stage.py), each `{}` (off) unless
    # set: derive, evaluate, sanity, patching — see run_schema.


def run_schema() -> type:
    """RunConfig with one free-form node per registered stage (`derive:`, `evaluate:`,
    `sanity:`, `patching:`, ...; each stage parses and checks its own), the schema Hydra
    composes into: a new stage adds its node here without a line in this file."""
    return _schema(tuple(stage_nodes()))


@cache
def _schema(nodes: tuple[tuple[str, str], ...]) -> type:
    # RunConfig's fields in their order, each stage node after its key (a subclass could
    # only append them).
    types = get_type_hints(RunConfig)
    fields: list[tuple[str, Any, Any]] = []
    for base in dataclasses.fields(RunConfig):
        kept = field(default=base.default, default_factory=base.default_factory)
        fields.append((base.name, types[base.name], kept))
        fields += [
            (node, Any, field(default_factory=dict)) for node, after in nodes if after == base.name
        ]
    placed = {name for name, _, _ in fields}
    fields += [(node, Any, field(default_factory=dict)) for node, _ in nodes if node not in placed]
    return make_dataclass("RunConfig", fields, bases=(Frozen,), namespace={"__module__": __name__})


def conf_dir() -> Path:
    """The config tree: conf/ inside the installed package, else the checkout's conf/."""
    packaged = Path(str(importlib.resources.files("hookrun"))) / "conf"
    if (packaged / "config.yaml").is_file():
        return packaged
    return Path(__file__).resolve().parents[2] / "conf"


def _package_dir(name: str) -> str:
    """`${pkg_dir:NAME}`: the folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return f"<package {name} is not installed>"
    return str(list(spec.submodule_search_locations)[0])


def register_configs() -> None:
    """Store the top-level schema so conf/config.yaml can extend it; register resolvers."""
    ConfigStore.instance().store(name="hookrun_schema", node=run_schema())
    OmegaConf.register_new_resolver("pkg_dir", _package_dir, replace=True)
