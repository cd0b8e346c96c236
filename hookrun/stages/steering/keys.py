"""Where steering is stored in captures.h5: /steering/vector/<site> (D,) float64, the
direction each hook added (or removed) at each site — `<site>` its capture path without
`captures/`, e.g. /steering/vector/transformer.h.1/output — with its hook, action, scale,
normalize, source (the `args.vector` given, as JSON), file and sha256 as attributes; the
/steering group's attributes say the effect metric and the scale of the run."""

from __future__ import annotations

from hookrun.io.layout import CAPTURES

__all__ = ["STEERING", "VECTORS", "vector_key", "site_of"]

STEERING = "steering"
VECTORS = f"{STEERING}/vector"


def vector_key(site: str) -> str:
    """/steering/vector/<site> of a capture path (captures/<module>/<site>)."""
    return f"{VECTORS}/{site.removeprefix(CAPTURES + '/')}"


def site_of(key: str) -> str:
    """The module and site (`transformer.h.1/output`) of a /steering/vector dataset path."""
    return key.removeprefix(VECTORS + "/")
