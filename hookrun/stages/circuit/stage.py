"""The circuit stage (`circuit:`, experiment=circuit): each row's edge attribution scores
between the embeddings, every attention head, every MLP and the logits (edges.py), stored
at /circuit/edges; the summary names the edges with the largest mean score.

The rows are prompts with counterfactuals of the same token length (dataset=prompts), as
for the patching grid: clean = the prompt, corrupted = its counterfactual, the metric the
logit difference answer − counterfactual_answer at the prompt's last token."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
import torch
from torch import nn

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.io.encoding import read_floats
from hookrun.models.adapter import adapt
from hookrun.runtime.hooks import run_mode
from hookrun.stage import (
    ParseContext,
    Plan,
    Setup,
    Stage,
    Stored,
    WholeRun,
    Work,
    register_stage,
)
from hookrun.stages.circuit.config import CircuitConfig, parse_circuit
from hookrun.stages.circuit.edges import (
    SCORE,
    both_runs,
    edge_scores,
    gradient_at,
    logit_diff,
    path_patched,
    writes,
)
from hookrun.stages.circuit.faithfulness import SELECTED, ablated_diff, circuit_of
from hookrun.stages.circuit.graph import Graph, graph_of, path_receivers
from hookrun.stages.circuit.keys import (
    CIRCUIT,
    CLEAN,
    CORRUPTED,
    EDGES,
    FAITHFULNESS,
    FAITHFULNESS_DIFF,
    FAITHFULNESS_KEPT,
    PATHS,
    PATHS_DIFF,
    RECEIVERS,
    SELECTION,
    SENDERS,
    kept_of,
)
from hookrun.stages.patching.grid import counterfactuals

__all__ = ["CircuitStage"]

layout.whole_run(FAITHFULNESS, FAITHFULNESS_DIFF, FAITHFULNESS_KEPT)  # one per circuit size


@dataclass(frozen=True)
class _Rows:
    """What the faithfulness passes read again once the file is complete: the model, its
    token rows, how many the run has, rows per pass and the device."""

    model: nn.Module
    tokens: Any  # TokenRows
    count: int
    batch_size: int
    device: torch.device


class CircuitPlan(Plan):
    def __init__(
        self,
        config: CircuitConfig,
        graph: Graph,
        cf: tuple[torch.Tensor, torch.Tensor],
        again: _Rows,
    ) -> None:
        self.config, self.graph, self.again = config, graph, again
        self.counterfactual, self.wrong = cf

    def describe(self, itemsize: int) -> str:
        lines = [super().describe(itemsize)]
        if self.config.k:
            lines.append(
                f"Faithfulness once every row is in: {len(self.config.k) + 2} more passes "
                f"over every row (circuit sizes {list(self.config.k)}, and the clean and "
                "corrupted ends), every edge outside each circuit ablated"
                + (
                    " (mean ablation: the corrupted runs first, for their mean writes)"
                    if self.config.ablation == "mean"
                    else ""
                )
            )
        return "\n".join(lines)

    def finishes(self) -> dict[str, WholeRun]:
        if not self.config.k:
            return {}
        said = {"k": list(self.config.k), "ablation": self.config.ablation, SELECTION: SELECTED}
        sizes = (len(self.config.k),)
        out = {key: WholeRun(sizes, attrs=said) for key in (FAITHFULNESS, FAITHFULNESS_DIFF)}
        return out | {FAITHFULNESS_KEPT: WholeRun(sizes, "int64")}

    def finish(self, f: h5py.File) -> dict[str, np.ndarray]:
        """The circuits of sizes circuit.k, each run with every other edge ablated over
        every row: their share of the clean - corrupted logit difference and their logit
        difference (/circuit/faithfulness, /circuit/faithfulness_logit_diff)."""
        edges = read_floats(f[EDGES], slice(0, self.again.count)).astype(np.float64)
        with warnings.catch_warnings():  # edges no sender reaches: NaN in every row
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = torch.from_numpy(np.nanmean(edges, axis=0))
        # The ends measured again in float32 (not read back in sink.dtype): with every edge
        # kept a circuit is the clean run to the bit.
        every = self.graph.upstream()
        circuits = [circuit_of(mean, k, self.graph) for k in self.config.k]
        corrupted, (clean, *ablated) = self._means([every, *circuits])
        gap = clean - corrupted
        shares = [(a - corrupted) / gap if gap else float("nan") for a in ablated]
        return {
            FAITHFULNESS: np.array(shares, np.float64),
            FAITHFULNESS_DIFF: np.array(ablated, np.float64),
            FAITHFULNESS_KEPT: np.array([int(c.sum()) for c in circuits], np.int64),
        }

    def _means(self, circuits: list[torch.Tensor]) -> tuple[float, list[float]]:
        """Over every row: the corrupted run's mean logit difference, and the clean rows'
        with the edges outside each of `circuits` ablated (the writes a cut edge carries
        made once a batch for them all: the row's corrupted run's, or their mean)."""
        again = self.again
        hf = adapt(again.model).language.hf
        corrupted_total, totals = 0.0, [0.0] * len(circuits)
        with run_mode(again.model), torch.inference_mode():
            mean = None
            if self.config.ablation == "mean":  # the corrupted runs once, for their mean
                mean, corrupted_total = self._mean_writes(hf)
            for rows, corrupt_ids in self._batches():
                if mean is None:
                    corrupted, logits = writes(hf, self.graph, corrupt_ids, rows[1])
                    corrupted_total += float(logit_diff(logits, *rows[2:]).sum())
                else:
                    n, t = corrupt_ids.shape
                    corrupted = {k: v[:t].expand(n, *v[:t].shape) for k, v in mean.items()}
                for i, kept in enumerate(circuits):
                    totals[i] += float(ablated_diff(hf, self.graph, rows, corrupted, kept).sum())
        return corrupted_total / again.count, [total / again.count for total in totals]

    def _batches(self) -> Iterator[tuple[tuple, torch.Tensor]]:
        """Each batch of the run's rows again: (clean ids, mask, read positions, answers,
        counterfactual answers) and the corrupted ids, on the run's device."""
        again, tokens = self.again, self.again.tokens
        for lo in range(0, again.count, again.batch_size):
            index = torch.arange(lo, min(lo + again.batch_size, again.count))
            ids = tokens.ids[index]
            mask = (torch.arange(ids.shape[1])[None] < tokens.lengths[index][:, None]).long()
            rows = (ids, mask, tokens.reads[index], tokens.labels[index], self.wrong[index])
            corrupt_ids = self.counterfactual[index].to(again.device)
            yield tuple(t.to(again.device) for t in rows), corrupt_ids

    def _mean_writes(self, hf: nn.Module) -> tuple[dict[str, torch.Tensor], float]:
        """circuit.ablation=mean: each sender's write in the corrupted runs averaged over the
        rows at each position (over the rows long enough to have it), (T, ...) each — the
        rows are padded to one width, so every batch has every position; and the corrupted
        runs' summed logit difference."""
        sums: dict[str, torch.Tensor] = {}
        count = torch.zeros(())
        dtype = torch.float32
        corrupted_total = 0.0
        for rows, corrupt_ids in self._batches():
            made, logits = writes(hf, self.graph, corrupt_ids, rows[1])
            corrupted_total += float(logit_diff(logits, *rows[2:]).sum())
            real = rows[1].to(torch.float64)[..., None]  # (N, T, 1)
            for key, value in made.items():
                part = (value.double() * real).sum(0)
                sums[key] = part if key not in sums else sums[key] + part
                dtype = value.dtype
            count = count + real.sum(0)
        return {k: (v / count.clamp(min=1)).to(dtype) for k, v in sums.items()}, corrupted_total

    def stored(self) -> dict[str, Stored]:
        g = self.graph
        steps = self.config.ig_steps if self.config.method == "eap_ig" else 1
        said = {
            SENDERS: np.array(g.senders, dtype=h5py.string_dtype()),
            RECEIVERS: np.array(g.receivers, dtype=h5py.string_dtype()),
            "method": self.config.method,
            "ig_steps": steps,
            "score": SCORE,
            "gradient_at": gradient_at(self.config.method, steps),
            # Grouped-query attention: query head h reads key/value head
            # h // (heads / key_value_heads) (receivers a<layer>.kv<j>.k, .v).
            "key_value_heads": sum(read.name.endswith(".k") for read in g.reads[0]),
        }
        out = {
            EDGES: Stored((len(g.senders), len(g.receivers)), said),
            CLEAN: Stored(()),
            CORRUPTED: Stored(()),
        }
        if self.config.paths:
            named = {SENDERS: said[SENDERS], RECEIVERS: list(self.config.paths)}
            out |= {
                PATHS: Stored((len(g.senders),), named),
                PATHS_DIFF: Stored((len(g.senders),), named),
            }
        return out

    def batch(self, work: Work) -> dict[str, Any]:
        batch = work.on_device
        device, index = batch.tokens.device, batch.index.cpu()
        hf = adapt(work.model).language.hf
        rows = (
            self.counterfactual[index].to(device),
            batch.mask,
            batch.read,
            batch.labels.to(device),
            self.wrong[index].to(device),
        )
        steps = self.config.ig_steps if self.config.method == "eap_ig" else 1
        runs = both_runs(hf, self.graph, rows, batch.tokens)
        clean, corrupted = runs.clean, runs.corrupted
        scores = edge_scores(hf, self.graph, rows, runs, (batch.tokens, steps))
        out = {EDGES: scores.cpu(), CLEAN: clean.cpu(), CORRUPTED: corrupted.cpu()}
        if self.config.paths:
            receivers = [self.graph.receivers.index(r) for r in self.config.paths]
            patched = path_patched(hf, self.graph, rows, runs.sent, receivers)
            gap = (clean - corrupted)[:, None]
            share = (patched - corrupted[:, None]) / gap
            share[(gap == 0).expand_as(share)] = float("nan")
            out |= {PATHS: share.cpu(), PATHS_DIFF: patched.cpu()}
        return out


