"""A page per graph, `<run dir>/graph/row-<r>.html`: the prompt, its logit nodes and the
pruned graph's feature nodes by influence, each feature linked to its dashboard's page.

The dashboards are a features run's view (`experiment=features` over the same transcoders,
then `python -m hookrun.view RUN`): a layer's transcoder is at its MLP's output there, so
latent j of layer L is `view/features/<L's MLP>/output/<j>.html` (view/paths.py, a stable
path). The page is static, fetches nothing, and links by relative paths.
"""

from __future__ import annotations

import html
import os
from pathlib import Path

from hookrun.errors import HookrunError
from hookrun.stages.graph.attribution import Graph
from hookrun.stages.graph.prune import Pruned
from hookrun.view.paths import FEATURES_DIR, INDEX, VIEW_DIR, feature_file, feature_page
from hookrun.view.text import plain

__all__ = ["Dashboards", "dashboards_of", "graph_page"]

_KEY = "graph.dashboards"


class Dashboards:
    """Where each layer's latents have their pages: a view folder and the MLPs' names."""

    def __init__(self, view: Path, modules: list[str]):
        self.view, self.modules = view, modules

    def link(self, layer: int, latent: int, page_dir: Path) -> str:
        """The URL of `latent`'s page of `layer` from a page in `page_dir`."""
        up = Path(os.path.relpath(self.view, page_dir)).as_posix()
        return f"{up}/{feature_page(self.modules[layer], 'output', latent)}"


def dashboards_of(path: str | None, modules: list[str]) -> Dashboards | None:
    """The view at `path` (a features run's folder, or its view folder), checked to hold the
    pages of every layer's MLP output; None where `path` is None.

    Raises:
        HookrunError: no view there, or no pages for some layer's transcoder.
    """
    if path is None:
        return None
    given = Path(path).expanduser()
    view = given if (given / INDEX).is_file() else given / VIEW_DIR
    if not (view / INDEX).is_file():
        raise HookrunError(
            f"{_KEY}: {path!r} holds no view; valid: a features run's folder after "
            "`python -m hookrun.view RUN` (experiment=features over graph.transcoders), or its "
            f"{VIEW_DIR}/ folder"
        )
    for layer, module in enumerate(modules):
        if not feature_file(view, module, "output", 0).parent.is_dir():
            raise HookrunError(
                f"{_KEY}: {view} has no pages for {module}:output (layer {layer}'s transcoder; "
                f"it has {_sites(view)}); valid: the view of experiment=features over "
                "graph.transcoders"
            )
    return Dashboards(view.resolve(), modules)


def _sites(view: Path) -> str:
    found = sorted(
        f"{p.parent.relative_to(view / FEATURES_DIR).as_posix()}:{p.name}"
        for p in (view / FEATURES_DIR).glob("**/output")
        if p.is_dir()
    )
    return ", ".join(found) or "none"


def graph_page(
    graph: Graph,
    pruned: Pruned,
    decode,
    *,
    title: str,
    page_dir: Path,
    picture: str | None,
    dashboards: Dashboards | None,
) -> str:
    """The page's HTML (see the module docstring); `picture`: the graph's PNG, relative to
    `page_dir`, or None."""
    tokens = graph.tokens.tolist()
    texts = [decode([t]) for t in tokens]
    rows = []
    kept = pruned.node_mask[: graph.selected.numel()].nonzero().flatten().tolist()
    kept.sort(key=lambda i: -float(pruned.influence[i]))
    for i in kept:
        chosen = int(graph.selected[i])
        layer, pos, latent = graph.features[chosen].tolist()
        name = str(latent)
        if dashboards is not None:
            name = f'<a href="{html.escape(dashboards.link(layer, latent, page_dir))}">{latent}</a>'
        rows.append(
            f"<tr><td>{layer}</td><td>{pos}</td><td><code>{plain(texts[pos])}</code></td>"
            f"<td>{name}</td><td>{float(graph.activations[chosen]):.4g}</td>"
            f"<td>{float(pruned.influence[i]):.4g}</td></tr>"
        )
    logits = "".join(
        f"<li><code>{plain(decode([int(t)]))}</code> {float(p):.3f}</li>"
        for t, p in zip(
            graph.logit_tokens.tolist(), graph.logit_probabilities.tolist(), strict=True
        )
    )
    prompt = " ".join(f"<code>{plain(t)}</code>" for t in texts)
    image = f'<p><img src="{html.escape(picture)}" alt="the pruned graph"></p>' if picture else ""
    head = "<tr><th>layer</th><th>position</th><th>token</th><th>latent</th>"
    head += "<th>activation</th><th>influence</th></tr>"
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;text-align:left}"
        "code{background:#f3f3f3}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>{prompt}</p><h2>Logit nodes</h2><ol>{logits}</ol>"
        f"{image}<h2>Feature nodes kept ({len(rows)}), by influence on the logits</h2>"
        f"<table>{head}{''.join(rows)}</table></body></html>"
    )
