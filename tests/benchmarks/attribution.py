"""Attribution patching against the exact grid: cells per second of `experiment=lm_patching`
with `patching.method=atp` (one corrupted forward and backward per batch, attribution.py)
and with `exact` (a patched pass per position, resumed from the corrupted cache), on the
same model and prompts, whole runs in-process; the run's fixed part (data, model, its own
forward, HDF5) is measured by a run with patching off and taken away from both. A cell is
one (row, site kind, layer, position) value; how far atp is from exact is printed too.

    python tests/benchmarks/attribution.py [--rows 32] [--batch 8] [--reps 3]

Models: the shipped tiny_lm (GPT-2, 2 layers, width 128) on its shipped patching prompts
(repeated to --rows), and a random-init Llama (4 layers, width 256, 8 heads of which 4
key-value) with lm_models' tokenizer on lm_patching.py's generated prompts. Not part of the
test run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lm"))  # lm_models
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_models import tokenizer  # noqa: E402
from lm_patching import _prompts  # noqa: E402

import hookrun  # noqa: E402

CHECKPOINTS = Path(hookrun.__file__).parent / "models" / "checkpoints"
SITES = ["resid", "attn", "mlp"]


def _llama(folder: Path) -> None:
    import transformers

    tok = tokenizer()
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=len(tok) + 4,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def _setups(work: Path, rows: int) -> dict[str, list[str]]:
    shipped = (CHECKPOINTS / "patching_prompts.jsonl").read_text().splitlines()
    tiny_rows = work / "tiny.jsonl"
    tiny_rows.write_text("\n".join((shipped * (rows // len(shipped) + 1))[:rows]) + "\n")
    _llama(work / "llama")
    _prompts(work / "llama.jsonl", rows, False)
    return {
        "tiny_lm (GPT-2, 2 layers)": [f"dataset.path={tiny_rows}"],
        "Llama, 4 layers": [
            "model=hf",
            f"model.path={work / 'llama'}",
            f"dataset.path={work / 'llama.jsonl'}",
        ],
    }


def _run(base: list[str], extra: list[str], out: Path) -> tuple[float, Path]:
    start = time.perf_counter()
    result = hookrun.run([*base, *extra], run_dir=out)
    return time.perf_counter() - start, result.path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="attribution_bench_"))
    for number, (name, model) in enumerate(_setups(work, args.rows).items()):
        base = [
            "experiment=lm_patching",
            *model,
            f"batch_size={args.batch}",
            f"patching.sites=[{','.join(SITES)}]",
            "render=false",
            "progress=false",
        ]
        runs = {"off": ["~patching"], "exact": [], "atp": ["patching.method=atp"]}
        times: dict[str, list[float]] = {k: [] for k in runs}
        paths: dict[str, Path] = {}
        for rep in range(args.reps):  # interleaved: the machine's drift hits all three
            for key, extra in runs.items():
                seconds, paths[key] = _run(base, extra, work / f"{number}-{key}{rep}")
                times[key].append(seconds)
        with h5py.File(paths["exact"]) as f, h5py.File(paths["atp"]) as g:
            exact = np.stack([f[f"patching/{s}"][()] for s in SITES])
            atp = np.stack([g[f"patching/{s}_atp"][()] for s in SITES])
        cells = int(np.isfinite(exact).sum())
        both = np.isfinite(exact) & np.isfinite(atp)
        fixed = statistics.median(times["off"])
        work_exact = statistics.median(times["exact"]) - fixed
        work_atp = statistics.median(times["atp"]) - fixed
        print(
            f"{name}: {args.rows} prompts, sites {', '.join(SITES)}, batch {args.batch}, "
            f"{cells} cells; medians of {args.reps}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, cpu"
        )
        print(f"  run with patching off (fixed part): {fixed:.2f} s")
        print(f"  exact: {cells / work_exact:10.0f} cells/s ({work_exact:.2f} s of patching)")
        print(f"  atp:   {cells / work_atp:10.0f} cells/s ({work_atp:.2f} s of patching)")
        print(
            f"  atp / exact: {work_exact / work_atp:.1f}x; Pearson with exact "
            f"{np.corrcoef(exact[both], atp[both])[0, 1]:.3f}"
        )


if __name__ == "__main__":
    main()
