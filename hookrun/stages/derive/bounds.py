"""Bounds of the derived methods' arguments, checked before any work: rows per extra pass,
numbers the model's input can hold (baselines), and what one batch's passes allocate at once
against the machine's memory (memory.check_fits), each refusal naming its key."""

from __future__ import annotations

import math
from typing import Any

import torch

from hookrun.errors import HookrunError
from hookrun.memory import check_fits

__all__ = ["check_rows_per_pass", "check_number", "check_pass_rows"]


def check_rows_per_pass(key: str, value: int | None) -> None:
    """`internal_batch_size`: null (sized by the input) or a positive number of rows."""
    if value is not None and value < 1:
        raise HookrunError(
            f"{key}.internal_batch_size: {value} is out of range; valid: >= 1, or null (by "
            "input size)"
        )


def check_number(key: str, value: Any, dtype: torch.dtype = torch.float32) -> None:
    """A number written into the model's input (a baseline): finite and within what `dtype`
    holds — NaN or infinity would make every map NaN, and torch refuses to fill a float32
    tensor with 1e39."""
    most = float(torch.finfo(dtype).max)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and abs(value) <= most):
        name = str(dtype).removeprefix("torch.")
        raise HookrunError(
            f"{key}: {value!r} is not a number the input ({name}) holds; valid: a finite "
            f"number from {-most:.4g} to {most:.4g}"
        )


def check_pass_rows(
    key: str, given: int | None, rows: int, each: int, row: tuple[int, ...]
) -> None:
    """`key.internal_batch_size`=`given` rows a pass, for a batch of `rows` whose extra
    passes run `each` rows per batch row, each row of shape `row` (float32): a pass holds
    min(given, rows x each) of them at once. Null sizes passes by the input: nothing to
    check."""
    if not given:
        return
    extra = min(given, rows * max(each, 1))
    what = f"one extra pass of {extra} x {list(row)}"
    check_fits(f"{key}.internal_batch_size", given, extra * 4 * math.prod(row), what)
