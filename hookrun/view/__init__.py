"""Static pages of a features run (`python -m hookrun.view RUN_DIR`): an index of every
feature site's units and one page per unit, read from `/features` of the run's captures.h5
alone (no model, no tokenizer), written as plain files that open from file:// and under any
static server (no network, no fetch(): every datum sits in the pages themselves).

One job per module: `source.py` reads the file, `text.py` shows token texts, `charts.py`
draws the histogram, `images.py` writes image patches, `feature.py` and `index.py` write the
pages, `assets.py` holds the CSS and JavaScript, `paths.py` the pages' stable paths
(`feature_page`), `site.py` writes the whole folder and swaps it in.
"""

from __future__ import annotations

from hookrun.view.paths import VIEW_DIR, feature_file, feature_page
from hookrun.view.site import write_view

__all__ = ["VIEW_DIR", "feature_file", "feature_page", "write_view"]
