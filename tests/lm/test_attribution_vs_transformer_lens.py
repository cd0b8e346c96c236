"""Attribution patching's node scores against TransformerLens 4.3's
`transformer_lens.tools.analysis.attribution_patching.attribution_patch` on the same random
GPT-2 and prompts. TransformerLens scores each head's `hook_z` and each MLP's output per
position as (a_clean − a_corrupt) · ∂metric/∂a at the corrupted run — the denoising sign
hookrun uses too — but in the metric's own units; hookrun divides by clean − corrupted, so
each TransformerLens score divided by the row's gap (a plain forward of each prompt) is
hookrun's cell."""

from __future__ import annotations

import h5py
import numpy as np
import torch
import transformers
from conftest import run_config
from lm_models import save_lm
from test_lm_patching import ROWS, _args, _prompts


def test_node_scores_equal_transformer_lens_attribution_patch(tmp_path):
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.tools.analysis.attribution_patching import attribution_patch

    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "p.jsonl")
    args = _args(tmp_path / "lm", data, "patching.sites=[mlp,heads]", "patching.method=atp")
    with h5py.File(run_config(tmp_path / "run", args).path) as f:
        mlp, heads = f["patching/mlp_atp"][()], f["patching/heads_atp"][()]

    # TransformerLens gets its own copy of the model and tokenizer, read from the folder.
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lm").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "lm")
    bridge = TransformerBridge.boot_transformers(
        str(tmp_path / "lm"), hf_model=model, tokenizer=tok, device="cpu"
    )
    bridge.eval()
    compared, largest = 0, 0.0
    for r, (prompt, answer, counterfactual, wrong) in enumerate(ROWS):
        clean = torch.tensor([tok(prompt)["input_ids"]])
        corrupt = torch.tensor([tok(counterfactual)["input_ids"]])
        right_id, wrong_id = tok(answer)["input_ids"][0], tok(wrong)["input_ids"][0]

        def metric(logits, right_id=right_id, wrong_id=wrong_id):
            return logits[0, -1, right_id] - logits[0, -1, wrong_id]

        with torch.no_grad():
            gap = float(metric(model(clean).logits) - metric(model(corrupt).logits))
        scores = attribution_patch(bridge, clean, corrupt, metric).node_scores
        for node, score in scores.items():
            if node.kind == "mlp_out":
                got = mlp[r, node.layer, node.position]
            elif node.kind == "attn_head_out":
                got = heads[r, node.layer, node.head, node.position]
            else:  # the embeddings: hookrun's grid has no embedding site
                continue
            np.testing.assert_allclose(got, score / gap, atol=1e-4, rtol=1e-4, err_msg=str(node))
            compared += 1
            largest = max(largest, abs(score / gap))
        assert np.isnan(mlp[r, :, clean.shape[1] :]).all()  # past the row's end: padding
    assert largest > 0.05  # the scores say something: nodes that move the logits
    layers, n_heads = model.config.n_layer, model.config.n_head
    assert compared == sum(len(tok(row[0])["input_ids"]) for row in ROWS) * layers * (n_heads + 1)
