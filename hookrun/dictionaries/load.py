"""`load_dictionaries`: whatever a config's path names, as a list of Dictionary.

A path is one of four things, told apart by what is on disk, not by a setting the user
could get wrong: a SAELens folder (cfg.json), a folder of SAELens folders (one SAE per
hook, as SAELens releases are laid out), a circuit-tracer transcoder folder
(layer_<i>.safetensors) or a single .safetensors file (SAELens's weights beside their
cfg.json, or one circuit-tracer layer). Every file is read and checked here, before any
model runs, and every refusal is one line naming the key.
"""

from __future__ import annotations

from pathlib import Path

from hookrun.dictionaries.circuit_tracer import layer_files, load_layer_file
from hookrun.dictionaries.dictionary import Dictionary
from hookrun.dictionaries.saelens_folder import (
    CFG,
    WEIGHTS,
    is_saelens_folder,
    load_saelens_folder,
)
from hookrun.errors import HookrunError

__all__ = ["load_dictionaries"]

_VALID = (
    f"valid: a SAELens folder ({CFG} + {WEIGHTS}), a folder of SAELens folders, a "
    "circuit-tracer folder of layer_<i>.safetensors, or one .safetensors file"
)


def load_dictionaries(path: str | Path, key: str) -> list[Dictionary]:
    """Every dictionary `path` holds, read and checked.

    Args:
        path: a SAELens folder; a folder of SAELens folders (all loaded, sorted by name); a
            circuit-tracer folder of layer_<i>.safetensors (by layer); or a .safetensors
            file (sae_weights.safetensors beside its cfg.json, else a circuit-tracer layer).
        key: the config key that named the path (e.g. `hooks.sae.args.path`), for messages.

    Returns:
        The dictionaries, tensors on the CPU in the files' dtypes (`Dictionary.to` moves
        them).

    Raises:
        HookrunError: the path is missing or holds no dictionary, or a file in it is refused
            (unknown architecture or normalize_activations, a tensor missing, misshapen or
            not finite); one line naming `key`, the value and what is valid.
    """
    where = Path(path).expanduser()
    if not where.exists():
        raise HookrunError(f"{key}: {str(path)!r} does not exist; {_VALID}")
    if where.is_file():
        if where.suffix != ".safetensors":
            raise HookrunError(f"{key}: {str(path)!r} is not a .safetensors file; {_VALID}")
        if where.name == WEIGHTS and is_saelens_folder(where.parent):
            return [load_saelens_folder(where.parent, key)]
        return [load_layer_file(where, key)]
    if is_saelens_folder(where):
        return [load_saelens_folder(where, key)]
    layers = layer_files(where)
    if layers:
        return [load_layer_file(file, key) for file in layers]
    inner = sorted(p for p in where.iterdir() if p.is_dir() and is_saelens_folder(p))
    if inner:
        return [load_saelens_folder(folder, key) for folder in inner]
    if (where / WEIGHTS).is_file():
        raise HookrunError(f"{key}: {str(path)!r} has {WEIGHTS} but no {CFG}; {_VALID}")
    raise HookrunError(f"{key}: {str(path)!r} holds no dictionary; {_VALID}")
