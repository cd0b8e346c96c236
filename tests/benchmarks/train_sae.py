"""Training one SAE: hookrun's `Trainer.step` against SAELens 6.54's `SAETrainer.step`, fed the
same batches from memory, from the same initial weights: tokens/s side by side, and peak RSS.

    python tests/benchmarks/train_sae.py [--d-in 128] [--width 1024] [--batch 4096]
        [--steps 20] [--reps 3] [--k 32] [--threads 2] [--no-metrics]

Not part of the test run. Each architecture (topk with k=`--k`, relu with l1 5) is trained
`--steps` steps after one warm-up step, in a process of its own per library and repetition
(SAELens in its venv, tests/reference_venvs.py, by tests/training/saelens_train_script.py's
bench mode; hookrun by this script's `--worker`), repetitions interleaved; the data are
synthetic (tests/training/test_dictionary_vs_saelens.py's sparse codes, widened to d_in) and
dead latents are made to exist after half the steps (dead window = steps / 2) so that AuxK is
part of topk's cost. hookrun computes its metrics on every step (they are one host transfer)
unless `--no-metrics`; SAELens's trainer logs none (no wandb). Ratios are the median over
repetitions of SAELens seconds / hookrun seconds within one repetition; peak RSS is each
worker process's whole (torch included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from reference_venvs import saelens_python  # noqa: E402

SCRIPT = ROOT / "tests" / "training" / "saelens_train_script.py"


def _data(d_in: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n_features = 4 * d_in
    directions = torch.randn(n_features, d_in, generator=g)
    directions = directions / directions.norm(dim=-1, keepdim=True)
    on = torch.rand(n, n_features, generator=g) < 8 / n_features
    codes = on * (torch.rand(n, n_features, generator=g) * 2 + 0.5)
    return codes @ directions + 0.05 * torch.randn(n, d_in, generator=g)


def _hypers(args: argparse.Namespace) -> dict:
    from hookrun.training.dictionary import Hyper

    common = dict(
        d_in=args.d_in,
        d_out=args.d_in,
        width=args.width,
        total_steps=args.steps + 1,
        dead_tokens=(args.steps // 2) * args.batch,
        lr=1e-3,
    )
    return {
        "topk": Hyper("topk", k=args.k, **common),
        "relu": Hyper("relu", l1_coefficient=5.0, **common),
    }


def _worker(args: argparse.Namespace) -> None:
    """One library's run of one architecture in this process: seconds and peak RSS."""
    from hookrun.training.dictionary import Trainer

    torch.set_num_threads(args.threads)
    h = _hypers(args)[args.worker]
    train = load_file(args.data)["train"]
    trainer = Trainer(h, torch.Generator().manual_seed(0))
    batches = list(train.split(args.batch))
    trainer.step(batches[0], metrics=not args.no_metrics)
    start, start_cpu = time.perf_counter(), time.process_time()
    for batch in batches[1:]:
        trainer.step(batch, metrics=not args.no_metrics)
    seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "peak_rss": peak}))


def _saelens_case(h, batch: int, init: Path) -> dict:
    sae: dict = {"d_sae": h.width}
    if h.architecture == "relu":
        sae["l1_coefficient"] = h.l1_coefficient
    else:
        sae |= {"k": h.k}
    return {
        "architecture": {"relu": "standard"}.get(h.architecture, h.architecture),
        "sae": sae,
        "trainer": {
            "total_training_samples": h.total_steps * batch,
            "train_batch_size_samples": batch,
            "lr": h.lr,
            "lr_end": h.lr,
            "dead_feature_window": h.dead_tokens // batch,
        },
        "init": str(init),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-in", type=int, default=128)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-metrics", action="store_true")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    from hookrun.training.dictionary import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="train_sae_bench_"))
    data = tmp / "data.safetensors"
    n = (args.steps + 1) * args.batch
    save_file({"train": _data(args.d_in, n, 1), "heldout": _data(args.d_in, 8, 2)}, data)
    hypers = _hypers(args)
    cases = {}
    for name, h in hypers.items():
        init = tmp / f"{name}.init.safetensors"
        trainer = Trainer(h, torch.Generator().manual_seed(0))
        save_file({n: p.detach().clone() for n, p in trainer.params.items()}, init)
        cases[name] = _saelens_case(h, args.batch, init)
    python = saelens_python()
    seconds: dict[str, dict[str, list[float]]] = {n: {"hookrun": [], "saelens": []} for n in cases}
    cpu: dict[str, dict[str, list[float]]] = {n: {"hookrun": [], "saelens": []} for n in cases}
    rss: dict[str, dict[str, int]] = {n: {} for n in cases}
    for rep in range(args.reps):
        for name, case in cases.items():
            order = ["hookrun", "saelens"] if rep % 2 == 0 else ["saelens", "hookrun"]
            for lib in order:
                if lib == "hookrun":
                    cmd = [sys.executable, __file__, "--worker", name, "--data", str(data)]
                    cmd += [
                        f"--{k.replace('_', '-')}={v}"
                        for k, v in vars(args).items()
                        if k in ("d_in", "width", "batch", "steps", "k", "threads")
                    ]
                    cmd += ["--no-metrics"] if args.no_metrics else []
                    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    secs, used = result["seconds"], result["cpu_seconds"]
                    peak = result["peak_rss"]
                else:
                    spec = {
                        "data": str(data),
                        "cases": {name: case},
                        "bench": {"repeats": 1, "threads": args.threads, "only": True},
                    }
                    (tmp / "spec.json").write_text(json.dumps(spec))
                    subprocess.run(
                        [str(python), str(SCRIPT), str(tmp / "spec.json"), str(tmp / "out")],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    result = json.loads((tmp / "out" / "bench.json").read_text())
                    secs, used = result["seconds"][name][0], result["cpu_seconds"][name][0]
                    peak = result["peak_rss"]
                seconds[name][lib].append(secs)
                cpu[name][lib].append(used)
                rss[name][lib] = max(rss[name].get(lib, 0), peak)
                print(f"rep {rep} {name} {lib}: {secs:.2f} s, {used:.2f} CPU s", flush=True)
    tokens = args.steps * args.batch
    print(
        f"\nd_in {args.d_in}, width {args.width}, batch {args.batch}, {args.steps} steps, "
        f"k {args.k}; {platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
        f"median of {args.reps}; metrics {'off' if args.no_metrics else 'on'}\n"
    )
    print(
        "| architecture | SAELens s / hookrun s | SAELens CPU s / hookrun CPU s "
        "| hookrun tokens/s | SAELens tokens/s | peak RSS hookrun / SAELens |"
    )
    print("|---|---|---|---|---|---|")

    def ratio(times: dict[str, list[float]]) -> float:
        pairs = zip(times["hookrun"], times["saelens"], strict=True)
        return statistics.median(t / o for o, t in pairs)

    for name in cases:
        ours, theirs = seconds[name]["hookrun"], seconds[name]["saelens"]
        print(
            f"| {name} | {ratio(seconds[name]):.2f}× | {ratio(cpu[name]):.2f}× | "
            f"{tokens / statistics.median(ours):,.0f} | "
            f"{tokens / statistics.median(theirs):,.0f} | "
            f"{rss[name]['hookrun'] / 2**20:.0f} / {rss[name]['saelens'] / 2**20:.0f} MiB |"
        )
    print(f"\nload average while measured: {os.getloadavg()}")


if __name__ == "__main__":
    main()
