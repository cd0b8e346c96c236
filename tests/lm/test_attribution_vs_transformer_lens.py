"""Attribution patching's node scores, and experiment=circuit's edge scores and
faithfulness, against TransformerLens 4.3's
`transformer_lens.tools.analysis.attribution_patching` (`attribution_patch`, node and edge
granularity, and `faithfulness`) on the same random GPT-2 and prompts.

Nodes: TransformerLens scores each head's `hook_z` and each MLP's output per position as
(a_clean − a_corrupt) · ∂metric/∂a at the corrupted run — the denoising sign hookrun uses
too — but in the metric's own units; hookrun divides by clean − corrupted, so each
TransformerLens score divided by the row's gap (a plain forward of each prompt) is hookrun's
cell. TransformerLens runs in a process of its own: importing it changes transformers'
config checks for the rest of the process."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest
from conftest import run_config
from lm_models import save_lm
from test_circuit import hand_pruned, top_edges
from test_lm_patching import ROWS, _args, _prompts

pytestmark = pytest.mark.slow  # every test here takes over ~1.5 s

REFERENCE = """
import json, sys
import numpy as np, torch, transformers
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.tools.analysis.attribution_patching import attribution_patch

folder, rows, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
tok = transformers.AutoTokenizer.from_pretrained(folder)
bridge = TransformerBridge.boot_transformers(folder, hf_model=model, tokenizer=tok, device="cpu")
bridge.eval()
layers, heads = model.config.n_layer, model.config.n_head
width = max(len(tok(r[0])["input_ids"]) for r in rows)
mlp = np.full((len(rows), layers, width), np.nan)
head = np.full((len(rows), layers, heads, width), np.nan)
gaps = []
for r, (prompt, answer, counterfactual, wrong) in enumerate(rows):
    clean = torch.tensor([tok(prompt)["input_ids"]])
    corrupt = torch.tensor([tok(counterfactual)["input_ids"]])
    right_id, wrong_id = tok(answer)["input_ids"][0], tok(wrong)["input_ids"][0]
    metric = lambda logits: logits[0, -1, right_id] - logits[0, -1, wrong_id]
    with torch.no_grad():
        gaps.append(float(metric(model(clean).logits) - metric(model(corrupt).logits)))
    for node, score in attribution_patch(bridge, clean, corrupt, metric).node_scores.items():
        if node.kind == "mlp_out":
            mlp[r, node.layer, node.position] = score
        elif node.kind == "attn_head_out":
            head[r, node.layer, node.head, node.position] = score
np.savez(out, mlp=mlp, heads=head, gaps=np.array(gaps))
"""


def test_node_scores_equal_transformer_lens_attribution_patch(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "p.jsonl")
    args = _args(tmp_path / "lm", data, "patching.sites=[mlp,heads]", "patching.method=atp")
    with h5py.File(run_config(tmp_path / "run", args).path) as f:
        got = {"mlp": f["patching/mlp_atp"][()], "heads": f["patching/heads_atp"][()]}
    out = tmp_path / "lens.npz"
    proc = subprocess.run(
        [sys.executable, "-c", REFERENCE, str(tmp_path / "lm"), json.dumps(ROWS), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lens = np.load(out)
    gaps = lens["gaps"]
    for kind in ("mlp", "heads"):
        want = lens[kind] / gaps.reshape(-1, *[1] * (lens[kind].ndim - 1))
        scored = np.isfinite(want)  # the rows' real tokens
        width = want.shape[-1]
        assert scored.sum() > 0 and (np.isfinite(got[kind][..., :width]) == scored).all(), kind
        np.testing.assert_allclose(
            got[kind][..., :width][scored], want[scored], atol=1e-4, rtol=1e-4, err_msg=kind
        )
        assert np.abs(want[scored]).max() > 0.05  # nodes that move the logits


EDGES = """
import json, sys
import numpy as np, torch, transformers
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.tools.analysis.attribution_patching import (
    EdgeAttributionConfig, attribution_patch, faithfulness, enumerate_edges,
)

folder, out = sys.argv[1], sys.argv[4]
rows, circuits = json.loads(sys.argv[2]), json.loads(sys.argv[3])
model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
tok = transformers.AutoTokenizer.from_pretrained(folder)
bridge = TransformerBridge.boot_transformers(folder, hf_model=model, tokenizer=tok, device="cpu")
bridge.eval()

