"""`action: sae` recording its latents (sparse) beside its floor: tokens/s side by side in one
process, the latents' bytes sparse against dense float32, and peak RSS at 1× and 8× the rows.

    python tests/benchmarks/sae.py [--rows 256] [--reps 3] [--rss-rows 64] [--d-sae 16384]

Not part of the test run. The workload: the shipped tiny_lm (GPT-2, 2 blocks, width 128) on
its held-out corpus (repeated where more rows are asked for than it packs), rows of 128
tokens in batches of 32, a standard SAE of `--d-sae` latents at transformer.h.1's output,
written here in SAELens's on-disk format (cfg.json + sae_weights.safetensors) with random
weights whose encoder bias is set from the model's own activations so that about `--l0`
latents fire per token (tests/sae_folders.py's bias fires a third of them).

- hookrun: `hookrun.run([model=tiny_lm, dataset=text, ..., ++hooks.sae.action=sae,
  ++hooks.sae.args.record=[latents], render=false])` in this process, timed whole: config,
  model load, tokenizing, the shape probe, the SAE loaded, every batch spliced, the latents
  sparsified and streamed to captures.h5, the file closed;
- floor: what a hand-written script does, timed whole as well (the model and tokenizer
  loaded, the corpus file tokenized and packed into the same rows): a plain forward hook at
  the same module computing relu((x − b_dec) W_enc + b_enc), the decode z W_dec + b_dec and
  the error term x − decode (added back), and each batch's latents held in memory as their
  non-zeros (flat indices and values, on the CPU), nothing written; the logits at each row's
  last position only, as hookrun's model=tiny_lm unembeds only the read position;
- floor from its first batch: the same loop with the model and rows made already;
- bare: the same forward without the SAE (how much the splice itself costs, for scale).

Repetitions are interleaved (each starting one variant later), after a warm-up of one batch
each (imports, the first forward); ratios are the median over repetitions of the ratio within
one repetition. One more run with profile=true gives hookrun's seconds per stage. Peak RSS:
`python -m hookrun` with the same overrides in its own process under /usr/bin/time, with
RSS_ROWS and 8 × RSS_ROWS rows. torch runs on 2 threads (`--threads`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "hookrun" / "models" / "checkpoints" / "tiny_lm"
LAYER, CONTEXT, BATCH = "transformer.h.1", 128, 32
LATENTS = f"sae/{LAYER}/output/latents"


# -- the workload ----------------------------------------------------------------------------


def load_tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(TINY), local_files_only=True, attn_implementation="sdpa"
    )
    return model.eval(), AutoTokenizer.from_pretrained(str(TINY), local_files_only=True)


def corpus(folder: Path, rows: int) -> Path:
    """A .jsonl of the held-out documents, repeated until it packs at least `rows` + 1 rows
    (155 rows a copy): repeated text runs at the speed of new text."""
    docs = (TINY / "heldout.jsonl").read_text(encoding="utf-8").splitlines()
    copies = math.ceil((rows + 1) / 150)
    path = folder / f"corpus{copies}.jsonl"
    if not path.is_file():
        path.write_text("\n".join(docs * copies) + "\n", encoding="utf-8")
    return path


def packed(path: Path, tokenizer, rows: int) -> torch.Tensor:
    """The corpus as dataset=text packs it: every document's ids and the end-of-text token,
    cut into rows of CONTEXT tokens (the script's own tokenizing, inside the floor's timing)."""
    docs = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    eos = tokenizer.eos_token_id
    ids = [i for encoded in tokenizer(docs)["input_ids"] for i in (*encoded, eos)]
    return torch.tensor(ids[: rows * CONTEXT], dtype=torch.long).view(rows, CONTEXT)


def block_output(model, ids: torch.Tensor) -> torch.Tensor:
    seen: dict[str, torch.Tensor] = {}

    def keep(module, args, output) -> None:
        seen["x"] = output[0] if isinstance(output, tuple) else output

    handle = model.get_submodule(LAYER).register_forward_hook(keep)
    try:
        with torch.inference_mode():
            model.transformer(input_ids=ids)
    finally:
        handle.remove()
    return seen["x"].reshape(-1, seen["x"].shape[-1])


def write_sae(folder: Path, x: torch.Tensor, d_sae: int, l0: int, seed: int = 0) -> dict:
    """A standard SAE of `d_sae` latents for activations like `x` (tokens, d_in), in SAELens's
    format: W_enc random unit columns, W_dec their transpose (SAELens's tied start), b_dec the
    activations' mean (a trained SAE's b_dec sits near it), and one encoder bias for all
    latents, the pre-activations' quantile that leaves `l0` of `d_sae` above zero on `x`."""
    d_in = x.shape[-1]
    generator = torch.Generator().manual_seed(seed)
    w_enc = torch.randn(d_in, d_sae, generator=generator)
    w_enc /= w_enc.norm(dim=0, keepdim=True)
    b_dec = x.mean(0)
    pre = ((x - b_dec) @ w_enc).reshape(-1).numpy()
    cut = np.partition(pre, len(pre) - len(pre) * l0 // d_sae)[len(pre) - len(pre) * l0 // d_sae]
    tensors = {
        "W_enc": w_enc.contiguous(),
        "b_enc": torch.full((d_sae,), -float(cut)),
        "W_dec": w_enc.T.contiguous(),
        "b_dec": b_dec.contiguous(),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "sae_weights.safetensors"))
    cfg = {
        "architecture": "standard",
        "d_in": d_in,
        "d_sae": d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "metadata": {"hook_name": "blocks.1.hook_resid_post", "sae_lens_version": "6.54.0"},
    }
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return tensors


