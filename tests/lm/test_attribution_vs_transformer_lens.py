"""Attribution patching's node scores against TransformerLens 4.3's
`transformer_lens.tools.analysis.attribution_patching.attribution_patch` on the same random
GPT-2 and prompts. TransformerLens scores each head's `hook_z` and each MLP's output per
position as (a_clean − a_corrupt) · ∂metric/∂a at the corrupted run — the denoising sign
hookrun uses too — but in the metric's own units; hookrun divides by clean − corrupted, so
each TransformerLens score divided by the row's gap (a plain forward of each prompt) is
hookrun's cell. TransformerLens runs in a process of its own: importing it changes
transformers' config checks for the rest of the process."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
from conftest import run_config
from lm_models import save_lm
from test_lm_patching import ROWS, _args, _prompts

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
