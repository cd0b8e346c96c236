"""The `attribution_graph` stage (`graph:`, experiment=attribution_graph): the node parsed, the
job run instead of the rows' pipeline (Stage.job); the summary of its file."""

from __future__ import annotations

import json
from typing import Any

import h5py
import torch

import hookrun.stages.graph.keys as keys
from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.io.layout import JOB_ATTR, attr
from hookrun.stage import JobContext, JobResult, ParseContext, Stage, register_stage
from hookrun.stages.graph.config import GraphConfig, parse_graph

__all__ = ["GraphStage"]

# Each prompt's graph is a group of its own: its datasets are nodes and entries, no sample axis.
layout.whole_run(f"{keys.GROUP}/*")


@register_stage
class GraphStage(Stage):
    name = "attribution_graph"
    node = "graph"
    order = 7
    axes = {
        "graph/*/features": "feature field",
        "graph/*/adjacency_*": "entry",
        "graph/*/*": "node",
    }

    @classmethod
    def schema(cls) -> dict[str, type]:
        return {"graph": GraphConfig}

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> GraphConfig | None:
        config = parse_graph(raw)
        if config is not None and ctx.target.kind.value != "none":
            raise HookrunError(
                f"target.kind: {ctx.target.kind.value!r} with graph: its targets are the top "
                "logits of each prompt; valid: none"
            )
        return config

    @classmethod
    def job(cls, config: GraphConfig, spec: Any, ctx: JobContext) -> JobResult:
        from hookrun.stages.graph.job import run_graphs

        if spec.dry_run:
            raise HookrunError(
                "dry_run: true with graph: the job writes no rows to size; valid: dry_run=false"
            )
        done = run_graphs(spec, config, ctx)
        images = None
        with h5py.File(done.path, "r") as f:
            lines, rows = cls.summary(f, 0), int(attr(f, "rows", 0))
        if spec.render:
            from hookrun.stages.graph.draw import draw_graphs

            images = ctx.images
            drawn = draw_graphs(done.path, images, _token_texts(ctx.run_dir / keys.FILES, rows))
            lines.append(f"pictures: {images} ({len(drawn)} files)")
        lines.append(f"graph JSON: {ctx.run_dir / keys.FILES} (circuit-tracer's viewer opens it)")
        if done.seconds:
            lines.append(f"time: {done.seconds:.1f} s")
        return JobResult(done.path, "\n".join(lines), images, rows)

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        if attr(f, JOB_ATTR) != keys.JOB:
            return []
        rows = int(attr(f, "rows", 0))
        lines = [f"attribution graphs: {f.filename} ({rows} prompts)"]
        for row in range(rows):
            g = f[keys.row_group(row)]
            kept = int(g[keys.NODE_MASK][()].sum())
            lines.append(
                f"  row {row}: {g[keys.TOKENS].shape[0]} tokens, {g[keys.SELECTED].shape[0]} "
                f"feature nodes of {g[keys.FEATURES].shape[0]} active, {kept} nodes kept of "
                f"{attr(g, 'nodes')}, replacement "
                f"{attr(g, 'replacement_score'):.3f}, completeness "
                f"{attr(g, 'completeness_score'):.3f}"
            )
            if keys.INTERVENTION_LOGITS in g:
                lines += _interventions(g)
        return lines

    @classmethod
    def damage(cls, f: h5py.File, complete: bool) -> list[str]:
        if attr(f, JOB_ATTR) != keys.JOB or not complete:
            return []
        rows = int(attr(f, "rows", 0))
        found = []
        for row in range(rows):
            name = keys.row_group(row)
            if name not in f:
                found.append(f"/{name}: missing (a complete file holds every prompt's graph)")
                continue
            found += [f"/{name}/{part}: missing" for part in keys.REQUIRED if part not in f[name]]
            wanted = int(attr(f, "interventions", 0))
            held = f[name].get(keys.INTERVENTION_LOGITS)
            if wanted and (held is None or held.shape[0] != wanted):
                found.append(
                    f"/{name}/{keys.INTERVENTION_LOGITS}: "
                    f"{'missing' if held is None else f'{held.shape[0]} rows'} (the run made "
                    f"{wanted} interventions)"
                )
        return found


def _token_texts(folder: Any, rows: int) -> dict[int, list[str]]:
    """Each row's token texts, from its graph JSON (the tokenizer's, as the job decoded them)."""
    texts = {}
    for row in range(rows):
        file = folder / f"row-{row}.json"
        if file.is_file():
            texts[row] = json.loads(file.read_text(encoding="utf-8"))["metadata"]["prompt_tokens"]
    return texts


def _interventions(g: h5py.Group) -> list[str]:
    """A line per intervention: the graph's top logit token's probability before and after,
    and the token the model then ranks first."""
    clean = torch.from_numpy(g[keys.LOGITS][()]).softmax(-1)
    top = int(g[keys.LOGIT_TOKENS][0])
    lines = []
    for k, logits in enumerate(torch.from_numpy(g[keys.INTERVENTION_LOGITS][()])):
        p = logits.softmax(-1)
        lines.append(
            f"    intervention {k}: token {top} p {clean[top]:.3f} -> {p[top]:.3f}; "
            f"first token {int(clean.argmax())} -> {int(p.argmax())}"
        )
    return lines
