"""Directions in a site's feature space (its last axis: a language model's width), for
`action: add` with `args.vector` (activation addition: ActAdd, Turner et al. 2023; contrastive
activation addition, Rimsky et al. 2024) and `action: ablate_direction` (Arditi et al.
2024). A vector is data, from one of:

    vector: steer.npy                      # a file holding one (D,) vector: .npy, .pt, .safetensors
    vector: {file: steer.safetensors, key: layer_1}          # one tensor of several
    vector: {file: happy/captures.h5, record: captures/transformer.h.1/output,
             positions: last, reduce: mean}                  # the mean of a stored run's rows
    vector: {prompts: happy.jsonl, positions: last}          # this run's model over prompts
    vector: {plus: SOURCE, minus: SOURCE}                     # the difference of two sources
    vector: {sae: DIR, latent: 1234}                          # a dictionary latent's decoder row

A prompts file ({prompt: ...} rows, as dataset=prompts reads them) gives the mean of the
hook's own site over its rows, measured with the run's model and tokenizer before any work
(pipeline/measure.py), one vector per site: a hook over several layers adds each layer's own.
A stored run gives the mean over its rows of the record at `positions`: `last` (each row's
last real token, by /samples/mask), `all` (every real token), or a record already of one
vector per row ((N, D): a capture with `args.positions: last`). A dictionary's latent gives
its decoder row in the model's space (hookrun/dictionaries: `Dictionary.decoder_direction`;
`name` picks one of a folder of several). Everything is read and checked before the first
batch, and each file's SHA-256 joins the run's provenance.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookrun.dictionaries.load import load_dictionaries
from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.io.stored import read_rows, record_rows, stored_record
from hookrun.models.weights import sha256_of

__all__ = ["VectorSource", "parse_vector", "read_vector"]

_TENSOR_FILES = (".npy", ".pt", ".safetensors")
_RUN_FILES = (".h5", ".hdf5")
_PROMPT_FILES = (".jsonl",)
_POSITIONS = ("last", "all")
_VALID = (
    "a .npy, .pt or .safetensors file of one (D,) vector, {file, key}, a stored run "
    "{file: captures.h5, record, positions: last|all, reduce: mean}, {prompts: a .jsonl of "
    "{prompt} rows, positions: last|all}, {sae: a dictionary's folder, latent: J}, or "
    "{plus: ..., minus: ...}"
)


@dataclass(frozen=True)
class VectorSource:
    """Where a vector comes from: a tensor file (`key`: which tensor), a stored run's record
    (`record`, `positions`), a prompts file the run's model reads (`prompts`, `positions`),
    or plus − minus."""

    file: Path | None = None
    key: str | None = None
    record: str | None = None
    positions: str = "last"
    plus: VectorSource | None = None
    minus: VectorSource | None = None
    prompts: bool = False  # `file` is a prompts .jsonl, measured at the hook's site
    latent: int | None = None  # `file` is a dictionary's folder: this latent's decoder row

    def files(self) -> list[Path]:
        if self.plus is not None and self.minus is not None:
            return [*self.plus.files(), *self.minus.files()]
        return [self.file] if self.file is not None else []

    def measured(self) -> list[VectorSource]:
        """Its prompts sources: what the run's model must read before any work."""
        if self.plus is not None and self.minus is not None:
            return [*self.plus.measured(), *self.minus.measured()]
        return [self] if self.prompts else []


def parse_vector(value: Any, key: str) -> VectorSource:
    """The VectorSource of `args.vector` (checked: its files exist and are of a kind read)."""
    if isinstance(value, str):
        return _file_source({"file": value}, key)
    if not isinstance(value, Mapping):
        raise HookrunError(f"{key}: {value!r}; valid: {_VALID}")
    given = dict(value)
    if "plus" in given or "minus" in given:
        if set(given) != {"plus", "minus"}:
            raise HookrunError(f"{key}: {sorted(given)}; valid: exactly plus and minus")
        plus = parse_vector(given["plus"], f"{key}.plus")
        minus = parse_vector(given["minus"], f"{key}.minus")
        return VectorSource(plus=plus, minus=minus)
    if "prompts" in given:
        return _prompts_source(given, key)
    if "sae" in given:
        return _latent_source(given, key)
    return _file_source(given, key)


def _latent_source(given: dict, key: str) -> VectorSource:
    extra = set(given) - {"sae", "latent", "name"}
    if extra:
        raise HookrunError(
            f"{key}.{sorted(extra)[0]}: not a key of a latent source; valid: sae, latent, name"
        )
    latent = given.get("latent")
    if isinstance(latent, bool) or not isinstance(latent, int) or latent < 0:
        raise HookrunError(f"{key}.latent: {latent!r}; valid: a latent index (an integer >= 0)")
    path = Path(str(given["sae"])).expanduser()
    if not path.exists():
        raise HookrunError(f"{key}.sae: {str(path)!r} does not exist (from {Path.cwd()})")
    name = given.get("name")
    return VectorSource(file=path, key=None if name is None else str(name), latent=latent)


