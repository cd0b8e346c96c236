"""Each graph's page (`<run dir>/graph/row-<r>.html`) lists the pruned graph's feature nodes,
linked to their dashboards: a real features run over the shipped tiny_lm transcoders (a
folder of one a layer, placed by their hook names), its view built by `hookrun.view`, then
the graph run with `graph.dashboards` pointing at it. Every link of every page resolves to the
page of that layer's latent; a view without some layer's pages is refused in one line."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from urllib.parse import unquote

import h5py
import pytest

import hookrun
from hookrun.errors import HookrunError
from hookrun.view import write_view

pytestmark = pytest.mark.slow

TRANSCODERS = Path(hookrun.__file__).parent / "models" / "checkpoints" / "tiny_lm_transcoders"
GRAPH = ["experiment=attribution_graph", "progress=false", "render=false"]


@pytest.fixture(scope="module")
def view(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboards")
    features = [
        "experiment=features",
        "hooks.sae.action=transcoder",
        "~hooks.sae.select",
        f"hooks.sae.args.path={TRANSCODERS}",
        "limit=32",
        "batch_size=16",
        "features.k=4",
        "render=false",
        "progress=false",
    ]
    hookrun.run(features, run_dir=tmp / "features")
    write_view(tmp / "features")
    return tmp / "features"


def test_feature_nodes_link_to_their_dashboards(view, tmp_path):
    result = hookrun.run([*GRAPH, f"graph.dashboards={view}"], run_dir=tmp_path / "run")
    with h5py.File(result.path, "r") as f:
        rows = int(f.attrs["rows"])
        kept = []
        for r in range(rows):
            g = f[f"graph/{r}"]
            n = g["selected"].shape[0]
            chosen = g["selected"][()][g["node_mask"][()][:n]]
            kept.append(sorted((int(a), int(c)) for a, _, c in g["features"][()][chosen]))
    for r in range(rows):
        page = tmp_path / "run" / "graph" / f"row-{r}.html"
        links = re.findall(r'href="([^"]+)"', page.read_text(encoding="utf-8"))
        assert len(links) == len(kept[r]) > 0
        found = []
        for link in links:
            target = (page.parent / unquote(link)).resolve()
            assert target.is_file(), link
            layer, latent = re.search(
                r"transformer\.h\.(\d+)\.mlp/output/(\d+)\.html$", link
            ).groups()
            found.append((int(layer), int(latent)))
        assert sorted(found) == kept[r]  # each kept feature node links to its own latent's page


def test_a_view_without_a_layers_pages_is_refused(view, tmp_path):
    partial = tmp_path / "view"
    shutil.copytree(view / "view", partial)
    shutil.rmtree(partial / "features" / "transformer.h.1.mlp")
    with pytest.raises(
        HookrunError, match=r"graph.dashboards: .* no pages for transformer.h.1.mlp:output"
    ) as err:
        hookrun.run([*GRAPH, f"graph.dashboards={partial}"], run_dir=tmp_path / "run")
    assert "\n" not in str(err.value)
    with pytest.raises(HookrunError, match=r"graph.dashboards: .* holds no view"):
        hookrun.run([*GRAPH, f"graph.dashboards={tmp_path / 'run'}"], run_dir=tmp_path / "run2")
    assert not (tmp_path / "run" / "captures.h5").exists()
