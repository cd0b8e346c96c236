"""The pages `python -m hookrun.view` writes, read back as files: every unit's page at its
stable path, contexts shown as the hand-written VOCAB says (escaped, whitespace visible),
shading ∝ activation / the unit's max, padding left out, the histogram's bars, the logit
effects, an image site's patches as PNGs equal to the file's pixels; bad input refused in
one line before anything is written; an older view replaced whole, someone else's folder
never."""

from __future__ import annotations

import hashlib
import html
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import h5py
import numpy as np
import pytest
from PIL import Image
from view_features_file import (
    BEFORE,
    BINS,
    HOSTILE,
    IMAGE_SITE,
    NEVER,
    PARTIAL,
    SCRIPT,
    SHOWN,
    TEXT_SITES,
    write_features_file,
)

from hookrun.view import feature_file, feature_page, write_view
from hookrun.view import site as view_site
from hookrun.view.__main__ import main

SAE_MODULE = "transformer.h.1"
SITES = [(m, s, u) for m, s, _, u in TEXT_SITES] + [(IMAGE_SITE[0], IMAGE_SITE[1], IMAGE_SITE[3])]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("view") / "run"
    write_features_file(run_dir)
    write_view(run_dir)
    return run_dir


def _site(run_dir: Path, module: str) -> h5py.Group:
    f = h5py.File(run_dir / "captures.h5", "r")
    return f[f"features/{module}/output"]


def _page(run_dir: Path, module: str, unit: int) -> str:
    return feature_file(run_dir / "view", module, "output", unit).read_text()


def _top(page: str) -> str:
    return page.split('<div id="top">', 1)[1].split("</div><h2>", 1)[0]


def _contexts(fragment: str) -> list[str]:
    """The text each context of an HTML fragment shows (tags stripped, entities read)."""
    found = re.findall(r'<span class="toks">(.*?)</span></div>', fragment)
    return [html.unescape(re.sub(r"<[^>]+>", "", inner)) for inner in found]


def test_feature_page_paths_are_stable():
    assert (
        feature_page("transformer.h.1", "output", 12) == "features/transformer.h.1/output/12.html"
    )
    # A function site's module keeps its `/` as a folder; any other character is encoded.
    assert feature_page("h.1/matmul.0", "input", 3) == "features/h.1/matmul.0/input/3.html"
    assert feature_page("a b#?", "output", 0) == "features/a%20b%23%3F/output/0.html"
    assert feature_file(Path("/v"), "transformer.h.1", "output", 7) == Path(
        "/v/features/transformer.h.1/output/7.html"
    )


def test_every_unit_has_its_page(run):
    pages = {p.relative_to(run / "view").as_posix() for p in (run / "view").rglob("*.html")}
    expected = {feature_page(m, s, u) for m, s, n in SITES for u in range(n)} | {"index.html"}
    assert pages == expected


def test_top_contexts_show_the_files_tokens_escaped(run):
    for module, _, units in SITES[:2]:
        g = _site(run, module)
        for unit in range(units):
            page = _page(run, module, unit)
            shown = _contexts(_top(page))
            ids, rows = g["top/context"][unit], g["top/row"][unit]
            expected = [
                "".join(SHOWN[t] for t in ids[r] if t >= 0)
                for r in range(len(rows))
                if rows[r] >= 0
            ]
            assert shown == expected, (module, unit)
    script = _page(run, SAE_MODULE, SCRIPT)
    assert _contexts(_top(script))[0] == 'Hello·world⏎<script>window.pwned=1</script>&amp;"·end'
    assert '<span class="max"' in script
    maximum = re.search(r'<span class="max"[^>]*>(.*?)</span>(?=<span|</span>)', script)
    assert html.unescape(maximum.group(1)) == "<script>window.pwned=1</script>"


def test_no_hostile_string_survives_as_markup(run):
    for path in (run / "view").rglob("*.html"):
        text = path.read_text()
        for raw in ("<script>window", "<img src=x", 'onmouseover="window', "<!--"):
            assert raw not in text, (path, raw)
    hostile = _page(run, SAE_MODULE, HOSTILE)
    assert "&lt;img" in hostile and "onerror=window.pwned=2&gt;" in hostile
    assert "&quot;" in hostile  # the quote inside an attribute-looking token


def test_shading_is_the_activation_over_the_units_max(run):
    g = _site(run, SAE_MODULE)
    for unit in (SCRIPT, HOSTILE, 7):
        unit_max = float(g["max"][unit])
        first = re.findall(
            r'<div class="ctx" data-rank="0">.*?</div>', _page(run, SAE_MODULE, unit)
        )[0]
        spans = re.findall(r'<span( class="max")?( style="[^"]*")? title="([^"]*)">', first)
        kept = [i for i, t in enumerate(g["top/context"][unit, 0]) if t >= 0]
        assert len(spans) == len(kept)
        for (cls, style, title), i in zip(spans, kept, strict=True):
            value = float(g["top/context_value"][unit, 0, i])
            token = int(g["top/context"][unit, 0, i])
            assert bool(cls) == (i == BEFORE)
            assert float(title.split()[0]) == pytest.approx(value, rel=1e-3)
            assert title.endswith(f"(id {token})")
            alpha = int(re.search(r"#ff6a00([0-9a-f]{2})", style).group(1), 16) if style else 0
            assert alpha / 255 == pytest.approx(min(value / unit_max, 1), abs=0.5 / 255)


