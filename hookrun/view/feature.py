"""One unit's page: its top-k contexts shaded by activation (the maximum outlined), or an
image site's top patches; its histogram, density and logit effects; samples from each
activation quantile; links to the previous and next unit and back to the index."""

from __future__ import annotations

import html
import math

import numpy as np

from hookrun.view.assets import CSS_FILE
from hookrun.view.charts import histogram_svg
from hookrun.view.paths import INDEX, feature_page, patch_page_relative, to_root
from hookrun.view.source import SiteInfo
from hookrun.view.text import TokenTexts, context_html, number

__all__ = ["feature_html", "top_patches", "density_text", "PATCH_SIZE"]

PATCH_SIZE = 96  # CSS pixels an image patch is shown at (its pixels scaled, not smoothed)


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def density_text(density: float) -> str:
    """A density as the pages print it: the fraction and its log10 (`never fired` at 0)."""
    if not math.isfinite(density):
        return "—"
    if density <= 0:
        return "0 (never fired)"
    return f"{number(density)} (log10 {math.log10(density):.2f})"


def _scale(unit_max: float, values: np.ndarray) -> float:
    """The activation of full opacity: the unit's max, or for a unit whose activations are
    all at or below 0 the largest magnitude its windows show."""
    if math.isfinite(unit_max) and unit_max > 0:
        return unit_max
    finite = np.abs(values[np.isfinite(values)])
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def _fired(values: np.ndarray, rows: np.ndarray) -> list[int]:
    """The ranks that hold a sample (the rest are NaN / -1 padding)."""
    return [i for i in range(len(rows)) if rows[i] >= 0 and math.isfinite(float(values[i]))]


SAMPLE_PARTS = ("value", "row", "token", "context", "context_value")


def _samples(data: dict[str, np.ndarray], prefix: str, group: int | None = None) -> dict:
    """`top/…` or one quantile group's `quantiles/…` samples, by their short names."""
    out = {}
    for name in SAMPLE_PARTS:
        if f"{prefix}/{name}" in data:
            values = data[f"{prefix}/{name}"]
            out[name] = values if group is None else values[group]
    return out


def _contexts(texts: TokenTexts, site: SiteInfo, scale: float, samples: dict) -> str:
    """Samples' windows of tokens, one line each: activation, where, the shaded tokens."""
    values, rows, tokens = samples["value"], samples["row"], samples["token"]
    ranks = _fired(values, rows)
    if not ranks:
        return '<p class="none">No sample.</p>'
    out = []
    for i in ranks:
        spans = context_html(
            texts, samples["context"][i], samples["context_value"][i], site.window_before, scale
        )
        out.append(
            f'<div class="ctx" data-rank="{i}"><span class="val">{number(values[i])}</span>'
            f'<span class="where">row {int(rows[i])} · token {int(tokens[i])}</span>'
            f'<span class="toks">{spans}</span></div>'
        )
    return "".join(out)


def top_patches(site: SiteInfo, unit: int, data: dict[str, np.ndarray]) -> list[int]:
    """The ranks of an image unit's top patches that hold a sample (each written as a PNG)."""
    return _fired(data["top/value"], data["top/row"]) if site.has("top/patch") else []


def _boxes(data: dict[str, np.ndarray]) -> str:
    """An image site's top samples without patches (a site of one vector per image): each
    one's activation, row and the pixels it covers."""
    ranks = _fired(data["top/value"], data["top/row"])
    if not ranks:
        return '<p class="none">No sample.</p>'
    boxes = data.get("top/box")
    rows = []
    for i in ranks:
        box = " ".join(str(int(v)) for v in boxes[i]) if boxes is not None else ""
        rows.append(
            f'<tr data-rank="{i}"><td class="num">{number(data["top/value"][i])}</td>'
            f'<td class="num">{int(data["top/row"][i])}</td><td>{box}</td></tr>'
        )
    head = "<thead><tr><th>activation</th><th>row</th><th>y0 x0 y1 x1</th></tr></thead>"
    return f"<table>{head}{''.join(rows)}</table>"


def _patches(site: SiteInfo, unit: int, data: dict[str, np.ndarray]) -> str:
    if not site.has("top/patch"):
        return _boxes(data)
    ranks = top_patches(site, unit, data)
    if not ranks:
        return '<p class="none">No sample.</p>'
    boxes = data.get("top/box")
    out = []
    for i in ranks:
        where = f"row {int(data['top/row'][i])} · position {int(data['top/token'][i])}"
        if boxes is not None:
            y0, x0, y1, x1 = (int(v) for v in boxes[i])
            where += f"<br>pixels y {y0}–{y1}, x {x0}–{x1}"
        out.append(
            f'<figure class="patch" data-rank="{i}"><img src="{patch_page_relative(unit, i)}" '
            f'width="{PATCH_SIZE}" height="{PATCH_SIZE}" alt="top {i + 1}">'
            f'<figcaption><b class="val">{number(data["top/value"][i])}</b><br>{where}'
            "</figcaption></figure>"
        )
    return f'<div class="patches">{"".join(out)}</div>'


