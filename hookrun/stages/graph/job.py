"""experiment=attribution_graph: one attribution graph per dataset row (a prompt).

1. Before any work: the transcoders read and fitted to the model (one per layer's MLP, its
   widths the model's, its input and output sites the MLP's), every prompt within the
   model's positions, the run's file claimed (locked; one that exists is refused).
2. Per row: the prompt (its tokens up to the row's read position) run once by hooks to
   freeze the replacement model (replacement.py), its graph (attribution.py), pruned and
   scored (prune.py), the logits under graph.interventions (intervene.py); its JSON and page
   (export.py, page.py) in `<run dir>/graph/`, then its row file (rows.py: one graph in
   memory at a time; `resume=true` after a kill takes the rows already there).
3. graph-metadata.json, then the file assembled from the row files and written whole (to a
   temporary name, then renamed: a kill leaves no half file, and a complete one has its
   JSON beside it); the row files removed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import hookrun.stages.graph.keys as keys
from hookrun.dictionaries.dictionary import Dictionary
from hookrun.dictionaries.load import load_dictionaries
from hookrun.errors import HookrunError
from hookrun.io.layout import open_readonly, read_state
from hookrun.io.lock import WriterLock
from hookrun.io.sink import check_sink_path
from hookrun.models.adapter import adapt
from hookrun.stage import JobContext
from hookrun.stages.graph.attribution import attribute
from hookrun.stages.graph.config import GraphConfig
from hookrun.stages.graph.draw import picture_name
from hookrun.stages.graph.export import graph_json, write_graph_row, write_listing
from hookrun.stages.graph.intervene import Resolved, intervened_logits, resolve
from hookrun.stages.graph.page import dashboards_of, graph_page
from hookrun.stages.graph.prune import prune, scores
from hookrun.stages.graph.replacement import (
    FAMILIES,
    POST_AFFINE,
    PRE_AFFINE,
    Family,
    Replacement,
    family_of,
)
from hookrun.stages.graph.rows import Row, RowFiles, assemble

__all__ = ["Done", "run_graphs", "fit_transcoders"]

_KEY = "graph.transcoders"
log = logging.getLogger("hookrun")
# Where a transcoder may read (its hook_name's end) and what that is on a block.
# TransformerLens's hook_mlp_in is the residual before ln_2 (sites.py): a path the frozen
# model does not carry yet, so it is not among them.
_READS = {
    "ln2.hook_normalized": PRE_AFFINE,
    "mlp.hook_in": POST_AFFINE,
}
_WRITES = ("hook_mlp_out", "mlp.hook_out")
_LAYER = re.compile(r"blocks\.(\d+)\.")


@dataclass(frozen=True)
class Done:
    path: Path
    rows: int  # the prompts this run computed (0: a resume found the file complete)
    seconds: float


def _layer_of(d: Dictionary) -> int:
    found = _LAYER.match(d.hook_name or "")
    if found is None:
        raise HookrunError(
            f"{_KEY}: {d.source} reads {d.hook_name!r}, no layer's MLP input; valid: "
            "blocks.<i>.ln2.hook_normalized or blocks.<i>.mlp.hook_in (a transcoder per "
            "layer's MLP)"
        )
    return int(found.group(1))


def fit_transcoders(path: str, n_layers: int, d_model: int) -> tuple[list[Dictionary], list[str]]:
    """The transcoders of `path`, one per layer in layer order, and where each reads.

    Raises:
        HookrunError: a missing folder, an SAE, a layer without its transcoder or with two, a
            width that is not the model's, a site not an MLP's input and output.
    """
    found = load_dictionaries(path, _KEY)
    by_layer: dict[int, Dictionary] = {}
    reads = {}
    for d in found:
        if not d.transcoder:
            raise HookrunError(
                f"{_KEY}: {d.source} is an SAE, not a transcoder; valid: transcoders (an "
                "MLP's input to its output), one a layer"
            )
        layer = _layer_of(d)
        tail = (d.hook_name or "").split(".", 2)[-1]
        if tail not in _READS:
            raise HookrunError(
                f"{_KEY}: {d.source} reads {d.hook_name!r}; valid: an MLP's input "
                f"({', '.join('blocks.<i>.' + r for r in _READS)})"
            )
        out_tail = (d.hook_name_out or "").split(".", 2)[-1]
        if d.hook_name_out is not None and out_tail not in _WRITES:  # None: SAELens's
            raise HookrunError(
                f"{_KEY}: {d.source} writes {d.hook_name_out!r}; valid: an MLP's output "
                "(blocks.<i>.hook_mlp_out)"
            )
        if layer in by_layer:
            raise HookrunError(
                f"{_KEY}: two transcoders for layer {layer} ({by_layer[layer].source}, "
                f"{d.source}); valid: one a layer"
            )
        if d.architecture not in ("standard", "jumprelu") or d.apply_b_dec_to_input:
            raise HookrunError(
                f"{_KEY}: {d.source} is a {d.architecture} transcoder"
                f"{' subtracting b_dec from its input' if d.apply_b_dec_to_input else ''}; "
                "valid: ReLU or JumpReLU transcoders reading their input as it is"
            )
        if (d.d_in, d.d_out) != (d_model, d_model):
            raise HookrunError(
                f"{_KEY}: {d.source} maps {d.d_in} -> {d.d_out} features, layer {layer}'s MLP "
                f"{d_model} -> {d_model}; valid: transcoders of the model's width"
            )
        by_layer[layer], reads[layer] = d, _READS[tail]
    missing = [i for i in range(n_layers) if i not in by_layer]
    extra = sorted(i for i in by_layer if i >= n_layers)
    if missing or extra:
        what = f"none for layers {missing}" if missing else f"layers {extra} the model lacks"
        raise HookrunError(
            f"{_KEY}: {path!r} has {what}; valid: one transcoder for each of the model's "
            f"{n_layers} layers"
        )
    return [by_layer[i].to(dtype=torch.float32) for i in range(n_layers)], [
        reads[i] for i in range(n_layers)
    ]


def _causal_lm(model: Any) -> tuple[Any, Family]:
    hf = adapt(model).transformers_model()
    family = None if hf is None else family_of(hf)
    if family is None:
        name = type(hf if hf is not None else model).__name__
        raise HookrunError(
            f"model: {name} for graph; valid: a Hugging Face GPT-2 or Llama "
            f"({', '.join(FAMILIES)}; e.g. model=tiny_lm, a GPT-2)"
        )
    running = getattr(hf.config, "_attn_implementation", None)
    if running != "eager":
        raise HookrunError(
            f"model.attention: {running!r} with graph (its attention patterns are read); "
            "valid: eager"
        )
    return hf, family


def _prompts(rows: Any, positions: int) -> list[torch.Tensor]:
    """Each row's tokens up to its read position."""
    prompts = []
    for i in range(len(rows)):
        sample = rows[i][0] if isinstance(rows[i], tuple) else rows[i]
        read = int(torch.nonzero(sample[2]).flatten()[-1])
        prompts.append(sample[0, : read + 1].long())
    longest = max((p.numel() for p in prompts), default=0)
    if longest > positions:
        raise HookrunError(
            f"dataset.context: a prompt of {longest} tokens, the model has {positions} "
            f"positions; valid: prompts of at most {positions} tokens"
        )
    return prompts


