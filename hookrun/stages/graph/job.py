"""experiment=attribution_graph: one attribution graph per dataset row (a prompt).

1. Before any work: the transcoders read and fitted to the model (one per layer's MLP, its
   widths the model's, its input and output sites the MLP's), every prompt within the
   model's positions, the run's file claimed (locked; one that exists is refused).
2. Per row: the prompt (its tokens up to the row's read position) run once by hooks to
   freeze the replacement model (replacement.py), its graph (attribution.py), pruned and
   scored (prune.py), circuit-tracer's JSON of it (export.py).
3. `<run dir>/graph/<slug>.json` and graph-metadata.json, then the file written whole (to a
   temporary name, then renamed: a kill leaves no half file, and a complete one has its
   JSON beside it).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

import hookrun.stages.graph.keys as keys
from hookrun.dictionaries.dictionary import Dictionary
from hookrun.dictionaries.load import load_dictionaries
from hookrun.errors import HookrunError
from hookrun.io.dimensions import AxisFacts, name_dimensions
from hookrun.io.layout import JOB_ATTR, open_readonly, read_state, set_attrs, write_header
from hookrun.io.lock import WriterLock
from hookrun.io.sink import check_sink_path
from hookrun.io.whole_file import replaced_whole
from hookrun.models.adapter import adapt
from hookrun.stage import JobContext
from hookrun.stages.graph.attribution import Graph, attribute
from hookrun.stages.graph.config import GraphConfig
from hookrun.stages.graph.export import graph_json, write_graph_files
from hookrun.stages.graph.intervene import Resolved, intervened_logits, resolve
from hookrun.stages.graph.page import dashboards_of, graph_page
from hookrun.stages.graph.prune import Pruned, prune, scores
from hookrun.stages.graph.replacement import (
    FAMILIES,
    POST_AFFINE,
    PRE_AFFINE,
    Family,
    Replacement,
    family_of,
)

__all__ = ["Done", "run_graphs", "fit_transcoders"]

_KEY = "graph.transcoders"
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
            f"model: {name} for graph; valid: a Hugging Face "
            f"{' or '.join(FAMILIES)} (e.g. model=tiny_lm, a GPT-2)"
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


@dataclass
class _Row:
    """One prompt's results: its graph, pruned and scored, and the logits it gave."""

    graph: Graph
    pruned: Pruned
    scores: tuple[float, float]  # replacement, completeness
    logits: torch.Tensor  # (V,) at the last position
    intervened: torch.Tensor  # (K, V) under each of graph.interventions


def _write(path: Path, header: Any, graphs: list[_Row], interventions: int) -> None:
    """The run's file, written whole (a kill leaves the old file or the new one)."""
    with replaced_whole(path) as temp, h5py.File(temp, "w", track_order=True) as f:
        write_header(f, header)
        set_attrs(
            f,
            {
                JOB_ATTR: keys.JOB,
                "status": "complete",
                "error": "",
                "completed": len(graphs),
                "rows": len(graphs),
                "interventions": interventions,
            },
        )
        for row, done in enumerate(graphs):
            g, p, (replacement, completeness) = done.graph, done.pruned, done.scores
            group = f.create_group(keys.row_group(row))
            arrays = {
                keys.TOKENS: g.tokens.numpy(),
                keys.FEATURES: g.features.numpy(),
                keys.ACTIVATIONS: g.activations.numpy(),
                keys.SELECTED: g.selected.numpy(),
                keys.LOGIT_TOKENS: g.logit_tokens.numpy(),
                keys.LOGIT_PROBABILITIES: g.logit_probabilities.numpy(),
                keys.CROW: g.crow.numpy(),
                keys.COL: g.col.numpy(),
                keys.VAL: g.val.numpy(),
                keys.INFLUENCE: p.influence.numpy(),
                keys.CUMULATIVE: p.cumulative.numpy(),
                keys.NODE_MASK: p.node_mask.numpy(),
                keys.EDGE_MASK: p.edge_mask.numpy(),
                keys.LOGITS: done.logits.numpy(),
            }
            if interventions:
                arrays[keys.INTERVENTION_LOGITS] = done.intervened.numpy()
            for name, value in arrays.items():
                group.create_dataset(name, data=np.asarray(value), fletcher32=value.size > 0)
            set_attrs(
                group,
                {
                    "replacement_score": replacement,
                    "completeness_score": completeness,
                    "layers": g.layers,
                    "nodes": g.n_nodes,
                },
            )
        name_dimensions(f, AxisFacts())


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
        graphs, files, pages = [], [], []
        graph_dir = ctx.run_dir / "graph"
        images = Path("..", "images", spec.experiment or "run")
        hf.eval()
        for row, tokens in enumerate(prompts):
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
            graphs.append(
                _Row(
                    g,
                    p,
                    scores(g, p.influence),
                    logits,
                    torch.stack(intervened) if intervened else logits[:0],
                )
            )
            files.append(
                graph_json(
                    g, p, decode, slug=f"row-{row}", scan=scan, node_threshold=config.node_threshold
                )
            )
            picture = (images / f"attribution_graph_row{row}.png").as_posix()
            pages.append(
                graph_page(
                    g,
                    p,
                    decode,
                    title=f"Attribution graph of row {row}",
                    page_dir=graph_dir,
                    picture=picture if spec.render else None,
                    dashboards=dashboards,
                )
            )
        # The JSON first: a complete file (renamed into place last) has its JSON beside it.
        write_graph_files(graph_dir, files, pages)
        _write(path, header, graphs, len(config.interventions))
        return Done(path, len(graphs), time.perf_counter() - started)
    finally:
        lock.release()
