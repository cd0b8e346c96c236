"""Training an SAE on activations streamed from the model: `python -m hookrun
experiment=train_sae` against SAELens 6.54's `LanguageModelSAETrainingRunner` with its
`ActivationsStore`, and hookrun's peak memory at 1×, 4× and 8× the tokens.

    python tests/benchmarks/train_sae_streamed.py [--steps 48] [--reps 5]
        [--memory-steps 12] [--multiples 1,4,8] [--only speed|memory|prefetch]

Not part of the test run. Both sides train conf/experiment/train_sae.yaml's dictionary (the
shipped tiny_lm, transformer.h.1's output = TransformerLens's blocks.1.hook_resid_post, topk
with its width, k, batch, lr, context and rows per forward) on the same pre-tokenised rows:
the rows hookrun trains on (its corpus packed into rows of dataset.context tokens, the
held-out rows left out), in order, repeated as often as the tokens need; sae.tokens =
`--steps` x sae.batch on both sides (SAELens's training_tokens is a whole number of batches
too, so both take the same steps). SAELens gets them as a HF `datasets.Dataset`
(`override_dataset`, is_dataset_tokenized) and the tiny_lm as a TransformerLens
HookedTransformer built offline (`override_model`; tests/training/saelens_runner_script.py).

The shuffle buffers are matched, not left at SAELens's defaults: SAELens 6.54's mixing
buffer holds n_batches_in_buffer x context_size tokens (its default 20 would be 1,280
tokens here, little more than one 1,024-token batch), so n_batches_in_buffer = sae.buffer /
dataset.context makes it hold hookrun's sae.buffer tokens (the yaml's 16,384), and
store_batch_size_prompts = hookrun's batch_size (32, also SAELens's default): each side then
runs model batches of the same rows and shuffles as many tokens together (SAELens's mixing
keeps half the buffer back at each refill, its activations_mixing_fraction default, so it
runs about half a buffer of forward passes more than it trains on; hookrun none).
Neither side prefetches (SAELens's prefetch_llm_batches default is off; hookrun's
sae.prefetch is auto, off on the CPU; `--only prefetch` times hookrun with it on and off),
nor compiles; SAELens logs nothing (no wandb, so no evals) and writes no checkpoints;
hookrun runs as the yaml says: a checkpoint every sae.checkpoint_tokens, curves every
sae.log_steps, and at the end the held-out scores and the curves' picture. Each run is a
process of its own (SAELens in its venv, tests/reference_venvs.py), repetitions interleaved
(the order alternating): the median over repetitions of each pair's ratio, and the ratio of
each side's best run (on a machine other work loads, the least disturbed run of each is the
nearer to what an idle one gives). Whole-process seconds and peak RSS (wait4's
ru_maxrss of the process, torch included) by this script; training-loop tokens/s as each
reports it: hookrun's summary line (its training loop: chunks made, steps, checkpoints),
SAELens's `SAETrainer.fit` timed (the buffer fills and steps).

The memory part runs the same hookrun command at `--multiples` x `--memory-steps` steps and
reports each peak RSS (the whole process's, and the training loop's: the command run in this
script's `--worker`, which samples its RSS every 20 ms from the loop's start to its end):
flat means the last over the first stays near 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from reference_venvs import saelens_python  # noqa: E402

SCRIPT = ROOT / "tests" / "training" / "saelens_runner_script.py"
HOOK = "blocks.1.hook_resid_post"  # transformer.h.1:output
SITE = "transformer.h.1:output"
SPEED = re.compile(r"training: ([\d,]+) tokens/s")


def _measured(cmd: list[str], env: dict | None = None) -> tuple[float, float, int, str]:
    """Run `cmd` to its end: wall seconds, CPU seconds (user + system, every thread), the
    process's peak RSS in bytes, its output."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-4000:]}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, text