def _clear_graph_files(folder: Path) -> None:
    """An earlier run's JSON, pages and listing in `folder` gone (a run of fewer prompts
    would leave rows no listing names)."""
    for pattern in ("row-*.json", "row-*.html", "graph-metadata.json"):
        for stale in folder.glob(pattern):
            stale.unlink()


def _complete(path: Path) -> bool:
    try:
        with open_readonly(path) as f:
            return read_state(f).status == "complete"
    except OSError:
        return False


def run_graphs(spec: Any, config: GraphConfig, ctx: JobContext) -> Done:
    """The job (see the module docstring). `resume=true` on a complete file: nothing to do
    (a kill before the file was renamed into place left no file: the job runs again)."""
    started = time.perf_counter()
    path = Path(spec.sink.path).expanduser() if spec.sink.path else ctx.run_dir / "captures.h5"
    if ctx.device.type != "cpu":
        raise HookrunError(
            f"device: {ctx.device.type!r} with graph; valid: cpu (the graphs' transposed pass "
            "runs on the CPU for now)"
        )
    lock = WriterLock(path)
    try:
        if spec.resume and path.exists() and _complete(path):
            return Done(path, 0, 0.0)
        check_sink_path(path, spec.sink.overwrite)
        model, rows, weights_file = ctx.load(spec)
        hf, family = _causal_lm(model)
        hf_cfg = hf.config
        transcoders, reads = fit_transcoders(
            config.transcoders, hf_cfg.num_hidden_layers, hf_cfg.hidden_size
        )
        prompts = _prompts(rows, hf_cfg.max_position_embeddings)
        names = {id(m): n for n, m in model.named_modules()}
        blocks = getattr(getattr(hf, family.body), family.blocks)
        mlps = [names[id(getattr(b, family.mlp))] for b in blocks]
        dashboards = dashboards_of(config.dashboards, mlps)
        widths = [t.d_sae for t in transcoders]
        edits: list[list[Resolved]] = [
            [
                resolve(entry, p.numel(), widths, f"graph.interventions[{k}]")
                for k, entry in enumerate(config.interventions)
            ]
            for p in prompts
        ]
        header = ctx.header(spec, weights_file)
        tokenizer = adapt(model).tokenizer
        decode = (
            tokenizer.decode if tokenizer is not None else (lambda ids: " ".join(map(str, ids)))
        )
        scan = str(Path(config.transcoders).name)
        graph_dir = ctx.run_dir / keys.FILES
        images = Path(os.path.relpath(ctx.images, graph_dir))  # the pages link the pictures
        files = RowFiles(path, config, weights_file, transcoders)
        if not spec.resume:
            files.clear()  # a new run: nothing of an earlier one is taken
            _clear_graph_files(graph_dir)
        done, listing, computed = [], [], 0
        hf.eval()
        for row, tokens in enumerate(prompts):
            file, slug = files.path(row, tokens), f"row-{row}"
            kept = graph_dir / f"{slug}.json"
            if file.exists() and kept.exists():  # computed before a kill, same digest
                done.append(file)
                listing.append(json.loads(kept.read_text(encoding="utf-8"))["metadata"])
                continue
            frozen, logits = Replacement.capture(hf, tokens, transcoders, reads)
            g = attribute(
                frozen,
                tokens,
                logits,
                max_logits=config.max_logits,
                probability=config.logit_probability,
                batch=config.batch,
                max_features=config.max_feature_nodes,
            )
            p = prune(g, config.node_threshold, config.edge_threshold)
            intervened = [intervened_logits(hf, tokens, frozen, e) for e in edits[row]]
            result = Row(
                g,
                p,
                scores(g, p.influence),
                logits,
                torch.stack(intervened) if intervened else logits[:0],
            )
            data = graph_json(
                g, p, decode, slug=slug, scan=scan, node_threshold=config.node_threshold
            )
            picture = (images / picture_name(row)).as_posix()
            page = graph_page(
                g,
                p,
                decode,
                title=f"Attribution graph of row {row}",
                page_dir=graph_dir,
                picture=picture if spec.render else None,
                dashboards=dashboards,
            )
            # The JSON and page first: a row file (and so a complete file) has them beside it.
            write_graph_row(graph_dir, data, page)
            files.write(file, result)
            done.append(file)
            listing.append(data["metadata"])
            computed += 1
        if computed < len(prompts):
            log.info(
                "attribution_graph: %d of %d graphs taken from the row files of an earlier run",
                len(prompts) - computed,
                len(prompts),
            )
        write_listing(graph_dir, listing)
        assemble(path, header, done, len(config.interventions))
        files.clear()
        return Done(path, computed, time.perf_counter() - started)
    finally:
        lock.release()