def _sample_table(values: np.ndarray, rows: np.ndarray, tokens: np.ndarray) -> str:
    ranks = _fired(values, rows)
    if not ranks:
        return '<p class="none">No sample.</p>'
    body = "".join(
        f'<tr><td class="num">{number(values[i])}</td><td class="num">{int(rows[i])}</td>'
        f'<td class="num">{int(tokens[i])}</td></tr>'
        for i in ranks
    )
    head = "<thead><tr><th>activation</th><th>row</th><th>position</th></tr></thead>"
    return f"<table>{head}{body}</table>"


def _quantiles(texts: TokenTexts, site: SiteInfo, scale: float, data: dict) -> str:
    if not site.has("quantiles/edges") or not site.has("quantiles/value"):
        return ""
    edges, values = data["quantiles/edges"], data["quantiles/value"]
    text = site.has("quantiles/context") and site.has("quantiles/context_value")
    cut = "Interval" if site.grouping == "intervals" else "Quantile"
    out = [f"<h2>{cut} groups</h2>"]
    for g in reversed(range(values.shape[0])):  # the highest group first, below the top k
        lo, hi = number(edges[g]), number(edges[g + 1])
        samples = _samples(data, "quantiles", g)
        if text:
            inner = _contexts(texts, site, scale, samples)
        else:
            inner = _sample_table(samples["value"], samples["row"], samples["token"])
        out.append(
            f'<section class="group" data-group="{g}"><h3>group {g + 1} of {values.shape[0]}: '
            f"{lo} to {hi}</h3>{inner}</section>"
        )
    return "".join(out)


def _logits(texts: TokenTexts, site: SiteInfo, data: dict) -> str:
    if not site.has("logits/top_token"):
        return ""
    tables = []
    for side, label in (("top", "pushed up"), ("bottom", "pushed down")):
        if not site.has(f"logits/{side}_token"):
            continue
        tokens, values = data[f"logits/{side}_token"], data[f"logits/{side}_value"]
        body = "".join(
            f'<tr><td class="tok">{texts.visible(int(t))}</td><td class="num">{number(v)}</td></tr>'
            for t, v in zip(tokens.tolist(), values.tolist(), strict=True)
            if t >= 0
        )
        tables.append(
            f'<div><h3>{label}</h3><table class="logit" id="logits-{side}"><tbody>{body}'
            "</tbody></table></div>"
        )
    return f'<h2>Logit effects</h2><div class="logits">{"".join(tables)}</div>'


def feature_html(texts: TokenTexts, site: SiteInfo, unit: int, data: dict[str, np.ndarray]) -> str:
    """The page of one unit.

    Args:
        texts: The vocabulary.
        site: Its site.
        unit: The unit's index.
        data: Its rows of every per-unit dataset (`read_block`'s names, the unit axis gone).

    Returns:
        The page's HTML.
    """
    page = feature_page(site.module, site.site, unit)
    root = to_root(page)
    unit_max, density = float(data["max"]), float(data["density"])
    if site.modality == "image":
        top, scale = _patches(site, unit, data), 1.0
    else:
        scale = _scale(unit_max, data["top/context_value"])
        top = _contexts(texts, site, scale, _samples(data, "top"))
    pager = [f'<a id="index-link" href="{root}{INDEX}">index</a>']
    if unit > 0:
        pager.append(f'<a rel="prev" href="{unit - 1}.html">← unit {unit - 1}</a>')
    if unit + 1 < site.units:
        pager.append(f'<a rel="next" href="{unit + 1}.html">unit {unit + 1} →</a>')
    facts = [f"kind <b>{_esc(site.kind)}</b>"]
    if site.dictionary:
        facts.append(f"dictionary <b>{_esc(site.dictionary)}</b>")
    facts += [
        f'max <b id="max">{number(unit_max)}</b>',
        f'density <b id="density">{density_text(density)}</b>',
    ]
    if site.tokens:
        facts.append(f"of {site.tokens} {'positions' if site.modality == 'image' else 'tokens'}")
    histogram = ""
    if site.has("histogram/edges") and site.has("histogram/counts"):
        histogram = "<h2>Activation histogram</h2>" + histogram_svg(
            data["histogram/edges"], data["histogram/counts"]
        )
    title = f"unit {unit} · {site.title}"
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{_esc(title)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<link rel="stylesheet" href="{root}{CSS_FILE}"></head><body>'
        f'<nav class="pager">{" ".join(pager)}</nav>'
        f'<h1>unit <span id="unit">{unit}</span> <span class="facts">{_esc(site.title)}</span></h1>'
        f'<p class="facts">{" · ".join(facts)}</p>'
        f'<h2>Top activations</h2><div id="top">{top}</div>'
        f"{histogram}{_logits(texts, site, data)}{_quantiles(texts, site, scale, data)}"
        "</body></html>\n"
    )