def test_padding_and_a_unit_that_never_fired(run):
    partial = _page(run, SAE_MODULE, PARTIAL)
    assert len(_contexts(_top(partial))) == 2  # fired twice: ranks 2..4 are NaN / -1
    never = _page(run, SAE_MODULE, NEVER)
    assert "No sample." in _top(never)
    assert "never fired" in never and 'id="density">0 (never fired)' in never
    index = (run / "view" / "index.html").read_text()
    row = re.search(rf'<tr data-unit="{NEVER}"[^>]*>.*?</tr>', index.split(SAE_MODULE, 1)[1]).group(
        0
    )
    assert "−∞" in row and "never fired" in row


def test_density_max_histogram_and_quantiles(run):
    g = _site(run, "transformer.h.0")
    unit = 9
    page = _page(run, "transformer.h.0", unit)
    d = float(g["density"][unit])
    assert f'id="density">{d:.4g} (log10 {math.log10(d):.2f})' in page
    assert f'id="max">{float(g["max"][unit]):.4g}' in page
    counts = g["histogram/counts"][unit]
    bars = re.findall(r'<rect class="bar"[^>]* height="([0-9.]+)" data-count="(\d+)"', page)
    assert [int(c) for _, c in bars] == counts.tolist() and len(bars) == BINS
    heights = np.array([float(h) for h, _ in bars])
    np.testing.assert_allclose(heights / heights.max(), counts / counts.max(), atol=1e-3)
    edges, values = g["quantiles/edges"][unit], g["quantiles/value"][unit]
    groups = re.findall(
        r'<section class="group" data-group="(\d)"><h3>(.*?)</h3>(.*?)</section>', page
    )
    assert [int(q) for q, _, _ in groups] == [2, 1, 0]  # the highest group first
    for q, heading, inner in groups:
        q = int(q)
        assert heading.endswith(f"{edges[q]:.4g} to {edges[q + 1]:.4g}")
        assert len(_contexts(inner)) == int(np.isfinite(values[q]).sum())
    assert "Logit effects" not in page  # a site of plain units has none


@pytest.mark.parametrize("unit", [HOSTILE, SCRIPT])
def test_logit_effects(run, unit):
    g = _site(run, SAE_MODULE)
    page = _page(run, SAE_MODULE, unit)
    for side in ("top", "bottom"):
        table = re.search(rf'<table class="logit" id="logits-{side}">(.*?)</table>', page).group(1)
        cells = re.findall(r'<td class="tok">(.*?)</td><td class="num">(.*?)</td>', table)
        tokens = [html.unescape(re.sub(r"<[^>]+>", "", t)) for t, _ in cells]
        assert tokens == [SHOWN[t] for t in g[f"logits/{side}_token"][unit]]
        np.testing.assert_allclose(
            [float(v) for _, v in cells], g[f"logits/{side}_value"][unit], rtol=1e-3
        )


def test_image_patches_are_the_files_pixels(run):
    module, site, _, units = IMAGE_SITE
    g = _site(run, module)
    for unit in range(units):
        page = feature_file(run / "view", module, site, unit)
        images = re.findall(r'<img src="([^"]+)"', page.read_text())
        fired = [r for r in range(g["top/row"].shape[1]) if g["top/row"][unit, r] >= 0]
        assert images == [f"{unit}/top-{r}.png" for r in fired]
        for r in fired:
            png = np.asarray(Image.open(page.parent / f"{unit}/top-{r}.png").convert("RGB"))
            np.testing.assert_array_equal(png, g["top/patch"][unit, r].transpose(1, 2, 0))
    assert not (page.parent / f"{units - 1}" / "top-1.png").exists()  # fired once


def _links_resolve(folder: Path) -> int:
    """Every relative href and src of every page names a file of the view; how many."""
    seen = 0
    for page in folder.rglob("*.html"):
        for ref in re.findall(r'(?:href|src)="([^"]+)"', page.read_text()):
            assert (page.parent / unquote(ref)).resolve().is_file(), (page, ref)
            seen += 1
    return seen


def test_every_link_resolves(run):
    assert _links_resolve(run / "view") > 200


