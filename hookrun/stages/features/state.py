"""One site's streaming state: everything a unit's dashboard needs, kept exact in memory
bounded by units x window x (k + bins x per_group), whatever the corpus.

Per unit (all of it mergeable: two states over disjoint rows merge into the state of their
union, so a resume or torchrun's ranks end where one uninterrupted process ends):

- tokens seen, tokens where it fired (> 0), its max;
- the top k firing tokens by (value descending, row, token): ties broken by the smaller
  (row, token). A batch's entries enter through a threshold (the batch's k-th value and
  the state's k-th), so only candidates are sorted; each keeps its window of token ids and
  the unit's activations at them, taken from the batch when it enters;
- the histogram of its firing activations on [0, 2^e] in `bins` equal bins, 2^e the smallest
  power of two at least its max so far. When the max passes 2^e, the grid doubles (pairs of
  bins merged: exact, because v / 2^e x bins is computed exactly for every float), so the
  final grid depends on the final max alone, never on the order rows came in;
- per histogram bin, the `per_group` firing tokens with the smallest hash of (row, token,
  unit) (ties: the smaller row, token), with their windows: the samples of a group of bins
  are then the `per_group` smallest of its bins' candidates, exactly the tokens of the group
  with the smallest hashes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["SiteState", "token_hash", "Finished"]

_M31 = (1 << 31) - 1
_EMPTY_HASH = torch.iinfo(torch.int64).max
# An exponent that no unit has: its histogram holds nothing yet.
_NO_EXP = -(1 << 40)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer mixer (products below 2^58: no int64 overflow on any device)."""
    x = x & _M31
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M31
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M31
    return (x >> 16) ^ x