# -- the variants: each call runs the rows once ----------------------------------------------


def splice_hook(t: dict, kept: list | None):
    """The hand-written splice: encode, decode, the error added back; the latents' non-zeros
    appended to `kept` (None: dropped)."""

    def hook(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        z = torch.relu((first - t["b_dec"]) @ t["W_enc"] + t["b_enc"])
        rebuilt = z @ t["W_dec"] + t["b_dec"]
        out = rebuilt + (first - rebuilt)
        if kept is not None:
            flat = z.reshape(-1)
            where = flat.nonzero().squeeze(1)
            kept.append((where, flat[where]))
        return (out, *output[1:]) if isinstance(output, tuple) else out

    return hook


def loop(model, ids: torch.Tensor, t: dict | None, kept: list | None) -> None:
    handle = None
    if t is not None:
        handle = model.get_submodule(LAYER).register_forward_hook(splice_hook(t, kept))
    try:
        with torch.inference_mode():
            for rows in ids.split(BATCH):
                hidden = model.transformer(input_ids=rows).last_hidden_state
                model.lm_head(hidden[:, -1])
    finally:
        if handle is not None:
            handle.remove()


def floor_whole(path: Path, rows: int, t: dict) -> Callable[[], None]:
    def run() -> None:
        model, tokenizer = load_tiny()
        loop(model, packed(path, tokenizer, rows), t, [])

    return run


def hookrun_args(path: Path, rows: int, sae: Path) -> list[str]:
    return [
        "model=tiny_lm",
        "model.attention=sdpa",
        "dataset=text",
        f"dataset.path={path}",
        f"dataset.context={CONTEXT}",
        "target.kind=none",
        f"batch_size={BATCH}",
        f"limit={rows}",
        "render=false",
        "progress=false",
        f"++hooks.sae.select.name={LAYER}",
        "++hooks.sae.at=output",
        "++hooks.sae.action=sae",
        f"++hooks.sae.args.path={sae}",
        "++hooks.sae.args.record=[latents]",
    ]


def by_mask(dense: torch.Tensor):
    """io/sparse.py's sparsify before commit 7bd6d1a: a mask made, summed for the counts and
    searched for the entries (the "before" of the table)."""
    from hookrun.io.sparse import SparseRows

    mask = dense != 0
    flat = mask.reshape(-1).nonzero().squeeze(1)
    values = dense.reshape(-1).index_select(0, flat)
    latent = (flat % dense.shape[-1]).to(torch.int32)
    return SparseRows(mask.sum(-1, dtype=torch.int32), values, latent)


def hookrun_variant(
    args: list[str], folder: Path, last: dict, before: bool = False
) -> Callable[[], None]:
    import hookrun
    import hookrun.runtime.hooks as hooks

    counter = iter(range(10**6))
    threads = torch.get_num_threads()

    def run() -> None:
        where = folder / f"hookrun{next(counter)}"
        now = hooks.sparsify
        hooks.sparsify = by_mask if before else now  # the Recorder's own name for it
        try:
            result = hookrun.run(args, run_dir=where)
        finally:
            hooks.sparsify = now
        if "bytes" not in last:
            last.update(file_facts(result.path))
        shutil.rmtree(where)
        torch.set_num_threads(threads)  # whatever the run set, the next variant gets the same

    return run


def file_facts(path: Path) -> dict:
    with h5py.File(path, "r") as f:
        group = f[LATENTS]
        parts = {name: group[name] for name in ("counts", "values", "latent")}
        counts = parts["counts"][()]
        return {
            "bytes": sum(d.id.get_storage_size() for d in parts.values()),
            "parts": {n: (d.shape, str(d.dtype)) for n, d in parts.items()},
            "shape": (counts.shape[0], counts.shape[1], int(group.attrs.get("shape", [0])[-1])),
            "l0": float(counts.mean()),
            "tokens": f["samples/tokens"][()],
            "file": path.stat().st_size,
        }


# -- peak RSS --------------------------------------------------------------------------------


def peak_rss_mib(args: list[str], folder: Path) -> float:
    where = folder / "rss"
    command = [sys.executable, "-m", "hookrun", *args, f"hydra.run.dir={where}"]
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "maxrss_kib=%M", *command],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    shutil.rmtree(where, ignore_errors=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"python -m hookrun failed ({proc.returncode})")
    return int(re.findall(r"maxrss_kib=(\d+)", proc.stderr)[-1]) / 1024


