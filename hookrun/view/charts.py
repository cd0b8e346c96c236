"""A unit's activation histogram as an inline SVG (drawn here: no chart library, nothing
fetched), each bar's title its bin's edges and count."""

from __future__ import annotations

import numpy as np

from hookrun.view.text import number

__all__ = ["histogram_svg", "WIDTH", "HEIGHT"]

WIDTH, HEIGHT = 480, 150  # the plotting area, in SVG units
_LEFT, _BOTTOM, _TOP = 44, 22, 6  # room for the count axis, the edges' labels, the top


def histogram_svg(edges: np.ndarray, counts: np.ndarray) -> str:
    """The histogram of one unit (fired tokens only, as the file counts them).

    Args:
        edges: (bins + 1,) the bins' edges, ascending.
        counts: (bins,) tokens in each bin.

    Returns:
        An `<svg>` element (bars' heights ∝ count, a linear count axis from 0), or a
        paragraph saying the unit never fired.
    """
    counts = np.asarray(counts, dtype=np.int64)
    edges = np.asarray(edges, dtype=np.float64)
    total = int(counts.sum())
    if total == 0 or not np.isfinite(edges).all() or edges[-1] <= edges[0]:
        return '<p class="none">No activation above 0: the unit never fired.</p>'
    top = int(counts.max())
    lo, hi = float(edges[0]), float(edges[-1])
    span = hi - lo
    width, height = _LEFT + WIDTH + 8, _TOP + HEIGHT + _BOTTOM
    parts = [
        f'<svg class="histogram" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="activation histogram, {total} tokens">'
    ]
    for a, b, n in zip(edges[:-1].tolist(), edges[1:].tolist(), counts.tolist(), strict=True):
        x = _LEFT + (a - lo) / span * WIDTH
        w = max((b - a) / span * WIDTH - 0.5, 0.5)
        h = n / top * HEIGHT
        y = _TOP + HEIGHT - h
        parts.append(
            f'<rect class="bar" x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h:.2f}" '
            f'data-count="{n}"><title>[{number(a)}, {number(b)}): {n}</title></rect>'
        )
    base = _TOP + HEIGHT
    parts += [
        f'<line class="axis" x1="{_LEFT}" y1="{base}" x2="{_LEFT + WIDTH}" y2="{base}"/>',
        f'<line class="axis" x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{base}"/>',
        f'<text x="{_LEFT}" y="{base + 15}" text-anchor="start">{number(lo)}</text>',
        f'<text x="{_LEFT + WIDTH}" y="{base + 15}" text-anchor="end">{number(hi)}</text>',
        f'<text x="{_LEFT - 4}" y="{_TOP + 10}" text-anchor="end">{top}</text>',
        f'<text x="{_LEFT - 4}" y="{base}" text-anchor="end">0</text>',
        "</svg>",
    ]
    return "".join(parts)
