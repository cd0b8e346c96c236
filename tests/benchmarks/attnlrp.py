"""experiment=lrp lrp.composite=attnlrp against LXT 2.1's efficient AttnLRP: tokens/s, each
side in its own process, repetitions interleaved, medians; then the LRP pass alone on each
side in one process.

    python tests/benchmarks/attnlrp.py [--count 32] [--tokens 128] [--batch 8] [--reps 3]
        [--lxt-last] [--threads N]

The model: a GPT-2 with seeded random weights (6 layers, d_model 384, 6 heads, a vocabulary
of 8192, eager attention, float32, parameters frozen), saved with save_pretrained beside
the shipped tiny_lm's tokenizer and loaded by both sides from that folder before their
clocks start; `--count` rows of `--tokens` random token ids (no padding), the same on both
sides, in batches of `--batch`. The target is the lrp experiment's default, the predicted
token (the argmax of the last position's logits).

- hookrun (this venv): the whole `hookrun.run(["experiment=lrp",
  "derive.lrp.composite=attnlrp", ...], model=..., tokenizer=..., dataset={"input_ids":
  ...})`: its forward pass for the target, the AttnLRP pass, captures.h5.
- LXT (.venv-lxt, tests/reference_venvs.py; LXT patched in as tests/lm/lxt_script.py does
  for the equality test): per batch, a forward on the input embeddings requiring grad, the
  predicted logit at the last token backward, the relevance embeddings × grad written to
  h5py, (B, T, D) as hookrun stores it and summed over D per token. That is LXT's own
  quickstart: its logits at every position, from which the last is read. `--lxt-last`
  adds a third side, LXT with `logits_to_keep=1` (the last position's logits only, as
  hookrun's model=hf computes them), rotating first with the other two.

Both sides' relevance per token is compared (max abs difference) and their targets must be
the same. The pass alone: hookrun's `attnlrp_of` (the hooks on, one forward and one
backward of a batch) against LXT's forward and backward of the same batch, in one .venv-lxt
process, LXT's patches swapped in and out between the two (LXT patches classes for the
whole process: torch's LayerNorm and Dropout, GPT-2's MLP, the attention functions). The
goal (issue 45) is hookrun >= 1.0x LXT's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import torch

import hookrun
from hookrun.models.adapter import adapt
from hookrun.models.language import LanguageModel
from hookrun.runtime.step import BatchContext
from hookrun.runtime.targets import TargetKind, target_scores
from hookrun.stages.derive.lrp.attnlrp import attnlrp_sites
from hookrun.stages.derive.lrp.method import attnlrp_of

TESTS = Path(__file__).resolve().parents[1]
TOKENIZER = Path(hookrun.__file__).parent / "models" / "checkpoints" / "tiny_lm"


def _build(folder: Path, args: argparse.Namespace) -> None:
    """The random GPT-2, the tokenizer and the token ids, saved to `folder`."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    config = GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.tokens,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.heads,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    ids = torch.randint(
        0, args.vocab, (args.count, args.tokens), generator=torch.Generator().manual_seed(1)
    )
    np.save(folder / "ids.npy", ids.numpy())