def _prompts_source(given: dict, key: str) -> VectorSource:
    if given["prompts"] is None:
        raise HookrunError(f"{key}.prompts: null; valid: a .jsonl of {{prompt: ...}} rows")
    extra = set(given) - {"prompts", "positions"}
    if extra:
        raise HookrunError(
            f"{key}.{sorted(extra)[0]}: not a key of a prompts source; valid: prompts, positions"
        )
    path = Path(str(given["prompts"])).expanduser()
    if not path.is_file() or path.suffix.lower() not in _PROMPT_FILES:
        said = "does not exist" if not path.is_file() else "is not a .jsonl file"
        raise HookrunError(
            f"{key}.prompts: {str(path)!r} {said} (from {Path.cwd()}); valid: a .jsonl of "
            "{prompt: ...} rows"
        )
    return VectorSource(file=path, positions=_positions(given, key), prompts=True)


def _positions(given: dict, key: str) -> str:
    positions = str(given.get("positions", "last"))
    if positions not in _POSITIONS:
        raise HookrunError(f"{key}.positions: {positions!r}; valid: {', '.join(_POSITIONS)}")
    return positions


def _file_source(given: dict, key: str) -> VectorSource:
    if "file" not in given:
        raise HookrunError(f"{key}: {given}; valid: {_VALID}")
    path = Path(str(given["file"])).expanduser()
    if not path.is_file():
        raise HookrunError(
            f"{key}.file: {str(path)!r} does not exist (from {Path.cwd()}); valid: {_VALID}"
        )
    suffix = path.suffix.lower()
    if suffix in _TENSOR_FILES:
        extra = set(given) - {"file", "key"}
        if extra:
            raise HookrunError(
                f"{key}.{sorted(extra)[0]}: not a key of a tensor file; valid: file, key"
            )
        name = given.get("key")
        return VectorSource(file=path, key=None if name is None else str(name))
    if suffix in _RUN_FILES:
        extra = set(given) - {"file", "record", "positions", "reduce"}
        if extra:
            raise HookrunError(
                f"{key}.{sorted(extra)[0]}: not a key of a stored run; valid: file, record, "
                "positions, reduce"
            )
        if not given.get("record"):
            raise HookrunError(
                f"{key}.record: missing; valid: a dataset of {path}, e.g. "
                f"{layout.capture_key('<module>', 'output')}"
            )
        positions = _positions(given, key)
        if str(given.get("reduce", "mean")) != "mean":
            raise HookrunError(f"{key}.reduce: {given['reduce']!r}; valid: mean")
        return VectorSource(file=path, record=str(given["record"]).lstrip("/"), positions=positions)
    raise HookrunError(
        f"{key}.file: {path.name} is not a file a vector is read from; valid: "
        f"{', '.join(_TENSOR_FILES + _RUN_FILES)}"
    )


Measured = Mapping[tuple[VectorSource, str], torch.Tensor]


def read_vector(
    source: VectorSource, key: str, width: int, site: str = "", measured: Measured | None = None
) -> torch.Tensor:
    """The (width,) float64 vector of `source` for the site `site` (its capture path);
    `measured`: each prompts source's mean at each site, (source, site) → vector. HookrunError
    naming `key` when it is not one vector of the site's width."""
    if source.plus is not None and source.minus is not None:
        plus = read_vector(source.plus, f"{key}.plus", width, site, measured)
        return plus - read_vector(source.minus, f"{key}.minus", width, site, measured)
    assert source.file is not None
    if source.prompts:
        if measured is None or (source, site) not in measured:
            raise RuntimeError(f"{key}: {source.file} was not measured at /{site}")
        vector = measured[(source, site)]
    elif source.latent is not None:
        vector = _decoder_row(source, key)
    elif source.record is not None:
        vector = _run_mean(source, key)
    else:
        vector = _tensor_file(source, key)
    if vector.dim() > 1 and max(vector.shape) == vector.numel():  # (1, D) and the like
        vector = vector.reshape(-1)
    if vector.dim() != 1 or len(vector) != width:
        where = f"/{site}" if site else "the site"
        raise HookrunError(
            f"{key}: {source.file} gives a vector of shape {list(vector.shape)}; {where} has "
            f"width {width} (its last axis); valid: one ({width},) vector, at a site of the "
            "vector's width"
        )
    if not bool(torch.isfinite(vector).all()):
        raise HookrunError(
            f"{key}: {source.file} holds a value that is not finite; valid: finite values"
        )
    return vector.double()