def _setup(tmp: Path) -> dict:
    """The experiment's values, and its training rows written for SAELens."""
    import torch
    from safetensors.torch import save_file

    import hookrun
    from hookrun.pipeline.prepare import CallerObjects, model_and_data

    spec = hookrun.compose(["experiment=train_sae"])
    job = spec.stage("sae")
    config, (d,) = job.config, job.dictionaries
    assert d.architecture == "topk" and d.site.source == tuple(SITE.split(":")), (
        d.architecture,
        d.site,
    )
    _, rows, _ = model_and_data(spec, CallerObjects(), torch.device("cpu"), tmp / "setup")
    d_in = json.loads((Path(spec.model.path) / "config.json").read_text())["n_embd"]
    held = config.heldout.rows
    samples = torch.stack([rows[i][0] for i in range(held, len(rows))])
    assert bool(samples[:, 1].all()), "packed rows: every token real"
    save_file({"tokens": samples[:, 0].contiguous()}, tmp / "tokens.safetensors")
    return {
        "d_in": d_in,
        "width": d.resolved_width(d_in),
        "k": d.k,
        "lr": d.lr,
        "batch": config.batch,
        "buffer": config.buffer,
        "context": spec.dataset.context,
        "rows_per_forward": spec.batch_size,
        "rows": len(samples),
        "model_dir": str(spec.model.path),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _overrides(run_dir: Path, tokens: int) -> list[str]:
    return ["experiment=train_sae", f"sae.tokens={tokens}", f"hydra.run.dir={run_dir}"]


def _hookrun(run_dir: Path, tokens: int, sampled: bool = False, extra: tuple = ()) -> dict:
    """One `python -m hookrun` run; `sampled`: the same run in this script's `--worker`,
    which also samples its RSS over the training loop."""
    if sampled:
        cmd = [sys.executable, __file__, "--worker", str(run_dir / "rss.json")]
    else:
        cmd = [sys.executable, "-m", "hookrun"]
    cmd += [*_overrides(run_dir, tokens), *extra]
    seconds, cpu, peak, text = _measured(cmd, os.environ | {"PYTHONPATH": str(ROOT)})
    found = SPEED.findall(text)
    assert found, text[-2000:]
    loop = float(found[-1].replace(",", ""))
    got = {"seconds": seconds, "cpu": cpu, "peak": peak, "loop": loop}
    if sampled:
        got |= json.loads((run_dir / "rss.json").read_text())
    return got


# The phases the worker tells apart: (module, function) -> the phase it runs; outside
# them, "start" before the loop and "end" after it.
PHASES = {
    ("hookrun.training.job", "_Job.run"): "loop",
    ("hookrun.training.job", "_Job.save"): "save",
    ("hookrun.training.job", "_Job.checkpoint"): "checkpoint",
    ("hookrun.stages.train.scoring", "scorer"): "scores",
    ("hookrun.stages.train.draw", "render_curves"): "picture",
}


def _worker(out: str, overrides: list[str]) -> None:
    """`python -m hookrun OVERRIDES` in this process, its RSS read every 20 ms by a thread
    and kept as the maximum of each phase (PHASES, wrapped here; the scorer's phase is its
    returned function's calls), with the RSS at the training loop's start and end, into
    `out` at exit."""
    import atexit
    import functools
    import importlib
    import runpy
    import threading

    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    seen: dict = {"phases": {}}
    where = ["start"]

    def note() -> None:
        phase = where[-1]
        seen["phases"][phase] = max(seen["phases"].get(phase, 0), rss())

    def sample() -> None:
        while True:
            note()
            time.sleep(0.02)

    def within(phase: str, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            note()
            where.append(phase)
            if phase == "loop":
                seen["loop_start"] = rss()
            try:
                return fn(*args, **kwargs)
            finally:
                note()
                if phase == "loop":
                    seen["loop_end"] = rss()
                where.pop()
                if where == ["start"] and phase == "loop":
                    where[0] = "end"

        return wrapped

    for (module_name, name), phase in PHASES.items():
        module = importlib.import_module(module_name)
        if "." in name:  # a class's method
            cls, attr = name.split(".")
            owner = getattr(module, cls)
        else:
            owner, attr = module, name
        fn = getattr(owner, attr)
        if phase == "scores":  # a factory: its function is what runs the scoring

            def factory(*args, _fn=fn, **kwargs):
                score = _fn(*args, **kwargs)
                return score if score is None else within("scores", score)

            setattr(owner, attr, factory)
        else:
            setattr(owner, attr, within(phase, fn))
    threading.Thread(target=sample, daemon=True).start()
    atexit.register(
        lambda: Path(out).write_text(json.dumps(seen | {"loop_max": seen["phases"]["loop"]}))
    )
    sys.argv = ["hookrun", *overrides]
    runpy.run_module("hookrun", run_name="__main__", alter_sys=True)


def _saelens(tmp: Path, setup: dict, tokens: int, name: str) -> dict:
    spec = {
        "model_dir": setup["model_dir"],
        "tokens": str(tmp / "tokens.safetensors"),
        "hook": HOOK,
        "output": str(tmp / name),
        "sae": {"d_in": setup["d_in"], "d_sae": setup["width"], "k": setup["k"]},
        "runner": {
            "model_name": "tiny_lm",
            "dataset_path": "",
            "is_dataset_tokenized": True,
            "streaming": False,
            "context_size": setup["context"],
            "prepend_bos": False,  # hookrun's dataset.prepend_bos false; the rows are as given
            "n_batches_in_buffer": setup["buffer"] // setup["context"],
            "store_batch_size_prompts": setup["rows_per_forward"],
            "training_tokens": tokens,
            "train_batch_size_tokens": setup["batch"],
            "lr": setup["lr"],
            "lr_scheduler_name": "constant",
            "device": "cpu",
            "seed": 0,
            "n_checkpoints": 0,
            "checkpoint_path": None,
            "verbose": False,
        },
    }
    spec_file, out = tmp / f"{name}.json", tmp / f"{name}.out.json"
    spec_file.write_text(json.dumps(spec))
    command = [str(saelens_python()), str(SCRIPT), str(spec_file), str(out)]
    seconds, cpu, peak, _ = _measured(command)
    got = json.loads(out.read_text())
    assert got["samples"] == tokens, got
    loop = got["samples"] / got["fit_seconds"]
    return {"seconds": seconds, "cpu": cpu, "peak": peak, "loop": loop} | got


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def _speed(args: argparse.Namespace, tmp: Path, setup: dict) -> list[str]:
    tokens = args.steps * setup["batch"]
    runs: dict[str, list[dict]] = {"hookrun": [], "saelens": []}
    loads = []
    for rep in range(args.reps):
        order = ["hookrun", "saelens"] if rep % 2 == 0 else ["saelens", "hookrun"]
        for lib in order:
            loads.append(os.getloadavg()[0])
            if lib == "hookrun":
                got = _hookrun(tmp / f"hookrun_{rep}", tokens)
            else:
                got = _saelens(tmp, setup, tokens, f"saelens_{rep}")
            runs[lib].append(got)
            print(
                f"rep {rep} {lib}: {got['seconds']:.1f} s whole ({got['cpu']:.1f} CPU s), "
                f"{got['loop']:,.0f} tokens/s "
                f"in its loop, peak RSS {got['peak'] / 2**20:.0f} MiB (load {_load()})",
                flush=True,
            )
    ours, theirs = runs["hookrun"], runs["saelens"]

    def med(side: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in side)

    whole = statistics.median(
        t["seconds"] / o["seconds"] for o, t in zip(ours, theirs, strict=True)
    )
    cpu = statistics.median(t["cpu"] / o["cpu"] for o, t in zip(ours, theirs, strict=True))
    loop = statistics.median(o["loop"] / t["loop"] for o, t in zip(ours, theirs, strict=True))
    rss = med(ours, "peak") / med(theirs, "peak")
    best_loop = max(o["loop"] for o in ours) / max(t["loop"] for t in theirs)
    best_whole = min(t["seconds"] for t in theirs) / min(o["seconds"] for o in ours)
    lines = [
        f"{tokens:,} training tokens ({args.steps} steps of {setup['batch']}), topk width "
        f"{setup['width']} k {setup['k']}, lr {setup['lr']}, context {setup['context']}, "
        f"{setup['rows_per_forward']} rows per forward, buffer {setup['buffer']} tokens "
        f"(SAELens n_batches_in_buffer {setup['buffer'] // setup['context']}), "
        f"{setup['rows']} training rows; {platform.machine()}, {setup['threads']} threads, "
        f"torch {setup['torch']}, SAELens {theirs[0]['saelens']}, {args.reps} repetitions; "
        f"load average at the runs' starts {min(loads):.1f} to {max(loads):.1f}",
        "",
        "| comparison | ratio | goal | absolute (medians) |",
        "|---|---|---|---|",
        f"| training loop tokens/s: hookrun / SAELens runner | {loop:.2f}× | ≥ 1.0× | "
        f"{med(ours, 'loop'):,.0f} vs {med(theirs, 'loop'):,.0f} tokens/s |",
        f"| … best run of each | {best_loop:.2f}× | ≥ 1.0× | "
        f"{max(o['loop'] for o in ours):,.0f} vs {max(t['loop'] for t in theirs):,.0f} tokens/s |",
        f"| whole process: SAELens seconds / hookrun seconds | {whole:.2f}× | — | "
        f"{med(ours, 'seconds'):.1f} vs {med(theirs, 'seconds'):.1f} s |",
        f"| … best run of each | {best_whole:.2f}× | — | "
        f"{min(o['seconds'] for o in ours):.1f} vs {min(t['seconds'] for t in theirs):.1f} s |",
        f"| whole process, CPU seconds (user + system): SAELens / hookrun | {cpu:.2f}× | — | "
        f"{med(ours, 'cpu'):.1f} vs {med(theirs, 'cpu'):.1f} CPU s |",
        f"| peak RSS: hookrun / SAELens (whole process) | {rss:.2f}× | — | "
        f"{med(ours, 'peak') / 2**20:.0f} vs {med(theirs, 'peak') / 2**20:.0f} MiB |",
    ]
    return lines


def _prefetch(args: argparse.Namespace, tmp: Path, setup: dict) -> list[str]:
    """hookrun against itself: sae.prefetch=true (the next chunk's forward passes in a
    thread) against false, interleaved; the training loop's tokens/s and CPU seconds."""
    tokens = args.steps * setup["batch"]
    runs: dict[str, list[dict]] = {"true": [], "false": []}
    for rep in range(args.reps):
        for side in ("true", "false") if rep % 2 == 0 else ("false", "true"):
            got = _hookrun(tmp / f"prefetch_{side}_{rep}", tokens, extra=(f"sae.prefetch={side}",))
            runs[side].append(got)
            print(
                f"rep {rep} prefetch={side}: {got['seconds']:.1f} s whole ({got['cpu']:.1f} "
                f"CPU s), {got['loop']:,.0f} tokens/s in its loop (load {_load()})",
                flush=True,
            )
    on, off = runs["true"], runs["false"]
    loop = statistics.median(a["loop"] / b["loop"] for a, b in zip(on, off, strict=True))
    whole = statistics.median(b["seconds"] / a["seconds"] for a, b in zip(on, off, strict=True))
    return [
        f"prefetch: {tokens:,} tokens ({args.steps} steps), {args.reps} repetitions, "
        f"{setup['threads']} threads, {platform.machine()}",
        "",
        "| comparison | ratio | absolute (medians) |",
        "|---|---|---|",
        f"| training loop tokens/s: prefetch on / off | {loop:.2f}× | "
        f"{statistics.median(r['loop'] for r in on):,.0f} vs "
        f"{statistics.median(r['loop'] for r in off):,.0f} tokens/s |",
        f"| whole process: seconds off / on | {whole:.2f}× | "
        f"{statistics.median(r['seconds'] for r in on):.1f} vs "
        f"{statistics.median(r['seconds'] for r in off):.1f} s |",
    ]


def _memory(args: argparse.Namespace, tmp: Path, setup: dict) -> list[str]:
    multiples = [int(m) for m in args.multiples.split(",")]
    peaks = {}
    for m in multiples:
        tokens = m * args.memory_steps * setup["batch"]
        got = _hookrun(tmp / f"memory_{m}", tokens, sampled=True)
        peaks[m] = got
        phases = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in got["phases"].items())
        print(
            f"{m}x ({tokens:,} tokens): peak RSS {got['peak'] / 2**20:.1f} MiB; each phase's "
            f"peak: {phases} MiB; loop start {got['loop_start'] / 2**20:.1f}, end "
            f"{got['loop_end'] / 2**20:.1f} MiB; {got['seconds']:.1f} s (load {_load()})",
            flush=True,
        )
    first = peaks[multiples[0]]
    shown = ["start", "loop", "checkpoint", "save", "scores", "picture", "end"]
    lines = [
        "| sae.tokens | peak RSS (process) | / the first | training loop: RSS at its start → "
        "max → end | loop max / the first's | peak by phase: " + " / ".join(shown) + " |",
        "|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for m, got in peaks.items():
        tokens = m * args.memory_steps * setup["batch"]
        by_phase = " / ".join(
            f"{got['phases'][p] / mib:.0f}" if p in got["phases"] else "—" for p in shown
        )
        lines.append(
            f"| {tokens:,} ({m}×) | {got['peak'] / mib:.1f} MiB | "
            f"{got['peak'] / first['peak']:.3f}× | {got['loop_start'] / mib:.1f} → "
            f"{got['loop_max'] / mib:.1f} → {got['loop_end'] / mib:.1f} MiB | "
            f"{got['loop_max'] / first['loop_max']:.3f}× | {by_phase} MiB |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--memory-steps", type=int, default=12)
    parser.add_argument("--multiples", default="1,4,8")
    parser.add_argument("--only", choices=["speed", "memory", "prefetch"], default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker:
        _worker(args.worker, rest)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    tmp = Path(tempfile.mkdtemp(prefix="train_sae_streamed_"))
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    setup = _setup(tmp)
    out = []
    if args.only == "prefetch":
        out += ["", *_prefetch(args, tmp, setup)]
    if args.only in (None, "speed"):
        out += ["", *_speed(args, tmp, setup)]
    if args.only in (None, "memory"):
        out += ["", *_memory(args, tmp, setup)]
    print("\n".join(out))
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
