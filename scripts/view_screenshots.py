"""Screenshots of a view for the docs: docs/images/view_index.png and view_feature.png.

    python scripts/view_screenshots.py [RUN_DIR [MODULE SITE UNIT]]

RUN_DIR: a features run (its view is written into a temporary folder, the run left as it
is); without one, the tests' hand-made features file (tests/view/view_features_file.py).
Needs Chromium from the system's packages (apt-get install chromium) and Playwright.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

from hookrun.view import feature_page, write_view

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> None:
    """Write the two screenshots.

    Args:
        argv: [RUN_DIR [MODULE SITE UNIT]].
    """
    work = Path(tempfile.mkdtemp())
    if argv:
        run_dir = Path(argv[0])
    else:
        sys.path.insert(0, str(ROOT / "tests" / "view"))
        from view_features_file import SCRIPT, write_features_file

        run_dir = work / "run"
        write_features_file(run_dir)
        argv = [str(run_dir), "transformer.h.1", "output", str(SCRIPT)]
    module, site, unit = (argv[1], argv[2], int(argv[3])) if len(argv) > 3 else (None, None, 0)
    view = write_view(run_dir, work / "view").index.parent
    if module is None:
        first = next(p for p in sorted((view / "features").glob("*/*/0.html")))
        module, site = first.parent.parent.name, first.parent.name
    images = ROOT / "docs" / "images"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"))
        page = browser.new_page(viewport={"width": 1100, "height": 760})
        page.goto((view / "index.html").as_uri())
        page.click('table.units th[data-sort="max"]')
        page.click('table.units th[data-sort="max"]')  # descending: the strongest first
        page.screenshot(path=str(images / "view_index.png"))
        page.goto((view / feature_page(module, site, unit)).as_uri())
        page.screenshot(path=str(images / "view_feature.png"), full_page=True)
        browser.close()
    shutil.rmtree(work)
    print(f"{images / 'view_index.png'}, {images / 'view_feature.png'}")


if __name__ == "__main__":
    main(sys.argv[1:])