def _load(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    for p in model.parameters():
        p.requires_grad_(False)  # LXT's quickstart does so too: no parameter gradients
    return model, AutoTokenizer.from_pretrained(folder)


def _hookrun(args: argparse.Namespace, folder: Path, out: Path) -> dict:
    model, tok = _load(folder)
    ids = np.load(folder / "ids.npy")
    overrides = ["experiment=lrp", "derive.lrp.composite=attnlrp", f"batch_size={args.batch}"]
    overrides += ["render=false", "progress=false"]
    wall, cpu = time.perf_counter(), time.process_time()
    result = hookrun.run(
        overrides, model=model, tokenizer=tok, dataset={"input_ids": ids}, run_dir=out
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    with h5py.File(result.path) as f:
        relevance = f["derived/lrp/input"][:].sum(-1)
        targets = f["samples/target"][:]
    return {"seconds": wall, "cpu": cpu, "relevance": relevance, "targets": targets}


def _lxt_relevance(
    model, ids: torch.Tensor, last: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """LXT's quickstart on one batch: (embeddings × grad (B, T, D), the predicted tokens);
    `last`: the logits of the last position only (`logits_to_keep=1`, as hookrun's)."""
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    keep = {"logits_to_keep": 1} if last else {}
    logits = model(inputs_embeds=embeds, use_cache=False, **keep).logits[:, -1]
    target = logits.argmax(-1)
    logits.gather(1, target[:, None]).sum().backward()
    return (embeds * embeds.grad).detach(), target


def _lxt(args: argparse.Namespace, folder: Path, out: Path) -> dict:
    sys.path.insert(0, str(TESTS / "lm"))
    from lxt_script import patch

    patch("gpt2")
    model, _ = _load(folder)
    ids = torch.from_numpy(np.load(folder / "ids.npy"))
    width = model.config.n_embd
    wall, cpu = time.perf_counter(), time.process_time()
    out.mkdir(parents=True, exist_ok=True)
    with h5py.File(out / "lxt.h5", "w") as f:
        stored = f.create_dataset("input", shape=(*ids.shape, width), dtype="float32")
        per_token = f.create_dataset("relevance", shape=tuple(ids.shape), dtype="float32")
        targets = f.create_dataset("target", shape=(len(ids),), dtype="int64")
        for first in range(0, len(ids), args.batch):
            batch = ids[first : first + args.batch]
            relevance, target = _lxt_relevance(model, batch, args.side == "lxt_last")
            rows = slice(first, first + len(relevance))
            stored[rows] = relevance.numpy()
            per_token[rows] = relevance.sum(-1).numpy()
            targets[rows] = target.numpy()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    with h5py.File(out / "lxt.h5") as f:
        relevance, targets = f["relevance"][:], f["target"][:]
    return {"seconds": wall, "cpu": cpu, "relevance": relevance, "targets": targets}


def _passes(args: argparse.Namespace, folder: Path) -> dict:
    """hookrun's AttnLRP pass and LXT's on the first batch, in this one process, interleaved:
    LXT's class patches swapped in for its turn and out for hookrun's."""
    sys.path.insert(0, str(TESTS / "lm"))
    from lxt_script import patch
    from transformers.models.gpt2 import modeling_gpt2 as modeling

    # Everything LXT 2.1's GPT-2 map and the shim replace (lxt/efficient/models/gpt2.py).
    slots = [
        (modeling.GPT2MLP, "forward"),
        (torch.nn.LayerNorm, "forward"),
        (torch.nn.Dropout, "forward"),
        (modeling, "eager_attention_forward"),
        (modeling, "ALL_ATTENTION_FUNCTIONS"),
    ]
    plain = [getattr(o, n) for o, n in slots]
    patch("gpt2")
    patched = [getattr(o, n) for o, n in slots]
    assert all(a is not b for a, b in zip(plain, patched, strict=True))

    def use(values: list) -> None:
        for (o, n), v in zip(slots, values, strict=True):
            setattr(o, n, v)

    use(plain)
    hf, tok = _load(folder)
    lm = LanguageModel(hf, tok)
    sites = attnlrp_sites(lm, "derive.lrp.composite")
    ids = torch.from_numpy(np.load(folder / "ids.npy"))[: args.batch]
    read = torch.zeros_like(ids)
    read[:, -1] = 1
    batch = SimpleNamespace(inputs=torch.stack([ids, torch.ones_like(ids), read], 1))
    with torch.no_grad():
        targets = lm(batch.inputs).argmax(-1)
    points, forward = adapt(lm).explained(batch)
    context = BatchContext(
        model=lm,
        batch=batch,
        targets=targets,
        score=lambda o, t: target_scores(o, t, TargetKind.predicted),
        generator=lambda name: torch.Generator(),
        points=points,
        forward=forward,
    )
    seconds: dict[str, list[float]] = {"hookrun": [], "lxt": []}
    got: dict[str, torch.Tensor] = {}
    for rep in range(args.reps):
        for side in ["hookrun", "lxt"] if rep % 2 == 0 else ["lxt", "hookrun"]:
            use(plain if side == "hookrun" else patched)
            start = time.perf_counter()
            if side == "hookrun":
                relevance, _ = attnlrp_of(context, sites)
            else:
                relevance, target = _lxt_relevance(hf, ids)
                assert torch.equal(target, targets)
            seconds[side].append(time.perf_counter() - start)
            got[side] = relevance.sum(-1)
    use(plain)
    diff = float((got["hookrun"] - got["lxt"]).abs().max())
    return {"seconds": seconds, "diff": diff, "scale": float(got["lxt"].abs().max())}


def _child(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = Path(args.folder)
    if args.side == "passes":
        print(json.dumps(_passes(args, folder)))
        return
    with tempfile.TemporaryDirectory() as work:
        run = _hookrun if args.side == "hookrun" else _lxt
        done = run(args, folder, Path(work) / "run")
    if args.save:
        np.save(Path(args.save) / f"{args.side}.npy", done["relevance"])
        np.save(Path(args.save) / f"{args.side}_targets.npy", done["targets"])
    print(json.dumps({"seconds": done["seconds"], "cpu": done["cpu"]}))


def _call(python: str, args: argparse.Namespace, side: str, folder: Path, save: str) -> dict:
    command = [python, __file__, "--side", side, "--folder", str(folder), "--save", save]
    command += ["--batch", str(args.batch), "--reps", str(args.reps)]
    command += ["--threads", str(args.threads)]
    # The script imports hookrun at its top (tests/test_benchmark_imports.py), and LXT's venv
    # has no hookrun installed: the repository's copy on the path.
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{side} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _load_average() -> str:
    return Path("/proc/loadavg").read_text().strip()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of each side (0: torch's default); 1 is steadier on a shared machine",
    )
    parser.add_argument(
        "--lxt-last",
        action="store_true",
        help="also LXT with the last position's logits only (logits_to_keep=1), as hookrun",
    )
    parser.add_argument(
        "--side", choices=["hookrun", "lxt", "lxt_last", "passes"], help=argparse.SUPPRESS
    )
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--save", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        _child(args)
        return
    sys.path.insert(0, str(TESTS))
    from reference_venvs import lxt_python

    pythons = {"hookrun": sys.executable, "lxt": str(lxt_python())}
    sides = ["hookrun", "lxt", "lxt_last"] if args.lxt_last else ["hookrun", "lxt"]
    pythons["lxt_last"] = pythons["lxt"]
    before = _load_average()
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work) / "model"
        _build(folder, args)
        timed: dict[str, list[dict]] = {side: [] for side in sides}
        for rep in range(args.reps):
            # Interleaved, the side that goes first turning: a load that drifts hits each.
            for side in sides[rep % len(sides) :] + sides[: rep % len(sides)]:
                save = work if rep == 0 else ""
                timed[side].append(_call(pythons[side], args, side, folder, save))
                t = timed[side][-1]
                print(f"rep {rep} {side}: {t['seconds']:.2f} s ({t['cpu']:.2f} s CPU)", flush=True)
        relevance = {side: np.load(Path(work) / f"{side}.npy") for side in timed}
        targets = {side: np.load(Path(work) / f"{side}_targets.npy") for side in timed}
        passes = _call(pythons["lxt"], args, "passes", folder, "")
    after = _load_average()
    tokens = args.count * args.tokens
    wall = {side: statistics.median(t["seconds"] for t in ts) for side, ts in timed.items()}
    cpu = {side: statistics.median(t["cpu"] for t in ts) for side, ts in timed.items()}
    rate = {side: tokens / s for side, s in wall.items()}
    diff = float(np.abs(relevance["hookrun"] - relevance["lxt"]).max())
    scale = float(np.abs(relevance["lxt"]).max())
    print(
        f"GPT-2 (random; {args.layers} layers, d_model {args.width}, {args.heads} heads, vocab "
        f"{args.vocab}), {args.count} rows x {args.tokens} tokens, batch {args.batch}, median "
        f"of {args.reps}, torch {torch.__version__}, {args.threads or torch.get_num_threads()} "
        "threads"
    )
    for side in timed:
        reps = ", ".join(f"{t['seconds']:.2f}" for t in timed[side])
        print(f"{side}: {rate[side]:.0f} tokens/s, {wall[side]:.2f} s wall ({reps}), "
              f"{cpu[side]:.2f} s CPU")  # fmt: skip
    print(f"ratio {rate['hookrun'] / rate['lxt']:.2f}x (goal >= 1.0x)")
    if args.lxt_last:
        print(f"ratio to LXT with logits_to_keep=1: {rate['hookrun'] / rate['lxt_last']:.2f}x")
        last = float(np.abs(relevance["lxt_last"] - relevance["lxt"]).max())
        print(f"LXT logits_to_keep=1 vs LXT: max abs diff {last:.3g}")
    print(f"relevance per token: max abs diff {diff:.3g} (largest |relevance| {scale:.3g}); "
          f"targets equal: {bool(np.array_equal(targets['hookrun'], targets['lxt']))}")  # fmt: skip
    p = passes["seconds"]
    median = {side: statistics.median(s) for side, s in p.items()}
    print(
        f"pass alone, one batch of {args.batch}, one process: hookrun {median['hookrun']:.3f} s "
        f"({', '.join(f'{s:.3f}' for s in p['hookrun'])}), LXT {median['lxt']:.3f} s "
        f"({', '.join(f'{s:.3f}' for s in p['lxt'])}), ratio "
        f"{median['lxt'] / median['hookrun']:.2f}x; max abs diff {passes['diff']:.3g} "
        f"(largest {passes['scale']:.3g})"
    )
    print(f"load before: {before}\nload after: {after}")


if __name__ == "__main__":
    main()