def _decoder_row(source: VectorSource, key: str) -> torch.Tensor:
    """A dictionary latent's direction in the model's space, float64."""
    assert source.file is not None and source.latent is not None
    found = load_dictionaries(source.file, f"{key}.sae")
    if source.key is not None:
        named = {d.name: d for d in found}
        if source.key not in named:
            raise HookrunError(f"{key}.name: {source.key!r}; valid: {', '.join(sorted(named))}")
        found = [named[source.key]]
    if len(found) != 1:
        names = ", ".join(d.name for d in found)
        raise HookrunError(f"{key}.name: missing, and {source.file} holds {names}; valid: one")
    (d,) = found
    if source.latent >= d.d_sae:
        raise HookrunError(
            f"{key}.latent: {source.latent} is past the {d.d_sae} latents of {d.name}; valid: "
            f"0..{d.d_sae - 1}"
        )
    return d.decoder_direction(source.latent).detach().double()


def _tensor_file(source: VectorSource, key: str) -> torch.Tensor:
    path = source.file
    assert path is not None
    try:
        if path.suffix.lower() == ".npy":
            found: Any = torch.from_numpy(np.load(path, allow_pickle=False))
        elif path.suffix.lower() == ".pt":
            found = torch.load(path, map_location="cpu", weights_only=True)
        else:
            from safetensors.torch import load_file

            found = load_file(str(path))
    except Exception as err:  # numpy, torch and safetensors raise many types on a bad file
        first = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines() or [""]
        hint = (
            "; valid: tensors saved with torch.save (weights_only loading runs no pickled code)"
            if path.suffix.lower() == ".pt"
            else ""
        )
        raise HookrunError(
            f"{key}: {path} cannot be read ({type(err).__name__}: {first[0][:200]}){hint}"
        ) from None
    if isinstance(found, Mapping):
        found = {str(k): v for k, v in found.items()}  # a .pt dict may have integer keys
        names = sorted(found)
        name = source.key or (names[0] if len(names) == 1 else None)
        if name not in found:
            raise HookrunError(f"{key}.key: {source.key!r}; valid: {', '.join(names)}")
        found = found[name]
    elif source.key is not None:
        raise HookrunError(f"{key}.key: {source.key!r}, but {path} holds one tensor; valid: no key")
    if not isinstance(found, torch.Tensor) or not found.is_floating_point():
        raise HookrunError(
            f"{key}: {path} holds no floating-point tensor; valid: one (D,) float vector"
        )
    return found.detach().double()


def _run_mean(source: VectorSource, key: str) -> torch.Tensor:
    """The mean over a stored run's rows of its record at `positions` (real tokens only)."""
    path, record = source.file, source.record
    assert path is not None and record is not None
    state, shape, datasets = stored_record(path, record)
    if state.status != "complete":
        raise HookrunError(
            f"{key}.file: {path} is not complete (status {state.status}); valid: a finished "
            "run's file (resume=true finishes it)"
        )
    if shape is None:
        raise HookrunError(
            f"{key}.record: '/{record}' is not in {path}; valid: "
            + ", ".join(f"/{d}" for d in datasets if d.startswith(f"{layout.CAPTURES}/"))
        )
    if record_rows(path, record):
        raise HookrunError(
            f"{key}.record: '/{record}' is not stored one row per sample; valid: a capture "
            "with one row per sample"
        )
    rows = np.arange(state.completed)
    values = read_rows(path, record, rows)
    if not np.issubdtype(values.dtype, np.floating):  # token ids, masks: no activations
        raise HookrunError(
            f"{key}.record: '/{record}' holds {values.dtype} values; valid: a capture of "
            "activations (floating point)"
        )
    values = values.astype(np.float64)
    if values.ndim == 2:  # (N, D): one vector per row already (positions: last captures)
        return torch.from_numpy(values.mean(0))
    if values.ndim != 3:
        raise HookrunError(
            f"{key}.record: '/{record}' holds rows of shape {list(shape)}; valid: (tokens, "
            "width) or (width,) rows of a language model's run"
        )
    if layout.SAMPLES_MASK in datasets:
        mask = read_rows(path, layout.SAMPLES_MASK, rows).astype(bool)
    else:
        mask = np.ones(values.shape[:2], dtype=bool)
    if mask.shape[1] != values.shape[1]:
        raise HookrunError(
            f"{key}.record: '/{record}' holds {values.shape[1]} positions per row, not every "
            f"token; valid: a capture with args.positions: all, or one of (width,) rows"
        )
    if source.positions == "last":
        last = mask.sum(1) - 1
        return torch.from_numpy(values[np.arange(len(values)), last].mean(0))
    return torch.from_numpy(values[mask].mean(0))


def digests(source: VectorSource) -> dict[str, str]:
    """The provenance of the files a vector is read from: {file, sha256} (several joined)."""
    files = [p.resolve() for p in source.files()]
    # A dictionary's folder: its weights and configs, each hashed.
    files = [f for p in files for f in (_folder_files(p) if p.is_dir() else [p])]
    return {"file": ", ".join(map(str, files)), "sha256": ", ".join(sha256_of(p) for p in files)}


def _folder_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in (".safetensors", ".json"))
