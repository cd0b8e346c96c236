"""Activation patching: cells per second of `experiment=lm_patching` against a hand-written
loop of one forward pass per cell, on the same model and prompts (goal ≥ 2× through batching).

The model: a random GPT-2 (4 layers, width 128, 4 heads) with lm_models' byte-level tokenizer,
saved with save_pretrained; the prompts: `--rows` rows of 8 words from lm_models' sentences,
each counterfactual one word swapped for another of the same token count. A cell is one
(row, site kind, layer, position) patched value.

- hookrun: the whole run in-process (`hookrun.run`: data, model load, the run's own forward,
  the patching grids, HDF5 writes);
- hand: per batch of rows, one clean forward capturing the patched modules' outputs, one
  corrupted forward, then one forward of the batch per cell (layer, position) with a
  `register_forward_hook` that puts the clean value at that position — the loop one writes
  without batching the cells.

    python tests/benchmarks/lm_patching.py [--rows 32] [--batch 8] [--reps 1]
        [--sites resid,attn,mlp] [--swap-first]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lm"))  # lm_models
from lm_models import SENTENCES, tokenizer  # noqa: E402

import hookrun  # noqa: E402

CONFIG = {"model_type": "gpt2", "n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 128}
PATTERNS = {
    "resid": "transformer.h.{}",
    "attn": "transformer.h.{}.attn",
    "mlp": "transformer.h.{}.mlp",
}


def _save_model(folder: Path) -> None:
    import transformers

    tok = tokenizer()
    cfg = transformers.AutoConfig.for_model(**CONFIG, vocab_size=len(tok) + 4)
    cfg.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def _prompts(path: Path, rows: int, first: bool) -> list[dict]:
    """Rows of 8 words; the counterfactual swaps one word (the first with `first`: the
    cells before it, known without a pass, are then none) for one of equal token count."""
    tok = tokenizer()
    words = sorted({w for s in SENTENCES for w in s.split()})
    size = {w: len(tok(" " + w)["input_ids"]) for w in words}
    rng = random.Random(0)
    out = []
    while len(out) < rows:
        text = rng.choices(words, k=9)
        k = 0 if first else rng.randrange(1, 8)
        others = [w for w in words if w != text[k] and size[w] == size[text[k]]]
        if not others:
            continue
        swapped = [*text[:k], rng.choice(others), *text[k + 1 :]]
        prompt, counterfactual = " ".join(text[:8]), " ".join(swapped[:8])
        if len(tok(prompt)["input_ids"]) != len(tok(counterfactual)["input_ids"]):
            continue
        first_ids = [tok(" " + w)["input_ids"][0] for w in (text[k], swapped[k])]
        if first_ids[0] == first_ids[1]:  # one answer token: a row no patching can score
            continue
        out.append(
            {
                "prompt": prompt,
                "answer": " " + text[k],
                "counterfactual": counterfactual,
                "counterfactual_answer": " " + swapped[k],
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in out), encoding="utf-8")
    return out


def _hand(model, tok, rows: list[dict], shape: tuple[int, int], sites: list[str]) -> int:
    """The hand loop over every batch of `shape` = (rows, tokens) (padded to the tokens hookrun
    pads to: the same work); the number of real (row, position) cells it computed."""
    cells = 0
    named = dict(model.named_modules())
    layers = CONFIG["n_layer"]
    batch, length = shape
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        pad = {"return_tensors": "pt", "padding": "max_length", "max_length": length}
        clean = tok([r["prompt"] for r in chunk], **pad)
        corrupt = tok([r["counterfactual"] for r in chunk], **pad)
        read = clean["attention_mask"].sum(1) - 1
        rows_at = torch.arange(len(chunk))
        right = torch.tensor([tok(r["answer"])["input_ids"][0] for r in chunk])
        wrong = torch.tensor([tok(r["counterfactual_answer"])["input_ids"][0] for r in chunk])

        def diff(out, right=right, wrong=wrong, read=read, rows_at=rows_at):
            logits = out.logits[rows_at, read]
            return logits[rows_at, right] - logits[rows_at, wrong]

        with torch.inference_mode():
            seen: dict[str, torch.Tensor] = {}
            handles = [
                named[PATTERNS[s].format(i)].register_forward_hook(
                    lambda m, a, o, key=(s, i), seen=seen: seen.__setitem__(
                        key, o[0] if isinstance(o, tuple) else o
                    )
                )
                for s in sites
                for i in range(layers)
            ]
            diff(model(**clean, use_cache=False))
            for h in handles:
                h.remove()
            diff(model(**corrupt, use_cache=False))
            for s in sites:
                for i in range(layers):
                    for p in range(clean["input_ids"].shape[1]):

                        def hook(m, a, o, value=seen[(s, i)][:, p], p=p):
                            t = (o[0] if isinstance(o, tuple) else o).clone()
                            t[:, p] = value
                            return (t, *o[1:]) if isinstance(o, tuple) else t

                        h = named[PATTERNS[s].format(i)].register_forward_hook(hook)
                        diff(model(**corrupt, use_cache=False))
                        h.remove()
                        cells += int((clean["attention_mask"][:, p] == 1).sum())
    return cells


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--sites", default="resid,attn,mlp")
    parser.add_argument("--swap-first", action="store_true", help="swap the first word")
    args = parser.parse_args()
    sites = args.sites.split(",")
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="lm_patching_bench_"))
    _save_model(work / "lm")
    rows = _prompts(work / "prompts.jsonl", args.rows, args.swap_first)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(work / "lm").eval()
    tok = AutoTokenizer.from_pretrained(work / "lm")
    overrides = [
        "experiment=lm_patching",
        "model=hf",
        f"model.path={work / 'lm'}",
        f"dataset.path={work / 'prompts.jsonl'}",
        f"batch_size={args.batch}",
        f"patching.sites=[{','.join(sites)}]",
        "render=false",
        "progress=false",
    ]
    ours, hand, cells = [], [], 0
    for rep in range(args.reps):
        start = time.perf_counter()
        result = hookrun.run(overrides, run_dir=work / f"run{rep}")
        ours.append(time.perf_counter() - start)
        with h5py.File(result.path) as f:
            grid = f[f"patching/{sites[0]}"]  # (rows, layers, positions)
            real = f["samples/mask"][:] if "samples/mask" in f else np.ones(grid.shape[::2], bool)
            cells = int(real.sum()) * grid.shape[1] * len(sites)
            # Cells whose score is exactly 0 or 1: those resume.py knows without a pass
            # (a run cell lands on either bit for bit only by chance).
            scores = np.stack([f[f"patching/{s}"][:] for s in sites])
            known = int(((scores == 0) | (scores == 1)).sum())
        start = time.perf_counter()
        done = _hand(model, tok, rows, (args.batch, real.shape[1]), sites)
        hand.append(time.perf_counter() - start)
        assert done == cells, (done, cells)
    a, b = _median(ours), _median(hand)
    print(
        f"lm_patching: GPT-2 {CONFIG['n_layer']} layers × width {CONFIG['n_embd']}, {args.rows} "
        f"prompts of ≤ {real.shape[1]} tokens, sites {', '.join(sites)}, batch {args.batch}, "
        f"{cells} cells; median of {args.reps}; {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, cpu"
    )
    print(f"  cells known without a pass (score exactly 0 or 1): {known} of {cells}")
    print(f"  hookrun experiment (whole run, HDF5 included): {cells / a:9.0f} cells/s ({a:.2f} s)")
    print(f"  hand loop, one forward per cell:               {cells / b:9.0f} cells/s ({b:.2f} s)")
    print(f"  ratio hookrun / hand: {b / a:.2f}× (goal ≥ 2×)")


if __name__ == "__main__":
    main()