# -- the table -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="rows of 128 tokens, timed")
    parser.add_argument("--rss-rows", type=int, default=64, help="peak RSS at this and 8×")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--d-sae", type=int, default=16384)
    parser.add_argument("--l0", type=int, default=32, help="latents firing per token")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from loops import timed  # this folder (first on sys.path when run as a script)

    folder = Path(tempfile.mkdtemp(prefix="hookrun-sae-bench-"))
    path = corpus(folder, max(args.rows, 8 * args.rss_rows))
    model, tokenizer = load_tiny()
    ids = packed(path, tokenizer, args.rows)
    t = write_sae(folder / "sae", block_output(model, ids[:16]), args.d_sae, args.l0)
    overrides = hookrun_args(path, args.rows, folder / "sae")
    facts: dict = {}
    variants = {
        "hookrun": hookrun_variant(overrides, folder, facts),
        "hookrun, before 7bd6d1a": hookrun_variant(overrides, folder, {}, before=True),
        "hookrun, one batch": hookrun_variant(
            hookrun_args(path, BATCH, folder / "sae"), folder, {}
        ),
        "floor": floor_whole(path, args.rows, t),
        "floor, from its first batch": lambda: loop(model, ids, t, []),
        "bare": lambda: loop(model, ids, None, None),
    }
    # Warm-ups of one batch: the imports and each side's first forward out of the timings.
    variants["hookrun, one batch"]()
    loop(model, ids[:BATCH], t, [])
    floor_whole(path, BATCH, t)()
    walls: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(args.reps):
        # Interleaved, each repetition starting one variant later: a neighbour's burst hits
        # every variant alike, and no variant always runs first.
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            wall, seconds = timed(variants[name], torch.device("cpu"))
            walls[name].append(wall)
            cpu[name].append(seconds)
    print(f"walls {walls}\ncpu {cpu}", flush=True)
    same = np.array_equal(facts["tokens"], ids.numpy())
    import hookrun

    profiled = hookrun.run([*overrides, "profile=true"], run_dir=folder / "profiled")
    stages = ", ".join(
        f"{k} {v:.2f}" for k, v in sorted(profiled.profile.items(), key=lambda kv: -kv[1])
    )
    facts["profile"] = f"{profiled.seconds:.2f} s in all; stages (s, nested): {stages}"

    rss = (
        ()
        if args.no_rss
        else tuple(
            peak_rss_mib(hookrun_args(path, n, folder / "sae"), folder)
            for n in (args.rss_rows, 8 * args.rss_rows)
        )
    )
    print("\n".join(table(args, walls, cpu, facts, rss, same)))
    shutil.rmtree(folder)