def name(node):  # TransformerLens' node -> hookrun's sender or receiver name
    return {
        "embed": lambda: "embed",
        "attn_head_out": lambda: f"a{node.layer}.h{node.head}",
        "mlp_out": lambda: f"m{node.layer}",
        "q_input": lambda: f"a{node.layer}.h{node.head}.q",
        "k_input": lambda: f"a{node.layer}.h{node.head}.k",
        "v_input": lambda: f"a{node.layer}.h{node.head}.v",
        "mlp_in": lambda: f"m{node.layer}",
        "logits": lambda: "logits",
    }[node.kind]()

edges, recovered = [], []
for prompt, answer, counterfactual, wrong in rows:
    clean = torch.tensor([tok(prompt)["input_ids"]])
    corrupt = torch.tensor([tok(counterfactual)["input_ids"]])
    right_id, wrong_id = tok(answer)["input_ids"][0], tok(wrong)["input_ids"][0]
    metric = lambda logits: logits[0, -1, right_id] - logits[0, -1, wrong_id]
    result = attribution_patch(bridge, clean, corrupt, metric, EdgeAttributionConfig("edge"))
    summed = {}  # hookrun sums an edge over positions
    for (writer, reader), score in result.edge_scores.items():
        key = f"{name(writer)} -> {name(reader)}"
        summed[key] = summed.get(key, 0.0) + score
    edges.append(summed)
    every = list(result.edge_scores)
    row = []
    for kept in circuits:  # each circuit's edges at every position
        wanted = set(kept)
        circuit = [e for e in every if f"{name(e[0])} -> {name(e[1])}" in wanted]
        measured = faithfulness(bridge, clean, corrupt, metric, circuit)
        ablated = measured.corrupt_metric + measured.recovered * (
            measured.full_metric - measured.corrupt_metric
        )
        row.append([measured.full_metric, measured.corrupt_metric, ablated])
    recovered.append(row)
json.dump({"edges": edges, "faithfulness": recovered}, open(out, "w"))
"""


def test_edge_scores_and_faithfulness_equal_transformer_lens(tmp_path):
    """Every edge's EAP score — a head's query, key and value its own receivers — equals
    TransformerLens' edge-granularity score summed over positions (it scores each
    position's edge apart), in the same units (the metric's, gradient at the corrupted
    run); and the faithfulness of two circuits (the k largest edges, those on a path embed ->
    logits) equals TransformerLens' `faithfulness` of the same edges at every position, each
    row measured alone and the rows' logit differences averaged as hookrun does."""
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "p.jsonl")
    args = [
        "experiment=circuit",
        "model=hf",
        f"model.path={tmp_path / 'lm'}",
        f"dataset.path={data}",
        "batch_size=2",
        "render=false",
        "circuit.k=[6,15]",
    ]
    with h5py.File(run_config(tmp_path / "run", args).path) as f:
        got = f["circuit/edges"][()]
        senders = [str(s) for s in f["circuit/edges"].attrs["senders"]]
        receivers = [str(s) for s in f["circuit/edges"].attrs["receivers"]]
        shares = f["circuit/faithfulness"][()]
    with warnings.catch_warnings():  # edges no sender reaches: NaN in every row
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(got.astype(np.float64), axis=0)
    # Each circuit: the k largest edges, those on a path embed -> logits (EAP-IG's prune).
    circuits = [
        [
            f"{senders[s]} -> {receivers[r]}"
            for s, r in sorted(hand_pruned(top_edges(mean, k), senders, receivers))
        ]
        for k in (6, 15)
    ]
    out = tmp_path / "lens.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            EDGES,
            str(tmp_path / "lm"),
            json.dumps(ROWS),
            json.dumps(circuits),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lens = json.loads(out.read_text())
    compared = 0
    for r, scored in enumerate(lens["edges"]):
        for s, sender in enumerate(senders):
            for v, receiver in enumerate(receivers):
                key = f"{sender} -> {receiver}"
                if np.isnan(got[r, s, v]):
                    assert key not in scored, key  # not upstream: no edge in either
                    continue
                want = scored[key]
                assert abs(got[r, s, v] - want) <= 1e-4 + 1e-4 * abs(want), (
                    r,
                    key,
                    got[r, s, v],
                    want,
                )
                compared += 1
    assert compared == len(ROWS) * 46  # every edge of every row
    measured = np.array(lens["faithfulness"])  # (rows, circuits, [clean, corrupted, ablated])
    clean, corrupted = measured[:, 0, 0].mean(), measured[:, 0, 1].mean()
    want = (measured[:, :, 2].mean(0) - corrupted) / (clean - corrupted)
    np.testing.assert_allclose(shares, want, atol=1e-4)
    assert abs(want[0] - want[1]) > 0.05  # the two circuits differ
