"""What a generation says in the run's summary, read from the file alone: the first rows'
text, the generated tokens' mean log probability under the hooked model and (with
generate.fluency) under the model without hooks, and — where value-changing hooks changed
nothing a row shows (/generation/unchanged) — how many rows; every row: a warning."""

from __future__ import annotations

import h5py
import numpy as np

from hookrun.io import layout
from hookrun.io.encoding import read_floats
from hookrun.stages.generate.keys import LOGPROBS, LOGPROBS_UNHOOKED, TEXT, UNCHANGED

__all__ = ["WARNING", "summary_lines", "mean_logprobs"]

WARNING = "generate: warning: "  # the start of the summary's line that is also logged
_SHOWN_ROWS = 3


def summary_lines(f: h5py.File, rows: int) -> list[str]:
    """The summary's lines of a generation ([] when the file holds none)."""
    if TEXT not in f:
        return []
    shown = min(rows, _SHOWN_ROWS)
    texts = [t.decode("utf-8") for t in f[TEXT][:shown]]
    lines = [f"generated, sample {i}: {t!r}" for i, t in enumerate(texts)]
    hooked, plain = mean_logprobs(f, rows)
    if plain is None:
        lines.append(
            f"generated tokens' mean log probability: {hooked:.3f} under the hooked model "
            "(generate.fluency=false: not scored without the hooks)"
        )
    else:
        lines.append(
            f"generated tokens' mean log probability: {hooked:.3f} under the hooked model, "
            f"{plain:.3f} under the model without hooks (fluency)"
        )
    said = _changed_nothing(f, rows)
    return [*lines, said] if said else lines


def mean_logprobs(f: h5py.File, rows: int) -> tuple[float, float | None]:
    """The generated tokens' mean log probability under the hooked model and under the
    model without hooks (fluency; None when not stored), over every real token of the
    first `rows` rows."""
    hooked = float(np.nanmean(read_floats(f[LOGPROBS], slice(0, rows))))
    if LOGPROBS_UNHOOKED not in f:
        return hooked, None
    return hooked, float(np.nanmean(read_floats(f[LOGPROBS_UNHOOKED], slice(0, rows))))


def _changed_nothing(f: h5py.File, rows: int) -> str:
    """The line saying on how many rows the value-changing hooks changed nothing (every
    row: a warning); '' where they changed something on every row, or nothing tells."""
    if UNCHANGED not in f or rows < 1:
        return ""
    same = int(np.count_nonzero(f[UNCHANGED][:rows]))
    given = layout.attr(f[UNCHANGED], "hooks")
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in given]
    hooks = ", ".join(f"hooks.{name}" for name in names) or "the hooks"
    tolerance = float(layout.attr(f[UNCHANGED], "tolerance"))
    them = "them" if len(names) > 1 else "it"
    if same == rows:
        return (
            f"{WARNING}{hooks} changed nothing: on all {rows} rows the model without {them} "
            f"gives each generated token the same log probability (to {tolerance:.0e} nats) "
            "and the same most likely token (greedy: the same text); e.g. a constant added to "
            "every feature, which the next LayerNorm's mean subtraction removes (a direction "
            "steers: args.vector)"
        )
    if same:
        return f"generate: {hooks} changed nothing on {same} of {rows} rows (/{UNCHANGED})"
    return ""
