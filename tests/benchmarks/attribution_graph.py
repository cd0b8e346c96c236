"""Attribution graphs: hookrun's (experiment=attribution_graph's computation) against
circuit-tracer 0.5.0's on the same random GPT-2 and transcoders, per prompt length: wall
seconds of the graph (attribute + prune + scores; model load left out on both sides) and
each process's peak RSS, each side in a process of its own (circuit-tracer in
.venv-circuit-tracer), a process killed when its RSS passes --limit GiB (what "handles a
prompt in 16 GiB" means here).

    python tests/benchmarks/attribution_graph.py [--lengths 64 128 256] [--limit 16]
        [--max-feature-nodes 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import hookrun  # noqa: F401  (the benchmark measures hookrun's own modules)
from hookrun.dictionaries.load import load_dictionaries
from hookrun.stages.graph.attribution import attribute
from hookrun.stages.graph.prune import prune, scores
from hookrun.stages.graph.replacement import Replacement

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "graph"))


def _hookrun_side(spec_path: str) -> None:
    import transformers

    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(spec["model"], attn_implementation="eager")
    hf.eval()
    transcoders = load_dictionaries(spec["transcoders"], "graph.transcoders")
    tokens = torch.tensor(spec["tokens"])
    t0 = time.perf_counter()
    frozen, logits = Replacement.capture(hf, tokens, transcoders, ["pre_affine"] * len(transcoders))
    graph = attribute(
        frozen,
        tokens,
        logits,
        max_logits=spec["max_n_logits"],
        probability=spec["desired_logit_prob"],
        batch=spec["batch_size"],
        max_features=spec["max_feature_nodes"],
    )
    t1 = time.perf_counter()
    prune(graph, spec["node_threshold"], spec["edge_threshold"])
    scores(graph)
    t2 = time.perf_counter()
    print(
        json.dumps(
            {
                "seconds": t2 - t0,
                "attribute_seconds": t1 - t0,
                "prune_seconds": t2 - t1,
                "nodes": graph.n_nodes,
                "active": int(graph.features.shape[0]),
                "entries": int(graph.col.numel()),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


def _watched(cmd: list[str], limit_gib: float) -> dict:
    """The command's JSON line, or {"killed": peak} when its RSS passed the limit."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    peak = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024
        except (OSError, StopIteration):
            rss = 0
        peak = max(peak, rss)
        if rss > limit_gib * 2**30:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"killed_at_mib": peak / 2**20}
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(err[-3000:])
    return json.loads(out.strip().splitlines()[-1])


def _build(folder: Path, args) -> None:
    from graph_models import save_gpt2, write_transcoders
    from safetensors.torch import load_file, save_file

    model = save_gpt2(
        folder / "model",
        n_layer=args.layers,
        n_embd=128,
        n_head=4,
        n_positions=4096,
        ln_f_scale=30.0,
    )
    write_transcoders(folder / "tc", model, d_tc=args.width)
    for i in range(args.layers):  # about 5 % of the latents active, not the builder's 30 %
        path = folder / "tc" / f"layer_{i}.safetensors"
        tensors = load_file(path)
        tensors["b_enc"] = tensors["b_enc"] - 1.15
        save_file(tensors, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--limit", type=float, default=16.0)
    parser.add_argument(
        "--max-feature-nodes",
        type=int,
        default=None,
        help="graph.max_feature_nodes on both sides (default: every active feature a node)",
    )
    parser.add_argument("--sides", nargs="+", default=["hookrun", "circuit-tracer"])
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "hookrun":
        return _hookrun_side(args.spec)
    from reference_venvs import circuit_tracer_python

    tmp = Path(tempfile.mkdtemp(prefix="graph_bench_"))
    _build(tmp, args)
    print(f"load average {os.getloadavg()}", flush=True)
    rows = []
    for length in args.lengths:
        rng = random.Random(length)
        spec = {
            "model": str(tmp / "model"),
            "transcoders": str(tmp / "tc"),
            "tokens": [0] + [rng.randrange(1, 2048) for _ in range(length - 1)],
            "max_n_logits": 10,
            "desired_logit_prob": 0.95,
            "batch_size": 256,
            "max_feature_nodes": args.max_feature_nodes,
            "node_threshold": 0.8,
            "edge_threshold": 0.98,
        }
        path = tmp / f"spec{length}.json"
        path.write_text(json.dumps(spec), encoding="utf-8")
        for side in args.sides:
            if side == "hookrun":
                cmd = [sys.executable, __file__, "--side", "hookrun", str(path)]
            else:
                cmd = [
                    str(circuit_tracer_python()),
                    str(ROOT / "tests/graph/circuit_tracer_bench.py"),
                    str(path),
                ]
            got = _watched(cmd, args.limit)
            print(f"T={length} {side}: {got} (load {os.getloadavg()[0]:.1f})", flush=True)
            rows.append((length, side, got))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
