"""The view in a real browser: headless Chromium from the system's packages (apt-get install
chromium; .ci/run installs it), driven by Playwright, every page opened from a file:// URL.
A unit's page shows its top context and its maximum token as the file holds them (outlined),
hostile token texts stay text (no script of theirs runs), the index sorts by density and max
as numpy sorts the file's values (ties by unit), the search box filters, the links lead
from the index to a page, between pages and back, and nothing a page asks for is missing."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
from view_features_file import (
    BEFORE,
    HOSTILE,
    IMAGE_SITE,
    PATCH,
    SCRIPT,
    SHOWN,
    TEXT_SITES,
    VOCAB,
    ZEBRA,
    write_features_file,
)

from hookrun.view import feature_file, write_view

pytestmark = pytest.mark.slow
SAE_MODULE = "transformer.h.1"
MODULES = sorted([m for m, *_ in TEXT_SITES] + [IMAGE_SITE[0]])  # the index's order


@pytest.fixture(scope="module")
def view(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("browser") / "run"
    write_features_file(run_dir)
    write_view(run_dir)
    with h5py.File(run_dir / "captures.h5", "r") as f:
        data = {
            m: {
                name: f[f"features/{m}/output/{name}"][()] for name in ("max", "density", "top/row")
            }
            | (
                {"top/context": f[f"features/{m}/output/top/context"][()]}
                if m != IMAGE_SITE[0]
                else {}
            )
            for m in MODULES
        }
    return run_dir / "view", data


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("no chromium on PATH: apt-get install -y chromium (what .ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium)
        yield launched
        launched.close()


@pytest.fixture
def page(browser):
    """A fresh page that records every failed request and console error."""
    context = browser.new_context()
    tab = context.new_page()
    tab.problems = []
    tab.on("requestfailed", lambda r: tab.problems.append(f"failed: {r.url}"))
    tab.on("console", lambda m: tab.problems.append(m.text) if m.type == "error" else None)
    tab.on("pageerror", lambda e: tab.problems.append(str(e)))
    yield tab
    assert tab.problems == []
    context.close()


def _open(page, path):
    page.goto(path.as_uri())
    assert page.evaluate("window.pwned") is None  # no token's script, handler or tag ran


def _expected_text(ids) -> str:
    return "".join(SHOWN[t] for t in ids if t >= 0)


@pytest.mark.parametrize("unit", [SCRIPT, HOSTILE, ZEBRA, 9])
def test_a_units_page_shows_its_top_context_and_maximum(view, page, unit):
    folder, data = view
    _open(page, feature_file(folder, SAE_MODULE, "output", unit))
    ids = data[SAE_MODULE]["top/context"][unit, 0]
    top = page.locator("#top .ctx").first
    assert top.locator(".toks").inner_text() == _expected_text(ids)
    maximum = top.locator(".max")
    assert maximum.count() == 1
    assert maximum.inner_text() == SHOWN[ids[BEFORE]]
    assert maximum.evaluate("e => getComputedStyle(e).outlineStyle") == "solid"  # view.css
    assert float(maximum.get_attribute("title").split()[0]) == pytest.approx(
        float(data[SAE_MODULE]["max"][unit]), rel=1e-3
    )
    assert maximum.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(255, 106, 0)"
    assert page.evaluate("document.scripts.length") == 0
    assert page.locator("#unit").inner_text() == str(unit)
    if unit == SCRIPT:
        assert maximum.inner_text() == VOCAB[0][0] == "<script>window.pwned=1</script>"
    if unit == HOSTILE:  # in the logit tables too: an <img onerror> and a quote-breaking one
        shown = page.locator("#logits-bottom td.tok").all_inner_texts()
        assert shown[:3] == [SHOWN[0], SHOWN[1], SHOWN[16]]
        assert page.locator("img").count() == 0


def test_links_between_pages(view, page):
    folder, _ = view
    _open(page, folder / "index.html")
    page.locator(f'table.units[data-module="{SAE_MODULE}"] tr[data-unit="5"] a').click()
    assert page.locator("#unit").inner_text() == "5"
    page.locator("a[rel=next]").click()
    assert page.locator("#unit").inner_text() == "6"
    page.locator("a[rel=prev]").click()
    page.locator("a[rel=prev]").click()
    assert page.locator("#unit").inner_text() == "4"
    page.locator("#index-link").click()
    assert page.url == (folder / "index.html").as_uri()


def test_image_patches_load(view, page):
    folder, data = view
    module, site, _, units = IMAGE_SITE
    _open(page, feature_file(folder, module, site, 0))
    images = page.locator("#top img")
    assert images.count() == int((data[module]["top/row"][0] >= 0).sum())
    widths = images.evaluate_all("all => all.map(i => [i.complete, i.naturalWidth])")
    assert widths == [[True, PATCH]] * images.count()


def _order(page, module):
    return [
        int(u)
        for u in page.locator(f'table.units[data-module="{module}"] tbody tr').evaluate_all(
            "rows => rows.map(r => r.dataset.unit)"
        )
    ]


@pytest.mark.parametrize("key", ["density", "max"])
def test_clicking_a_header_sorts_the_rows(view, page, key):
    folder, data = view
    _open(page, folder / "index.html")
    for module in MODULES:
        values = data[module][key]
        units = np.arange(len(values))
        assert _order(page, module) == units.tolist()
        # Sorted by the other column first: its order among the ties must not show through.
        other = "max" if key == "density" else "density"
        page.locator(f'table.units[data-module="{module}"] th[data-sort="{other}"]').click()
        header = page.locator(f'table.units[data-module="{module}"] th[data-sort="{key}"]')
        header.click()
        assert header.get_attribute("aria-sort") == "ascending"
        assert _order(page, module) == np.lexsort((units, values)).tolist()
        header.click()
        assert header.get_attribute("aria-sort") == "descending"
        assert _order(page, module) == np.lexsort((units, -values)).tolist()
    assert len(set(data[SAE_MODULE]["density"][5:8])) == 1  # the ties the order breaks by unit


def _visible(page):
    rows = page.locator("table.units tbody tr").evaluate_all(
        "rows => rows.filter(r => !r.hidden && r.offsetParent !== null)"
        ".map(r => [r.closest('table').dataset.module, Number(r.dataset.unit)])"
    )
    return sorted((m, u) for m, u in rows)


def _matches(data, query):
    """Rows whose unit is the query or whose top context's text holds it, from the file."""
    q = query.strip().lower()
    hits = []
    for module in MODULES:
        for unit in range(len(data[module]["max"])):
            text = ""
            if "top/context" in data[module] and data[module]["top/row"][unit, 0] >= 0:
                text = "".join(VOCAB[t][0] for t in data[module]["top/context"][unit, 0] if t >= 0)
            if str(unit) == q or q in text.lower():
                hits.append((module, unit))
    return sorted(hits)


def test_the_search_box_filters(view, page):
    folder, data = view
    _open(page, folder / "index.html")
    total = sum(len(d["max"]) for d in data.values())
    assert len(_visible(page)) == total
    box = page.locator("#search")
    queries = {  # a query and the rows it finds at least
        " zebra": [(SAE_MODULE, ZEBRA)],
        "7": [(m, 7) for m, *_ in TEXT_SITES],
        "<script>window": [(SAE_MODULE, SCRIPT)],
        "Hello World": [(SAE_MODULE, SCRIPT)],
        "no such text": [],
    }
    for query, least in queries.items():
        box.fill(query)
        expected = _matches(data, query)
        assert set(least) <= set(expected) and (least or not expected), query
        assert _visible(page) == expected, query
        assert page.locator("#shown").inner_text() == str(len(expected))
    box.fill("zebra")
    assert _visible(page) == [(SAE_MODULE, ZEBRA)]
    box.fill("")
    assert len(_visible(page)) == total
    assert page.evaluate("window.pwned") is None
