"""Command-line keys that are short for longer ones: `lrp.composite=...` is
`derive.lrp.composite=...`.

LRP's options live under `derive.lrp`, as every derived method's do (the sanity check, the
sweeps and faithfulness read them there); `lrp.` is the spelling its users and issue 45
use. The overrides are rewritten before Hydra composes them, by `python -m hookrun` and by
`hookrun.run`/`hookrun.compose` alike, so `lrp.composite=a,b` sweeps too and the run's
file stores the long key.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SHORTHANDS", "expanded"]

SHORTHANDS = {"lrp": "derive.lrp"}


def expanded(overrides: Sequence[str]) -> list[str]:
    """`overrides` with each short key written out (Hydra's `+`, `++` and `~` kept;
    flags such as `-m` and overrides of other keys unchanged)."""
    out = []
    for given in overrides:
        if given.startswith("-"):
            out.append(given)
            continue
        body = given.lstrip("+~")
        sign = given[: len(given) - len(body)]
        key = body.split("=", 1)[0]
        for short, long in SHORTHANDS.items():
            if key == short or key.startswith(short + "."):
                body = long + body[len(short) :]
                break
        out.append(sign + body)
    return out