def _high(row: torch.Tensor, token: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    return _mix(_mix(_mix(row) ^ (token & _M31)) ^ (unit & _M31))


def _low(row: torch.Tensor, token: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    return _mix(
        _mix(_mix(row + 0x2545F491) ^ ((token * 7 + 3) & _M31)) ^ ((unit + 0x3C6EF372) & _M31)
    )


def token_hash(row: torch.Tensor, token: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """A 62-bit hash of (row, token, unit), the same on every device and process."""
    return (_high(row, token, unit) << 31) | _low(row, token, unit)


def _pid(row: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """(row, token) as one integer ordered as the pair (a row's positions below 2^24)."""
    return (row << 24) | token


def _lexorder(*keys: torch.Tensor) -> torch.Tensor:
    """The permutation sorting 1-D `keys` lexicographically (the first most significant)."""
    perm = torch.arange(len(keys[0]), device=keys[0].device)
    for key in reversed(keys):
        perm = perm[torch.sort(key[perm], stable=True).indices]
    return perm


def _ranks(segment: torch.Tensor) -> torch.Tensor:
    """Each element's rank within its run of equal values of a sorted 1-D `segment`."""
    first = torch.searchsorted(segment, segment, right=False)
    return torch.arange(len(segment), device=segment.device) - first


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """The smallest e with 2^e >= x, for x > 0 (exact: frexp)."""
    mantissa, exponent = torch.frexp(x.double())
    return exponent.long() - (mantissa == 0.5).long()


# A function giving the windows (context ids, values) of the new entries at given indices.
Windows = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Finished:
    """A site's dashboards as arrays (the file's datasets, by their names in the group)."""

    arrays: dict[str, np.ndarray]
    tokens: int
    rows: int


class SiteState:
    """The exact state of `units` units (module docstring); `window` (before, after), None
    for data without tokens."""

    def __init__(
        self,
        units: int,
        k: int,
        window: tuple[int, int] | None,
        bins: int,
        per_group: int,
        device: torch.device,
    ) -> None:
        self.units, self.k, self.bins, self.per_group = units, k, bins, per_group
        self.window = window
        self.width = 0 if window is None else window[0] + 1 + window[1]
        self.device = device
        self.tokens = 0
        self.rows = 0
        u, w, b, p = units, self.width, bins, per_group
        z = {"device": device}
        self.t: dict[str, torch.Tensor] = {
            "fired": torch.zeros(u, dtype=torch.int64, **z),
            "max": torch.full((u,), -torch.inf, **z),
            "top_value": torch.full((u, k), -torch.inf, **z),
            "top_row": torch.full((u, k), -1, dtype=torch.int64, **z),
            "top_token": torch.full((u, k), -1, dtype=torch.int64, **z),
            "top_context": torch.full((u, k, w), -1, dtype=torch.int32, **z),
            "top_context_value": torch.zeros((u, k, w), **z),
            "exp": torch.full((u,), _NO_EXP, dtype=torch.int64, **z),
            "counts": torch.zeros((u, b), dtype=torch.int64, **z),
            "cand_hash": torch.full((u, b, p), _EMPTY_HASH, dtype=torch.int64, **z),
            "cand_row": torch.full((u, b, p), -1, dtype=torch.int64, **z),
            "cand_token": torch.full((u, b, p), -1, dtype=torch.int64, **z),
            "cand_value": torch.zeros((u, b, p), **z),
            "cand_context": torch.full((u, b, p, w), -1, dtype=torch.int32, **z),
            "cand_context_value": torch.zeros((u, b, p, w), **z),
        }

    # ------------------------------------------------------------------ bytes, saving
    @staticmethod
    def nbytes(units: int, k: int, width: int, bins: int, per_group: int) -> int:
        """What the state of one site holds (its tensors' bytes)."""
        top = units * k * (4 + 16 + width * 8)
        cand = units * bins * per_group * (4 + 24 + width * 8)
        return top + cand + units * (bins * 8 + 24)

    def state_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "rows": self.rows,
            **{name: t.cpu() for name, t in self.t.items()},
        }

    def load_state_dict(self, saved: dict) -> None:
        self.tokens, self.rows = int(saved["tokens"]), int(saved["rows"])
        for name in self.t:
            self.t[name] = saved[name].to(self.device)

    # ------------------------------------------------------------------ one batch
    @torch.no_grad()
    def update(
        self,
        acts: torch.Tensor,
        rows: torch.Tensor,
        mask: torch.Tensor,
        ids: torch.Tensor | None,
    ) -> None:
        """Add a batch: `acts` (n, T, U) float32 (T positions per row: tokens, or a map's
        flattened y*W+x), `rows` (n,) their dataset rows, `mask` (n, T) the real positions,
        `ids` (n, T) the token ids (None: no windows)."""
        n, positions, units = acts.shape
        t = self.t
        real = mask.bool()[..., None]
        firing = (acts > 0) & real
        self.tokens += int(mask.bool().sum())
        self.rows += n
        t["fired"] += firing.sum((0, 1))
        if n * positions:
            t["max"] = torch.maximum(t["max"], acts.masked_fill(~real, -torch.inf).amax((0, 1)))
        flat = torch.where(firing, acts, -torch.inf).reshape(n * positions, units)
        if not bool(firing.any()):
            return
        rows = rows.to(acts.device, torch.int64)

        def windows(pos: torch.Tensor, unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self._windows(pos // positions, pos % positions, unit, acts, ids, mask)

        # The top k: the batch's candidates are at least its k-th and the state's k-th.
        kth = flat.topk(min(self.k, n * positions), dim=0).values[-1]
        threshold = torch.maximum(kth, t["top_value"][:, -1])
        pos, unit = ((flat >= threshold) & (flat > 0)).nonzero(as_tuple=True)
        self._merge_top(
            unit,
            flat[pos, unit],
            rows[pos // positions],
            pos % positions,
            lambda i: windows(pos[i], unit[i]),
        )
        # The histogram's grid, doubled where the batch's max passed it.
        top = flat.amax(0)
        grown = torch.where(top > 0, _ceil_log2(top.clamp(min=1e-45)), t["exp"])
        self._regrid(torch.maximum(t["exp"], grown))
        pos, unit = firing.reshape(n * positions, units).nonzero(as_tuple=True)
        value = flat[pos, unit]
        cell = unit * self.bins + self._bin(value, t["exp"][unit])
        t["counts"].view(-1).index_add_(0, cell, torch.ones_like(cell))
        row, token = rows[pos // positions], pos % positions
        # A token is a candidate only where its hash is within its bin's per_group smallest:
        # its high half first (most tokens are out by it), the low half only for the rest.
        bound = t["cand_hash"].view(-1, self.per_group)[cell, -1]
        i = (_high(row, token, unit) <= (bound >> 31)).nonzero(as_tuple=True)[0]
        hashed = token_hash(row[i], token[i], unit[i])
        j = i[hashed <= bound[i]]
        hashed = hashed[hashed <= bound[i]]
        self._merge_cand(
            cell[j],
            hashed,
            row[j],
            token[j],
            value[j],
            lambda m: windows(pos[j[m]], unit[j[m]]),
        )

    def _bin(self, value: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
        """Each firing value's bin on its unit's grid: floor(v / 2^e x bins), exact."""
        scaled = torch.ldexp(value.double(), (-exp).double()) * self.bins
        return scaled.floor().long().clamp(0, self.bins - 1)

    def _windows(
        self,
        b: torch.Tensor,
        token: torch.Tensor,
        unit: torch.Tensor,
        acts: torch.Tensor,
        ids: torch.Tensor | None,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each entry's window: the token ids (-1 outside the row) and the unit's activation
        at each (0 outside)."""
        if self.window is None:
            e = len(b)
            return (
                torch.empty((e, 0), dtype=torch.int32, device=acts.device),
                torch.empty((e, 0), device=acts.device),
            )
        before, after = self.window
        positions = acts.shape[1]
        at = token[:, None] + torch.arange(-before, after + 1, device=acts.device)[None]
        inside = (at >= 0) & (at < positions)
        at = at.clamp(0, positions - 1)
        rows = b[:, None].expand_as(at)
        inside &= mask.bool()[rows, at]
        context = torch.where(inside, ids[rows, at], -1).to(torch.int32)
        values = torch.where(inside, acts[rows, at, unit[:, None].expand_as(at)], 0.0)
        return context, values.float()

    # ------------------------------------------------------------------ exact merges
    def _merge_top(
        self,
        unit: torch.Tensor,
        value: torch.Tensor,
        row: torch.Tensor,
        token: torch.Tensor,
        windows: Windows,
    ) -> None:
        """New entries (each a unit's) merged into the top k by (value desc, row, token)."""
        if not len(unit):
            return
        t, k = self.t, self.k
        touched = unit.unique()
        old = t["top_value"][touched] > -torch.inf
        slot = torch.arange(k, device=unit.device)[None].expand(len(touched), k)
        o_unit = touched[:, None].expand(len(touched), k)[old]
        o_slot = slot[old]
        all_unit = torch.cat([unit, o_unit])
        all_value = torch.cat([value, t["top_value"][o_unit, o_slot]])
        all_row = torch.cat([row, t["top_row"][o_unit, o_slot]])
        all_token = torch.cat([token, t["top_token"][o_unit, o_slot]])
        order = _lexorder(all_unit, -all_value, _pid(all_row, all_token))
        rank = _ranks(all_unit[order])
        keep = order[rank < k]
        keep_rank = rank[rank < k]
        fresh = keep < len(unit)
        local = torch.searchsorted(touched, all_unit[keep])
        names = ("value", "row", "token", "context", "context_value")
        fills = {"value": -torch.inf, "row": -1, "token": -1, "context": -1, "context_value": 0}
        new = {
            name: torch.full_like(t[f"top_{name}"][: len(touched)], fills[name]) for name in names
        }
        new["value"][local, keep_rank] = all_value[keep]
        new["row"][local, keep_rank] = all_row[keep]
        new["token"][local, keep_rank] = all_token[keep]
        if self.width:
            came = keep[~fresh] - len(unit)
            old_ctx = t["top_context"][o_unit[came], o_slot[came]]
            old_val = t["top_context_value"][o_unit[came], o_slot[came]]
            new["context"][local[~fresh], keep_rank[~fresh]] = old_ctx
            new["context_value"][local[~fresh], keep_rank[~fresh]] = old_val
            ctx, val = windows(keep[fresh])
            new["context"][local[fresh], keep_rank[fresh]] = ctx
            new["context_value"][local[fresh], keep_rank[fresh]] = val
        for name in names:
            t[f"top_{name}"][touched] = new[name]

    def _merge_cand(
        self,
        cell: torch.Tensor,
        hashed: torch.Tensor,
        row: torch.Tensor,
        token: torch.Tensor,
        value: torch.Tensor,
        windows: Windows,
    ) -> None:
        """New entries merged into their bins' per_group smallest (hash, row, token)."""
        if not len(cell):
            return
        t, p = self.t, self.per_group
        flat = {
            name: t[f"cand_{name}"].view(self.units * self.bins, *t[f"cand_{name}"].shape[2:])
            for name in ("hash", "row", "token", "value", "context", "context_value")
        }
        touched = cell.unique()
        old = flat["hash"][touched] != _EMPTY_HASH
        slot = torch.arange(p, device=cell.device)[None].expand(len(touched), p)
        o_cell = touched[:, None].expand(len(touched), p)[old]
        o_slot = slot[old]
        all_cell = torch.cat([cell, o_cell])
        all_hash = torch.cat([hashed, flat["hash"][o_cell, o_slot]])
        all_row = torch.cat([row, flat["row"][o_cell, o_slot]])
        all_token = torch.cat([token, flat["token"][o_cell, o_slot]])
        all_value = torch.cat([value, flat["value"][o_cell, o_slot]])
        order = _lexorder(all_cell, all_hash, _pid(all_row, all_token))
        rank = _ranks(all_cell[order])
        keep = order[rank < p]
        keep_rank = rank[rank < p]
        fresh = keep < len(cell)
        local = torch.searchsorted(touched, all_cell[keep])
        fills = {"hash": _EMPTY_HASH, "row": -1, "token": -1, "value": 0}
        new = {
            name: torch.full_like(
                flat[name][: len(touched)], fills.get(name, -1 if name == "context" else 0)
            )
            for name in flat
        }
        new["hash"][local, keep_rank] = all_hash[keep]
        new["row"][local, keep_rank] = all_row[keep]
        new["token"][local, keep_rank] = all_token[keep]
        new["value"][local, keep_rank] = all_value[keep]
        if self.width:
            came = keep[~fresh] - len(cell)
            new["context"][local[~fresh], keep_rank[~fresh]] = flat["context"][
                o_cell[came], o_slot[came]
            ]
            new["context_value"][local[~fresh], keep_rank[~fresh]] = flat["context_value"][
                o_cell[came], o_slot[came]
            ]
            ctx, val = windows(keep[fresh])
            new["context"][local[fresh], keep_rank[fresh]] = ctx
            new["context_value"][local[fresh], keep_rank[fresh]] = val
        for name in flat:
            flat[name][touched] = new[name]

    def _regrid(self, exp: torch.Tensor) -> None:
        """Each unit's grid on [0, 2^exp]: bins merged 2^d at a time where it grew by d."""
        t, b, p = self.t, self.bins, self.per_group
        had = t["exp"] != _NO_EXP
        shift = torch.where(had, exp - t["exp"], torch.zeros_like(exp))
        for d in sorted(set(shift[shift > 0].tolist())):
            units = (shift == d).nonzero(as_tuple=True)[0]
            factor = min(1 << min(d, 62), b)
            cells = b // factor
            m = len(units)
            counts = t["counts"][units].view(m, cells, factor).sum(-1)
            t["counts"][units] = torch.nn.functional.pad(counts, (0, b - cells))
            names = ("hash", "row", "token", "value", "context", "context_value")
            parts = {n: t[f"cand_{n}"][units] for n in names}
            grouped = {n: v.reshape(m, cells, factor * p, *v.shape[3:]) for n, v in parts.items()}
            # Each merged bin's per_group smallest (hash, row, token): stable sorts, the
            # least significant key first.
            perm = torch.arange(factor * p, device=exp.device).expand(m, cells, factor * p)
            for key in ("token", "row", "hash"):
                keyed = torch.gather(grouped[key], 2, perm)
                perm = torch.gather(perm, 2, torch.sort(keyed, dim=2, stable=True).indices)
            perm = perm[..., :p]
            for n, v in grouped.items():
                index = perm[..., None].expand(m, cells, p, v.shape[3]) if v.dim() == 4 else perm
                picked = torch.gather(v, 2, index)
                fill = (
                    _EMPTY_HASH if n == "hash" else (-1 if n in ("row", "token", "context") else 0)
                )
                out = torch.full_like(parts[n], fill)
                out[:, :cells] = picked
                t[f"cand_{n}"][units] = out
        t["exp"] = torch.where(had | (exp != _NO_EXP), exp, t["exp"])

    def merge(self, other: SiteState) -> None:
        """`other`'s rows (disjoint from this state's) added: the state of both."""
        t, o = self.t, other.t
        self.tokens += other.tokens
        self.rows += other.rows
        t["fired"] += o["fired"]
        t["max"] = torch.maximum(t["max"], o["max"])
        mine, theirs = t["exp"], o["exp"]
        exp = torch.maximum(mine, theirs)
        self._regrid(exp)
        other._regrid(exp)
        t["counts"] += o["counts"]
        valid = o["top_value"] > -torch.inf
        unit, slot = valid.nonzero(as_tuple=True)
        self._merge_top(
            unit,
            o["top_value"][unit, slot],
            o["top_row"][unit, slot],
            o["top_token"][unit, slot],
            lambda i: (
                o["top_context"][unit[i], slot[i]],
                o["top_context_value"][unit[i], slot[i]],
            ),
        )
        shape = (-1, self.per_group)
        hashes = o["cand_hash"].view(shape)
        cell, slot = (hashes != _EMPTY_HASH).nonzero(as_tuple=True)
        cells = self.units * self.bins
        ctx = o["cand_context"].view(cells, self.per_group, self.width)
        cval = o["cand_context_value"].view(cells, self.per_group, self.width)
        self._merge_cand(
            cell,
            hashes[cell, slot],
            o["cand_row"].view(shape)[cell, slot],
            o["cand_token"].view(shape)[cell, slot],
            o["cand_value"].view(shape)[cell, slot],
            lambda i: (ctx[cell[i], slot[i]], cval[cell[i], slot[i]]),
        )

    # ------------------------------------------------------------------ the end
    def finish(self, groups: int, grouping: str) -> Finished:
        """The dashboards' arrays: top, quantile groups' samples, histogram, max, density."""
        t = {name: v.cpu().numpy() for name, v in self.t.items()}
        u, b, p, w = self.units, self.bins, self.per_group, self.width
        top_value = t["top_value"].astype(np.float32)
        top_value[t["top_row"] < 0] = np.nan
        out: dict[str, np.ndarray] = {
            "max": np.where(np.isfinite(t["max"]), t["max"], np.nan).astype(np.float32),
            "density": t["fired"] / max(self.tokens, 1),
            "top/value": top_value,
            "top/row": t["top_row"],
            "top/token": t["top_token"],
        }
        if w:
            out["top/context"] = t["top_context"].astype(np.int64)
            out["top/context_value"] = t["top_context_value"].astype(np.float32)
        exp = t["exp"]
        scale = np.where(exp == _NO_EXP, 1.0, np.ldexp(1.0, np.clip(exp, -1000, 1000)))
        edges = scale[:, None] * (np.arange(b + 1) / b)[None]
        out["histogram/edges"] = edges.astype(np.float32)
        out["histogram/counts"] = t["counts"]
        q_edges = np.zeros((u, groups + 1), dtype=np.float32)
        q = {
            "value": np.full((u, groups, p), np.nan, dtype=np.float32),
            "row": np.full((u, groups, p), -1, dtype=np.int64),
            "token": np.full((u, groups, p), -1, dtype=np.int64),
            "context": np.full((u, groups, p, w), -1, dtype=np.int64),
            "context_value": np.zeros((u, groups, p, w), dtype=np.float32),
        }
        firing_max = np.where(t["top_row"][:, 0] >= 0, t["top_value"][:, 0], 0.0)
        for unit in range(u):
            counts = t["counts"][unit]
            if not counts.any():
                continue
            group_of, q_edges[unit] = _groups(
                counts, edges[unit], firing_max[unit], groups, grouping
            )
            for g in range(groups):
                chosen = np.nonzero(group_of == g)[0]
                if not len(chosen):
                    continue
                hashes = t["cand_hash"][unit, chosen].reshape(-1)
                rows = t["cand_row"][unit, chosen].reshape(-1)
                tokens = t["cand_token"][unit, chosen].reshape(-1)
                real = rows >= 0
                order = np.lexsort((tokens[real], rows[real], hashes[real]))[:p]
                index = np.nonzero(real)[0][order]
                n = len(index)
                q["value"][unit, g, :n] = t["cand_value"][unit, chosen].reshape(-1)[index]
                q["row"][unit, g, :n] = rows[index]
                q["token"][unit, g, :n] = tokens[index]
                if w:
                    q["context"][unit, g, :n] = t["cand_context"][unit, chosen].reshape(-1, w)[
                        index
                    ]
                    q["context_value"][unit, g, :n] = t["cand_context_value"][unit, chosen].reshape(
                        -1, w
                    )[index]
        out["quantiles/edges"] = q_edges
        for name in ("value", "row", "token"):
            out[f"quantiles/{name}"] = q[name]
        if w:
            out["quantiles/context"] = q["context"]
            out["quantiles/context_value"] = q["context_value"]
        return Finished(out, self.tokens, self.rows)


def _groups(
    counts: np.ndarray, edges: np.ndarray, top: float, groups: int, grouping: str
) -> tuple[np.ndarray, np.ndarray]:
    """Each histogram bin's group and the groups' edges, snapped to the bins.

    intervals: group g is [g, g+1) x max / groups (SAEDashboard's interval groups), a bin
    going where its lower edge lies; quantiles: a bin goes where the count of firing tokens
    below it lies, of groups equal shares. Edges: each group's first bin's lower edge (the
    next group's where it has none), the last the upper edge of the highest bin that fired.
    """
    bins = len(counts)
    lower = edges[:-1]
    if grouping == "intervals":
        bounds = top * np.arange(1, groups) / groups
        group_of = np.searchsorted(bounds, lower, side="right")
    else:
        below = np.concatenate([[0], np.cumsum(counts)[:-1]])
        bounds = counts.sum() * np.arange(1, groups) / groups
        group_of = np.searchsorted(bounds, below, side="right")
    last = int(np.nonzero(counts)[0][-1])
    out = np.empty(groups + 1, dtype=np.float32)
    out[groups] = edges[last + 1]
    for g in range(groups - 1, -1, -1):
        first = np.nonzero(group_of == g)[0]
        out[g] = lower[first[0]] if len(first) and first[0] <= last else out[g + 1]
    out[0] = 0.0
    return np.minimum(group_of, groups - 1).astype(np.int64)[:bins], out
