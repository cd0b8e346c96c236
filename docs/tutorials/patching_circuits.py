"""Tutorial 3: activation patching, attribution patching and a circuit on tiny_lm.

The shipped prompts come in pairs, a clean prompt and a corrupted one of the same length
("counterfactual"), each with its answer. The first run patches every layer and position with
the clean run's activations, exactly and by attribution patching; the second scores every edge
of the model's graph (EAP) and measures how much of the clean behaviour each circuit keeps.
"""

import numpy as np

import hookrun

patching = hookrun.run(
    ["experiment=lm_patching", "limit=4", "patching.method=[exact,atp]", "render=false"],
    run_dir="outputs/patching",
)
print(patching.summary)
with patching.open() as res:
    grid = res["patching/resid"][:]  # (N, layers, positions): share of the clean logit diff
    estimate = res["patching/resid_atp"][:]  # attribution patching's first-order estimate
    error = res["patching/resid_atp_error"][:]  # estimate - exact; NaN where a cell is not scored
    pearson = res["patching/resid_atp"].attrs["pearson"]  # over every scored cell
    print("resid grid", grid.shape, estimate.shape, "largest |error|", np.nanmax(abs(error)))
    print("atp's Pearson with exact", round(float(pearson), 3))

circuit = hookrun.run(
    ["experiment=circuit", "limit=4", "circuit.k=[5,10,20]", "render=false"],
    run_dir="outputs/circuit",
)
print(circuit.summary)
with circuit.open() as res:
    edges = res["circuit/edges"]  # (N, senders, receivers): each edge's EAP score per row
    senders, receivers = list(edges.attrs["senders"]), list(edges.attrs["receivers"])
    faithfulness = res["circuit/faithfulness"][:]  # (sizes,): share of clean - corrupted kept
    kept = res["circuit/faithfulness_kept"][:]  # edges each circuit kept on a path
    print("edges", edges.shape, "senders", senders[:3], "receivers", receivers[-3:])
    for k, n, share in zip([5, 10, 20], kept, faithfulness, strict=True):
        print(f"{k} largest edges: {n} kept, {share:.2f} of clean - corrupted")
