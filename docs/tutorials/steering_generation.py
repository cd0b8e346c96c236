"""Tutorial 4: a steering vector, its effect, and text generated under it.

experiment=steering measures a vector at block 0 of tiny_lm from two prompt sets (sentences
about files minus the same sentences about lists), adds it at that block's output, scores each
row with and without it (the answer's log probability: the effect; the KL divergence) and
generates text under it, scored by the model without hooks (fluency).
"""

import hookrun

steered = hookrun.run(
    ["experiment=steering", "limit=4", "generate.max_new_tokens=8", "render=false"],
    run_dir="outputs/steering",
)
print(steered.summary)

with steered.open() as res:
    vector = res["steering/vector/transformer.h.0/output"][:]  # (D,) float64: plus - minus
    effect = res["metrics/answer_logprob"][:] - res["metrics/answer_logprob_unhooked"][:]
    kl = res["metrics/kl"][:]  # (N,) KL(unhooked || hooked), nats per position
    text = [t.decode() if isinstance(t, bytes) else t for t in res["generation/text"][:]]
    logprobs = res["generation/logprobs_unhooked"][:]  # (N, steps): fluency of each token
    print("vector norm", float((vector**2).sum() ** 0.5), "mean effect", float(effect.mean()))
    print("mean KL", float(kl.mean()))
    for row in text:
        print(repr(row))
