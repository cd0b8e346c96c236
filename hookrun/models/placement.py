"""A Hugging Face model spread over several devices, the CPU and disk: `model.device_map`
(auto | balanced | balanced_low_0 | sequential, or {module name: cuda:N | cpu | disk}),
`model.max_memory` ({0: 10GiB, cpu: 30GiB, ...}: what each device may hold) and
`model.offload_folder` (where the weights that go to disk are kept), read by transformers'
`from_pretrained` through Accelerate.

Before any work the map is worked out on the meta-built model with Accelerate's
`infer_auto_device_map` (the one `from_pretrained` makes): a device that does not exist, a
map that sends weights to disk without an offload folder, or a map that names no module of
the model is refused in one line, naming the bytes. The model is then not moved to
`device.name`: each module computes where the map put it (a module on disk on the CPU, its
weights read in for its forward), Accelerate's hooks move tensors between them, and the
run's inputs go to `device.name`. A module whose weights are on disk has them on the meta
device between forwards: `execution_device` says where it computes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookrun.errors import HookrunError
from hookrun.extras import missing_extra

__all__ = ["STRATEGIES", "check_placement", "placement_kwargs", "execution_device", "is_placed"]

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_VALID_MAP = f"{', '.join(STRATEGIES)}, or {{module name: cuda:N | cpu | disk}}"
_SIZE = re.compile(r"^\s*(\d+(\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)


def is_placed(cfg: Any) -> bool:
    return cfg.device_map is not None


def _device(value: Any, key: str) -> str | int:
    """A map's or max_memory's device as Accelerate names it: a GPU index, cpu or disk."""
    text = str(value).strip()
    if text in ("cpu", "disk"):
        return text
    index = text.removeprefix("cuda:") if text.startswith("cuda:") else text
    if index.isdigit():
        count = torch.cuda.device_count()
        if int(index) >= count:
            raise HookrunError(
                f"{key}: {value!r} but this machine has {count} CUDA device(s); valid: "
                + (f"cuda:0..cuda:{count - 1}, " if count else "")
                + "cpu, disk"
            )
        return int(index)
    raise HookrunError(f"{key}: {value!r}; valid: cuda:N (or N), cpu, disk")


def _bytes(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    found = _SIZE.match(str(value)) if not isinstance(value, bool) else None
    if not found or float(found.group(1)) <= 0:
        raise HookrunError(f"{key}: {value!r}; valid: bytes, as an integer or such as '10GiB'")
    unit = (found.group(3) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    scale |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(float(found.group(1)) * scale[unit])


def _parsed(cfg: Any) -> tuple[Any, dict | None]:
    """The device map and max_memory as Accelerate takes them; refused in one line."""
    given = cfg.device_map
    if isinstance(given, str):
        if given not in STRATEGIES:
            raise HookrunError(f"model.device_map: {given!r}; valid: {_VALID_MAP}")
        device_map: Any = given
    elif isinstance(given, Mapping) and given:
        device_map = {str(k): _device(v, f"model.device_map.{k}") for k, v in given.items()}
    else:
        raise HookrunError(f"model.device_map: {given!r}; valid: {_VALID_MAP}")
    memory = None
    if cfg.max_memory is not None:
        if not isinstance(cfg.max_memory, Mapping) or not cfg.max_memory:
            raise HookrunError(
                f"model.max_memory: {cfg.max_memory!r}; valid: {{device: bytes}}, such as "
                "{0: 10GiB, cpu: 30GiB}"
            )
        memory = {
            _device(k, f"model.max_memory.{k}"): _bytes(v, f"model.max_memory.{k}")
            for k, v in cfg.max_memory.items()
        }
    return device_map, memory


def check_placement(cfg: Any, meta: nn.Module | None) -> None:
    """Refuse, before any work, a placement that cannot be: keys without a map, a map
    without model.path, bad devices or sizes, weights sent to disk without an offload
    folder. `meta`: the model built on the meta device (None: not built, remote code)."""
    if cfg.device_map is None:
        for key in ("max_memory", "offload_folder"):
            if getattr(cfg, key) is not None:
                raise HookrunError(
                    f"model.{key}: {getattr(cfg, key)!r} without model.device_map; valid: "
                    f"null, or model.device_map={STRATEGIES[0]}"
                )
        return
    if cfg.path is None:
        raise HookrunError(
            f"model.device_map: {cfg.device_map!r} with model.config (a random init); valid: "
            "null, or a model.path folder (its weights are read onto the devices)"
        )
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise missing_extra(
            f"model.device_map: {cfg.device_map!r}", "hf", "model.device_map=null"
        ) from None
    device_map, memory = _parsed(cfg)
    if meta is None:
        return
    placed = _inferred(meta, device_map, memory, cfg.dtype)
    sizes = _sizes(meta, cfg.dtype)
    on_disk = sorted({m for m, d in placed.items() if d == "disk"})
    if on_disk and cfg.offload_folder is None:
        raise HookrunError(_disk_without_folder(cfg, on_disk, sizes))


def _disk_without_folder(cfg: Any, on_disk: list[str], sizes: dict[str, int]) -> str:
    """The refusal of weights sent to disk with no offload folder, naming what sent them
    there: the map itself ({module: disk}), or a strategy under model.max_memory (or, with
    none given, under the memory Accelerate found free on this machine)."""
    held = sum(sizes.get(m, 0) for m in on_disk)
    modules = ", ".join(on_disk[:3]) + (", …" if len(on_disk) > 3 else "")
    # A module whose weights are tied to another's (GPT-2's lm_head) counts 0 bytes of its own.
    weights = f"{modules} ({held:,} of the model's {sizes.get('', 0):,} bytes)" if held else modules
    if not isinstance(cfg.device_map, str):  # the user's own map says disk
        return (
            f"model.device_map: sends {weights} to disk without model.offload_folder; valid: "
            "model.offload_folder=DIR, or cpu / cuda:N for those modules"
        )
    under = (
        f"under model.max_memory {cfg.max_memory!r}"
        if cfg.max_memory is not None
        else "(model.max_memory null: the memory free on this machine)"
    )
    return (
        f"model.device_map: {cfg.device_map!r} {under} leaves {weights} for the disk, without "
        "model.offload_folder; valid: model.offload_folder=DIR, or more model.max_memory"
    )


def _sizes(meta: nn.Module, dtype: str) -> dict[str, int]:
    from accelerate.utils import compute_module_sizes

    return dict(compute_module_sizes(meta, dtype=_torch_dtype(dtype)))


def _inferred(meta: nn.Module, device_map: Any, memory: dict | None, dtype: str) -> dict:
    """Module name → device, as from_pretrained would place the model."""
    if isinstance(device_map, dict):
        names = {name for name, _ in meta.named_modules()}
        unknown = [k for k in device_map if k and k not in names]
        if unknown:
            raise HookrunError(
                f"model.device_map: {unknown[0]!r} is no module of the model; valid: module "
                "names such as transformer.h.0 (or '' for the whole model)"
            )
        return device_map
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    keep = getattr(meta, "_no_split_modules", None) or []
    if device_map != "sequential":
        memory = get_balanced_memory(
            meta,
            max_memory=memory,
            no_split_module_classes=keep,
            dtype=_torch_dtype(dtype),
            low_zero=device_map == "balanced_low_0",
        )
    return infer_auto_device_map(
        meta, max_memory=memory, no_split_module_classes=keep, dtype=_torch_dtype(dtype)
    )


def _torch_dtype(dtype: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def placement_kwargs(cfg: Any) -> dict[str, Any]:
    """from_pretrained's keyword arguments for the placement (none without a map)."""
    if cfg.device_map is None:
        return {}
    device_map, memory = _parsed(cfg)
    out: dict[str, Any] = {"device_map": device_map}
    if memory is not None:
        out["max_memory"] = memory
    if cfg.offload_folder is not None:
        folder = Path(cfg.offload_folder).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        out["offload_folder"] = str(folder)
    return out


def execution_device(module: nn.Module) -> torch.device | None:
    """Where `module` computes: the execution device of Accelerate's hook on it or on one
    of its submodules (a mapped model: its weights may be on the meta device between
    forwards), else its first parameter's device; None when neither says."""
    for part in module.modules():
        hook = getattr(part, "_hf_hook", None)
        for one in [hook, *getattr(hook, "hooks", [])]:
            device = getattr(one, "execution_device", None)
            if device is not None:
                return (
                    torch.device("cuda", device)
                    if isinstance(device, int)
                    else torch.device(device)
                )
    param = next(module.parameters(), None)
    return None if param is None or param.device.type == "meta" else param.device