def test_a_function_sites_module_and_an_image_site_without_patches(tmp_path):
    run_dir = tmp_path / "run"
    write_features_file(run_dir)
    with h5py.File(run_dir / "captures.h5", "r+") as f:
        # transformer.h.0/output → transformer.h.0/matmul.0/output: a module with a `/`
        f.move("features/transformer.h.0", "features/moved")
        f.create_group("features/transformer.h.0")
        f.move("features/moved", "features/transformer.h.0/matmul.0")
        del f["features/features.3/output/top/patch"]  # a site of one vector per image
        rows, boxes = (
            f["features/features.3/output/top/row"][0],
            f["features/features.3/output/top/box"][0],
        )
    view = write_view(run_dir).index.parent
    page = feature_file(view, "transformer.h.0/matmul.0", "output", 3)
    assert page.is_file() and not (view / "features" / "transformer.h.0" / "output").exists()
    _links_resolve(view)
    image = feature_file(view, "features.3", "output", 0).read_text()
    shown = re.findall(
        r'<tr data-rank="\d+"><td class="num">[^<]*</td>'
        r'<td class="num">(\d+)</td><td>([\d ]+)</td>',
        image,
    )
    fired = rows >= 0
    assert shown == [
        (str(r), " ".join(map(str, b))) for r, b in zip(rows[fired], boxes[fired], strict=True)
    ]
    assert "<img" not in image


def _tree(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _refusal(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_bad_input_is_one_line_before_any_work(tmp_path, capsys):
    assert "no such folder" in _refusal([str(tmp_path / "missing")], capsys)
    (tmp_path / "a_file").write_text("x")
    assert "not a folder" in _refusal([str(tmp_path / "a_file")], capsys)
    assert "no captures.h5" in _refusal([str(tmp_path)], capsys)
    (tmp_path / "captures.h5").write_text("not hdf5")
    assert "not a readable HDF5 file" in _refusal([str(tmp_path)], capsys)
    write_features_file(tmp_path, features=False)
    err = _refusal([str(tmp_path)], capsys)
    assert "no /features group" in err and "run experiment=features first" in err
    write_features_file(tmp_path, status="interrupted")
    assert "status 'interrupted'" in _refusal([str(tmp_path)], capsys)
    assert not (tmp_path / "view").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_someone_elses_folder_is_never_overwritten(tmp_path, capsys):
    write_features_file(tmp_path / "run")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    err = _refusal([str(tmp_path / "run"), "--out", str(theirs)], capsys)
    assert "--out" in err and ".hookrun-view" in err
    assert _tree(theirs) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(tmp_path / "run"), "--out", str(empty)]) == 0
    assert (empty / "index.html").is_file()


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two_renames"])
def test_an_older_view_is_replaced_whole(tmp_path, monkeypatch, exchange):
    run_dir = tmp_path / "run"
    write_features_file(run_dir, seed=1)
    write_view(run_dir)
    (run_dir / "view" / "features" / "stale.html").write_text("old")
    write_features_file(run_dir, seed=2)
    if not exchange:
        monkeypatch.setattr(view_site, "_exchange", lambda a, b: False)
    write_view(run_dir)
    fresh = tmp_path / "fresh"
    write_view(run_dir, fresh)
    assert _tree(run_dir / "view") == _tree(fresh) != {}
    assert sorted(p.name for p in run_dir.iterdir()) == ["captures.h5", "view"]
    assert oct((run_dir / "view").stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_view_killed_halfway_leaves_the_old_one_whole(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    write_features_file(run_dir, seed=1)
    write_view(run_dir)
    before = _tree(run_dir / "view")
    write_features_file(run_dir, seed=2)
    calls = []
    real = view_site.feature_html

    def dies(*args):
        calls.append(1)
        if len(calls) == 20:
            raise KeyboardInterrupt  # a signal's stop in the middle of the pages
        return real(*args)

    monkeypatch.setattr(view_site, "feature_html", dies)
    with pytest.raises(KeyboardInterrupt):
        write_view(run_dir)
    assert _tree(run_dir / "view") == before
    assert sorted(p.name for p in run_dir.iterdir()) == ["captures.h5", "view"]


def test_the_command_line(tmp_path):
    write_features_file(tmp_path / "run")
    done = subprocess.run(
        [sys.executable, "-m", "hookrun.view", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    index = tmp_path / "run" / "view" / "index.html"
    assert done.stdout == f"view: {index} (3 sites, 60 unit pages)\n"


def test_the_viewer_reads_only_the_file():
    """Its layer: the pages need hookrun's io and errors, no model, tokenizer or stage."""
    root = Path(__file__).resolve().parents[2] / "hookrun" / "view"
    imported = set()
    for path in root.glob("*.py"):
        imported |= set(
            re.findall(r"^\s*(?:from|import) (hookrun\.[\w.]+)", path.read_text(), re.M)
        )
    assert {m for m in imported if not m.startswith("hookrun.view")} == {
        "hookrun.errors",
        "hookrun.io.layout",
    }
    assert not any("torch" in p.read_text() for p in root.glob("*.py"))
