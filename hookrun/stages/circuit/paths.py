"""Which edges of a chosen set lie on a path from the embeddings to the logits, from the
node names of /circuit/edges alone (so the pictures, reading only the file, prune as the
faithfulness passes do).

A receiver is read by one node or more: a head's query, key or value by that head; a
grouped-query key/value head's key or value (`a1.kv0.k`) by every query head of its group;
an MLP's input by the MLP; the logits by nobody (the path ends there). A node is reached
when it is the embeddings or a chosen edge from a reached node ends at one of its
receivers; an edge is on a path when its sender is reached and its receiver is the logits
or is read by a node that has such an edge of its own. This is the edge set EAP-IG's
`Graph.prune` keeps (hannamw/EAP-IG: nodes without a chosen edge in or out removed until
nothing changes, then the edges whose ends were removed): a chosen edge that no path
through chosen edges joins to both ends cannot move the logits the circuit is measured on.
"""

from __future__ import annotations

import numpy as np

__all__ = ["readers", "on_paths"]


def readers(senders: list[str], receivers: list[str]) -> np.ndarray:
    """(receivers, senders) bool: which senders read each receiver (Graph's names:
    embed, a<l>.h<h>, m<l>; a<l>.h<h>.q|k|v, a<l>.kv<j>.k|v, m<l>, logits; a file from
    before receivers were per head names a layer's attention a<l>: all its heads)."""
    index = {name: s for s, name in enumerate(senders)}
    heads = sum(1 for s in senders if s.startswith("a0.h"))
    kv_heads = len({r.split(".")[1] for r in receivers if r.startswith("a0.") and r.endswith(".k")})
    group = heads // kv_heads if kv_heads else 1
    out = np.zeros((len(receivers), len(senders)), dtype=bool)
    for r, name in enumerate(receivers):
        parts = name.split(".")
        if name == "logits":
            continue
        if len(parts) == 1 and name.startswith("a"):  # a<layer>: every head of the layer
            out[r, [index[f"{name}.h{h}"] for h in range(heads)]] = True
        elif len(parts) == 1:  # m<layer>
            out[r, index[name]] = True
        elif parts[1].startswith("kv"):  # read by the query heads of its group
            j = int(parts[1][2:])
            out[r, [index[f"{parts[0]}.h{h}"] for h in range(j * group, (j + 1) * group)]] = True
        else:  # a<layer>.h<head>.q|k|v
            out[r, index[f"{parts[0]}.{parts[1]}"]] = True
    return out


def on_paths(chosen: np.ndarray, read_by: np.ndarray) -> np.ndarray:
    """(senders, receivers) bool: the edges of `chosen` on a path from the embeddings
    (sender 0) to the logits (the last receiver) through chosen edges alone. `read_by`:
    readers(). Every chosen edge must run from a sender to a receiver that reads after it
    writes (Graph.upstream): then Graph.senders' order is the order the nodes compute in."""
    senders, receivers = chosen.shape
    reached = np.zeros(senders, dtype=bool)
    reached[0] = True
    fed = chosen[0].copy()  # receivers a chosen edge from a reached sender ends at
    for s in range(1, senders):
        reached[s] = bool((read_by[:, s] & fed).any())
        if reached[s]:
            fed |= chosen[s]
    live = np.zeros(receivers, dtype=bool)  # receivers from which the logits are reached
    live[-1] = True
    for s in range(senders - 1, -1, -1):
        if (chosen[s] & live).any():
            live |= read_by[:, s]
    return chosen & reached[:, None] & live[None, :]