def paired(walls: dict, a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(walls[a], walls[b], strict=True))


def table(args, walls: dict, cpu: dict, facts: dict, rss: tuple, same: bool) -> list[str]:
    import transformers

    tokens = args.rows * CONTEXT
    med = {name: statistics.median(w) for name, w in walls.items()}
    mcpu = {name: statistics.median(c) for name, c in cpu.items()}
    rate = {name: tokens / s for name, s in med.items()}
    # Past the fixed cost: the whole run less the one-batch run, per repetition.
    rest = statistics.median(
        w - o for w, o in zip(walls["hookrun"], walls["hookrun, one batch"], strict=True)
    )
    streaming = tokens * (1 - BATCH / args.rows) / rest
    fixed = med["hookrun, one batch"] - med["floor, from its first batch"] * BATCH / args.rows
    n, length, width = facts["shape"]
    dense = n * length * width * 4
    machine = (
        f"{platform.processor() or platform.machine()}, {args.threads} threads, torch "
        f"{torch.__version__}, transformers {transformers.__version__}, h5py {h5py.__version__}, "
        f"device cpu"
    )
    lines = [
        f"tiny_lm (GPT-2, 2 blocks, width 128), {args.rows} rows × {CONTEXT} tokens in batches of "
        f"{BATCH}, a standard SAE of {args.d_sae} latents at {LAYER}'s output (L0 "
        f"{facts['l0']:.1f} measured in the file), latents recorded sparse; median of "
        f"{args.reps}, interleaved; {machine}.",
        "",
        "| comparison | ratio | goal | absolute |",
        "|---|---|---|---|",
        f"| sae splice recording latents, whole run → captures.h5 / floor (hand-written hook, "
        f"latents' non-zeros held in memory), whole job: wall (CPU seconds) | "
        f"{paired(walls, 'hookrun', 'floor'):.2f}× ({mcpu['hookrun'] / mcpu['floor']:.2f}×) | "
        f"≤ 1.15× | {rate['hookrun']:,.0f} vs {rate['floor']:,.0f} tokens/s |",
        f"| … past hookrun's fixed cost ({fixed:.2f} s: the one-batch run less a batch of the "
        f"floor) / the floor from its first batch | "
        f"{rate['floor, from its first batch'] / streaming:.2f}× | — | {streaming:,.0f} vs "
        f"{rate['floor, from its first batch']:,.0f} tokens/s |",
        f"| … before this change (7bd6d1a: sparsify by a mask), the same whole run / floor | "
        f"{paired(walls, 'hookrun, before 7bd6d1a', 'floor'):.2f}× | ≤ 1.15× | "
        f"{rate['hookrun, before 7bd6d1a']:,.0f} tokens/s |",
        f"| … floor from its first batch / bare forward without the SAE (what the SAE costs) | "
        f"{paired(walls, 'floor, from its first batch', 'bare'):.2f}× | — | "
        f"{rate['bare']:,.0f} tokens/s bare |",
        f"| latents' bytes in captures.h5, dense float32 ({n}×{length}×{width}) / sparse "
        f"(counts int32, values float32, latent int32) | {dense / facts['bytes']:.0f}× | — | "
        f"{dense / 2**20:,.0f} MiB vs {facts['bytes'] / 2**20:.2f} MiB "
        f"({facts['bytes'] / n / length:.0f} bytes a token) |",
    ]
    if rss:
        small, large = rss
        lines.append(
            f"| peak RSS of `python -m hookrun` (the same run), {8 * args.rss_rows} rows / "
            f"{args.rss_rows} | {large / small:.2f}× | ≤ 1.1× | {small:.0f} → {large:.0f} MiB |"
        )
    lines += [
        "",
        f"hookrun's rows hold the floor's token ids: {same}; the file {facts['file'] / 2**20:.2f} "
        f"MiB in all; parts {facts['parts']}; medians (s) {med}, CPU (s) {mcpu}.",
        f"hookrun with profile=true: {facts['profile']}.",
    ]
    return lines


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
