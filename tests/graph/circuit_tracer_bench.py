"""Run by .venv-circuit-tracer's python (tests/benchmarks/attribution_graph.py starts it):
circuit-tracer 0.5.0's attribute, prune_graph and compute_graph_scores on SPEC's prompt
(circuit_tracer_script.py's SPEC), timed; prints one JSON line {seconds, attribute_seconds,
prune_seconds, nodes, active, peak_rss_mib}.

    python circuit_tracer_bench.py SPEC.json
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import circuit_tracer_script as cts  # noqa: E402


def main(spec_path: str) -> None:
    from circuit_tracer import attribute
    from circuit_tracer.graph import compute_graph_scores, prune_graph

    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    folder = Path(spec["model"]).resolve()
    model, hf = cts._model(folder, cts._transcoders(Path(spec["transcoders"]).resolve()))
    del hf
    tokens = torch.tensor(spec["tokens"], dtype=torch.long)
    t0 = time.perf_counter()
    graph = attribute(
        tokens,
        model,
        max_n_logits=spec["max_n_logits"],
        desired_logit_prob=spec["desired_logit_prob"],
        batch_size=spec["batch_size"],
        max_feature_nodes=spec["max_feature_nodes"],
    )
    t1 = time.perf_counter()
    prune_graph(graph, spec["node_threshold"], spec["edge_threshold"])
    compute_graph_scores(graph)
    t2 = time.perf_counter()
    print(
        json.dumps(
            {
                "seconds": t2 - t0,
                "attribute_seconds": t1 - t0,
                "prune_seconds": t2 - t1,
                "nodes": int(graph.adjacency_matrix.shape[0]),
                "active": int(graph.active_features.shape[0]),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
