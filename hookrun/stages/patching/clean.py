"""A stored clean run for experiment=lm_patching (`patching.clean: PATH`), so that the clean
and the corrupted runs can be separate jobs: the clean activations and logits are read from
a captures.h5 of the same prompts instead of a clean forward pass per batch.

The stored run must have captured, at every position (`args.positions: all`, the default),
the output of every module the grid patches (`/captures/<module>/output`, (N, T, D); for
`heads` the output projection's input, `at: input`), with the patching run's attention
implementation (lm_cache loads sdpa: add model.attention=eager for an eager grid), and
hold /model/output (the logits at the read position, every run has it), /samples/index and
/samples/tokens. `experiment=lm_cache dataset=prompts dataset.path=SAME sink.dtype=float32`
writes it for `resid`; float16 clean activations give a grid within float16 of the
one-run grid. Everything is checked before any work, naming what is missing; the file's
SHA-256 goes into the /patching group's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.io.encoding import read_floats
from hookrun.models.weights import sha256_of
from hookrun.stages.patching.resume import HEADS

__all__ = ["StoredClean", "open_clean"]

_KEY = "patching.clean"


@dataclass(frozen=True)
class StoredClean:
    """Where each site's clean activations are, and which stored row each sample is."""

    path: Path
    records: dict[str, list[str]]  # site kind → the capture dataset per layer
    rows: dict[int, int]  # dataset index → stored row
    sha256: str
    # clean = corrupted within this share of a row's largest logit (keys.py CLEAN_TOLERANCE)
    tolerance: float

    def read(self, index: torch.Tensor, device: torch.device) -> tuple[dict, torch.Tensor]:
        """The batch's clean outputs per site kind and layer ((N, T, D) float32 each) and
        its clean logits (N, V), in the order of `index` (the dataset indices)."""
        rows = np.array([self.rows[int(i)] for i in index.tolist()])
        unique, inverse = np.unique(rows, return_inverse=True)  # HDF5 reads increasing rows

        def load(f: Any, key: str) -> torch.Tensor:
            values = np.asarray(read_floats(f[key], unique), dtype=np.float32)[inverse]
            return torch.from_numpy(values).to(device)

        with layout.open_readonly(self.path) as f:
            seen = {kind: [load(f, key) for key in keys] for kind, keys in self.records.items()}
            return seen, load(f, layout.MODEL_OUTPUT)


def open_clean(path_text: str, modules: dict[str, list[str]], tokens: Any, rows: int):
    """The StoredClean of `patching.clean` for the grid's `modules` (site kind → module per
    layer) and the run's first `rows` token rows, checked: a complete file, every record
    there with the run's shapes, every row there holding the same prompt tokens."""
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise HookrunError(f"{_KEY}: {path} is not a file; valid: the captures.h5 of a clean run")
    try:
        state = layout.read_state(path)
    except OSError as err:
        raise HookrunError(f"{_KEY}: {path} cannot be read as a captures.h5 ({err})") from None
    if state.status != "complete":
        raise HookrunError(
            f"{_KEY}: {path} is {state.status or 'not a hookrun file'}; valid: a complete run"
        )
    length = int(tokens.ids.shape[1])
    records: dict[str, list[str]] = {}
    with layout.open_readonly(path) as f:
        for kind, names in modules.items():
            records[kind] = []
            site = "input" if kind == HEADS else "output"  # heads: the output projection's
            for name in names:
                # A module returning a tuple (attention) has its first tensor as output_0.
                both = [layout.capture_key(name, site, n_tensors=n) for n in (1, 2)]
                key = next((k for k in both if k in f), None)
                if key is None:
                    raise HookrunError(
                        f"{_KEY}: {path} has no /{both[0]} for the {kind} grid; valid: a run "
                        f"that captured every patched module's {site} at every position"
                    )
                records[kind].append(key)
        for keys in records.values():
            for key in keys:
                if f[key].ndim != 3 or f[key].shape[1] != length:
                    raise HookrunError(
                        f"{_KEY}: /{key} holds rows of shape {list(f[key].shape[1:])}; valid: "
                        f"(tokens={length}, width) rows, captured with args.positions: all"
                    )
        for key in (layout.MODEL_OUTPUT, layout.SAMPLES_INDEX, layout.SAMPLES_TOKENS):
            if key not in f:
                raise HookrunError(f"{_KEY}: {path} has no /{key}; valid: a run of token data")
        tolerance = _tolerance(f[layout.MODEL_OUTPUT])
        index = f[layout.SAMPLES_INDEX][: state.completed]
        stored_tokens = f[layout.SAMPLES_TOKENS][: state.completed]
    where = {int(i): r for r, i in enumerate(index)}
    for row in range(rows):
        name, line = tokens.sources[row]
        n = int(tokens.lengths[row])
        if row not in where:
            raise HookrunError(
                f"{_KEY}: {path} has no row for {name}:{line}; valid: a run of the same prompts"
            )
        stored = stored_tokens[where[row]]
        if stored.shape[0] != length or not np.array_equal(stored[:n], tokens.ids[row, :n]):
            raise HookrunError(
                f"{_KEY}: {path} row {where[row]} holds other tokens than {name}:{line}; "
                "valid: a run of the same prompts with the same tokenizer"
            )
    return StoredClean(path.resolve(), records, where, sha256_of(path), tolerance)


def _tolerance(logits: Any) -> float:
    """How far a stored logit difference may be from the same difference computed now: the
    rounding of the two stored logits (each half an epsilon of the stored dtype of the
    largest logit), at least 2^-16 of it (float32 sums in another batch or attention
    kernel), twice over."""
    eps = 2.0**-7 if layout.is_bfloat16(logits) else float(np.finfo(logits.dtype).eps)
    return 2 * max(eps, 2.0**-16)
