"""Tutorial 6: from a language model's cache to a sparse autoencoder spliced back in.

Caches tiny_lm's second block's output over 64 rows of its corpus, trains a small SAE on it
in plain PyTorch (to show the math; `experiment=train_sae` trains them at scale), saves it in
SAELens's format, then splices it into the model with `experiment=sae`: its latents stored
sparse, and its scores (L0, explained variance, CE loss recovered, ...) over the run's
tokens.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

import hookrun
from hookrun.io.activations import TokenBatches

# 1. The residual stream at every token of 64 rows (8,192 tokens), float32.
cache = hookrun.run(
    ["experiment=lm_cache", "limit=64", "sink.dtype=float32", "render=false"],
    run_dir="outputs/sae_cache",
)
key = "captures/transformer.h.1/output"

# 2. A ReLU SAE of 512 latents, trained with an L1 penalty on shuffled token batches.
torch.manual_seed(0)
d_in, d_sae = 128, 512
W_enc = torch.nn.Parameter(torch.randn(d_in, d_sae) / d_in**0.5)
W_dec = torch.nn.Parameter(W_enc.detach().T.clone())
b_enc, b_dec = torch.nn.Parameter(torch.zeros(d_sae)), torch.nn.Parameter(torch.zeros(d_in))
optimizer = torch.optim.Adam([W_enc, W_dec, b_enc, b_dec], lr=3e-3)
batches = TokenBatches(cache.path, key, batch_size=256, buffer=4096)
for epoch in range(6):
    batches.set_epoch(epoch)
    for x in batches:
        latents = torch.relu((x - b_dec) @ W_enc + b_enc)
        rebuilt = latents @ W_dec + b_dec
        sparsity = (latents * W_dec.norm(dim=1)).sum(-1).mean()
        loss = (rebuilt - x).pow(2).sum(-1).mean() + 4.0 * sparsity
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

# 3. Saved as SAELens saves one: cfg.json and sae_weights.safetensors.
folder = Path("outputs/saes/blocks.1.hook_resid_post")
folder.mkdir(parents=True, exist_ok=True)
weights = {"W_enc": W_enc, "W_dec": W_dec, "b_enc": b_enc, "b_dec": b_dec}
save_file(
    {k: v.detach().contiguous() for k, v in weights.items()}, folder / "sae_weights.safetensors"
)
cfg = {
    "architecture": "standard",
    "d_in": d_in,
    "d_sae": d_sae,
    "dtype": "float32",
    "apply_b_dec_to_input": True,
    "normalize_activations": "none",
    "metadata": {"hook_name": "blocks.1.hook_resid_post"},
}
(folder / "cfg.json").write_text(json.dumps(cfg, indent=2))

# 4. Spliced into the model over 32 of those rows: its latents and its scores.
result = hookrun.run(
    ["experiment=sae", f"hooks.sae.args.path={folder}", "limit=32"],
    run_dir="outputs/sae",
)
print(result.summary)
with result.open() as res:
    latents = res["sae/transformer.h.1/output/latents"]
    print("latents", latents.shape, "non-zeros stored", latents.nnz)
    scores = res["sae/transformer.h.1/output/scores"]
    for name, value in zip(scores.attrs["fields"], scores[:], strict=True):
        print(f"{name:>20} {value:.4f}")