def _sizes(edges: int) -> list[int]:
    """circuit.k=auto: 0, 1, 2, 5, 10, 20, 50, ... below the model's edges, and all of them."""
    out, step = [0], 1
    while step < edges:
        out += [k for k in (step, 2 * step, 5 * step) if k < edges]
        step *= 10
    return [*out, edges]


def _names(values: Any) -> list[str]:
    return [str(v.decode() if isinstance(v, bytes) else v) for v in values]


def _row_mean(ds: h5py.Dataset, rows: int) -> np.ndarray:
    """The mean over the first `rows` rows, NaN where every row is NaN (no edge, or no
    sender reaching the receivers), without numpy's warning for those."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(read_floats(ds, slice(0, rows)).astype(np.float64), axis=0)


def _faithfulness_line(ds: h5py.Dataset) -> str:
    """Each circuit size's share of clean − corrupted kept, with the edges it kept where
    the path rule dropped some of the k chosen (`kept`: files from before it have none)."""
    sizes, shares = layout.attr(ds, "k"), ds[()]
    kept = kept_of(ds.file)
    kept = list(sizes) if kept is None else list(kept)
    said = ", ".join(
        f"{int(k)} edges {s:.3f}" if int(n) == int(k) else f"{int(k)} edges ({int(n)} kept) {s:.3f}"
        for k, n, s in zip(sizes, kept, shares, strict=True)
    )
    how = "mean-ablated" if layout.attr(ds, "ablation") == "mean" else ""
    path = ", only those on a path embed -> logits" if kept_of(ds.file) is not None else ""
    return (
        f"{CIRCUIT}: faithfulness (share of clean - corrupted kept by the k largest edges{path}"
        + (f"; the other edges {how}" if how else "")
        + f"): {said}"
    )


def _paths_line(ds: h5py.Dataset, rows: int) -> str:
    """Path patching: the senders whose clean write, read by circuit.paths' receivers alone,
    brings back the largest mean share of clean − corrupted (rows whose share is NaN — clean
    = corrupted — left out of the mean)."""
    senders, receivers = _names(layout.attr(ds, SENDERS)), _names(layout.attr(ds, RECEIVERS))
    mean = _row_mean(ds, rows)
    reach = np.isfinite(mean)
    order = [int(s) for s in np.argsort(-np.abs(np.where(reach, mean, 0.0))) if reach[s]]
    shown = ", ".join(f"{senders[s]} {mean[s]:+.3f}" for s in order[:_PATHS_SHOWN])
    more = f" ({len(order) - _PATHS_SHOWN} more)" if len(order) > _PATHS_SHOWN else ""
    into = ", ".join(receivers) if len(receivers) <= 6 else f"{len(receivers)} receivers"
    return (
        f"{CIRCUIT}: path patching into {into} (mean share of clean - corrupted each sender's "
        f"clean write brings back along those edges alone): {shown}{more}"
    )


_PATHS_SHOWN = 8


@register_stage
class CircuitStage(Stage):
    name = node = "circuit"
    order = 45
    axes = {
        EDGES: "sample sender receiver",
        f"{PATHS}*": "sample sender",
        FAITHFULNESS: "size",
        FAITHFULNESS_DIFF: "size",
        FAITHFULNESS_KEPT: "size",
        CLEAN: "sample",
        CORRUPTED: "sample",
    }
    draws = (EDGES, f"{CIRCUIT}/faithfulness*", f"{PATHS}*")

    @classmethod
    def schema(cls) -> Mapping[str, type]:
        return {"circuit": CircuitConfig}

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> Any:
        return parse_circuit(raw)

    @classmethod
    def plan(cls, config: CircuitConfig, setup: Setup) -> Plan:
        setup.causal_language("circuit")
        graph = graph_of(setup)
        edges = int(graph.upstream().sum())
        if config.k == "auto":
            config = dataclasses.replace(config, k=_sizes(edges))
        if config.k and max(config.k) > edges:
            raise HookrunError(
                f"circuit.k: {max(config.k)} is more than the model's {edges} edges; valid: "
                f"sizes of 0 to {edges}"
            )
        if config.paths:
            config = dataclasses.replace(config, paths=path_receivers(graph, config.paths))
        again = _Rows(
            setup.model, setup.tokens, len(setup.data), setup.spec.batch_size, setup.device
        )
        return CircuitPlan(config, graph, counterfactuals(setup.tokens, len(setup.data)), again)

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        if EDGES not in f or not rows:
            return []
        ds = f[EDGES]
        senders, receivers = _names(layout.attr(ds, SENDERS)), _names(layout.attr(ds, RECEIVERS))
        mean = _row_mean(ds, rows)
        order = np.argsort(-np.nan_to_num(np.abs(mean), nan=-1.0), axis=None)
        shown = []
        for flat in order[: int(min(10, np.isfinite(mean).sum()))]:
            s, r = np.unravel_index(flat, mean.shape)
            shown.append(f"{senders[s]} -> {receivers[r]} {mean[s, r]:+.4g}")
        method = layout.attr(ds, "method")
        lines = [f"{CIRCUIT}: the edges with the largest mean {method} score: " + ", ".join(shown)]
        if FAITHFULNESS in f and not layout.is_pending(f[FAITHFULNESS]):
            lines.append(_faithfulness_line(f[FAITHFULNESS]))
        if PATHS in f:
            lines.append(_paths_line(f[PATHS], rows))
        return lines

    @classmethod
    def draw(cls, f: h5py.File, out_dir: Any, rows: int, config: dict) -> list:
        from hookrun.stages.circuit.draw import render_circuit  # matplotlib: when drawing

        return render_circuit(f, out_dir, rows)
