"""Tutorial 2: cache a language model's residual stream and read it back.

Runs the shipped tiny_lm (2 layers, width 128) over the first rows of its held-out corpus,
stores every block's output at every token in float16, then reads the cache three ways: the
arrays through hookrun's reader, shuffled token batches for training (TokenBatches), and one
token's vector (Activations).
"""

import hookrun
from hookrun.io.activations import Activations, TokenBatches

result = hookrun.run(
    ["experiment=lm_cache", "limit=16", "render=false"], run_dir="outputs/lm_cache"
)
print(result.summary)

key = "captures/transformer.h.1/output"
with result.open() as res:
    resid = res[key]  # (N, T, D) read lazily by slicing; float16 on disk
    tokens = res["samples/tokens"][:]  # (N, T) int32
    # The corpus is packed into full rows (dataset.pack=true), so there is no padding and no
    # /samples/mask; with dataset.pack=false, /samples/mask (N, T) says which tokens are real.
    print("residual stream", resid.shape, resid.dtype, "tokens", tokens.shape)

# Shuffled batches of real tokens (padding skipped), as an SAE or a probe trains on them.
batches = TokenBatches(result.path, key, batch_size=256, buffer=2048)
seen = 0
for x in batches:  # (256, 128) float32 tensors; the last batch may be shorter
    seen += x.shape[0]
print("tokens read by TokenBatches", seen)

# A map-style Dataset: item i is the i-th real token's (D,) vector.
vector = Activations(result.path, key)[0]
print("first token's vector", tuple(vector.shape))
