"""The index page: per site a table of its units (max activation, density as log10, the
top context's text or patch), sortable by max and density, one search box over every
table, each row linking to its unit's page."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import numpy as np

from hookrun.view.assets import CSS_FILE, JS_FILE
from hookrun.view.paths import feature_page, patch_page_relative
from hookrun.view.source import SiteInfo
from hookrun.view.text import TokenTexts, context_text, number

__all__ = ["IndexRow", "index_row", "index_html"]

THUMB = 32  # CSS pixels of an image site's top patch in the index


@dataclass(frozen=True)
class IndexRow:
    """One unit's row of the index."""

    unit: int
    max: float
    density: float
    cell: str  # the top context's HTML (or the top patch's <img>)
    search: str  # what the search box matches: the top context's raw text, lower-cased


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _log10(density: float) -> str:
    if not math.isfinite(density):
        return "—"
    return f"{math.log10(density):.2f}" if density > 0 else "−∞"


def index_row(
    texts: TokenTexts, site: SiteInfo, unit: int, data: dict[str, np.ndarray]
) -> IndexRow:
    """The index's row of one unit, from its data (as `feature_html` gets it).

    Args:
        texts: The vocabulary.
        site: Its site.
        unit: The unit's index.
        data: Its rows of every per-unit dataset.

    Returns:
        The row.
    """
    fired = int(data["top/row"][0]) >= 0 and math.isfinite(float(data["top/value"][0]))
    cell, search = '<span class="none">never fired</span>', ""
    if fired and site.modality == "image" and site.has("top/patch"):
        page_dir = feature_page(site.module, site.site, unit).rsplit("/", 1)[0]
        cell = (
            f'<img class="thumb" src="{page_dir}/{patch_page_relative(unit, 0)}" '
            f'width="{THUMB}" height="{THUMB}" alt="top patch"> row {int(data["top/row"][0])}'
        )
    elif fired and site.has("top/context"):
        ids = data["top/context"][0]
        centre = site.window_before
        cell = "".join(
            f"<b>{texts.plain(t)}</b>" if i == centre else texts.plain(t)
            for i, t in enumerate(ids.tolist())
            if t >= 0
        )
        search = context_text(texts, ids).lower()
    return IndexRow(unit, float(data["max"]), float(data["density"]), cell, search)


def _attr_float(value: float) -> str:
    # repr round-trips a float64 exactly, and JavaScript's parseFloat reads it back equal.
    return repr(float(value)) if math.isfinite(value) else "NaN"


def _table(site: SiteInfo, rows: list[IndexRow]) -> str:
    body = "".join(
        f'<tr data-unit="{r.unit}" data-max="{_attr_float(r.max)}" '
        f'data-density="{_attr_float(r.density)}" data-search="{_esc(r.search)}">'
        f'<td class="num"><a href="{feature_page(site.module, site.site, r.unit)}">{r.unit}</a>'
        f'</td><td class="num">{number(r.max)}</td><td class="num">{_log10(r.density)}</td>'
        f'<td class="text">{r.cell}</td></tr>'
        for r in rows
    )
    what = "top patch" if site.modality == "image" else "top context"
    return (
        f'<table class="units" data-module="{_esc(site.module)}" data-site="{_esc(site.site)}">'
        '<thead><tr><th data-sort="unit">unit</th><th data-sort="max">max</th>'
        f'<th data-sort="density">density (log10)</th><th>{what}</th></tr></thead>'
        f"<tbody>{body}</tbody></table>"
    )


def _facts(site: SiteInfo) -> str:
    facts = [f"kind <b>{_esc(site.kind)}</b>", f"<b>{site.units}</b> units"]
    if site.dictionary:
        facts.append(f"dictionary <b>{_esc(site.dictionary)}</b>")
    if site.hook_name:
        facts.append(f"hook <b>{_esc(site.hook_name)}</b>")
    facts.append(f"modality <b>{_esc(site.modality)}</b>")
    if site.tokens:
        seen = "positions" if site.modality == "image" else "tokens"
        facts.append(f"<b>{site.tokens}</b> {seen} seen")
    if site.rows:
        facts.append(f"<b>{site.rows}</b> rows")
    return " · ".join(facts)


def index_html(title: str, sites: list[tuple[SiteInfo, list[IndexRow]]]) -> str:
    """The index page.

    Args:
        title: What the page is of (the run folder's name).
        sites: Each site with its units' rows, in unit order.

    Returns:
        The page's HTML.
    """
    total = sum(len(rows) for _, rows in sites)
    sections = "".join(
        f'<section class="site"><h2>{_esc(site.title)}</h2><p class="facts">{_facts(site)}</p>'
        f"{_table(site, rows)}</section>"
        for site, rows in sites
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>features · {_esc(title)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<link rel="stylesheet" href="{CSS_FILE}"></head><body>'
        f"<h1>Features of {_esc(title)}</h1>"
        '<p><input id="search" type="search" placeholder="unit number or context text" '
        'aria-label="search units"> <span class="facts"><span id="shown">'
        f"{total}</span> of {total} units</span></p>"
        f'{sections}<script src="{JS_FILE}"></script></body></html>\n'
    )
