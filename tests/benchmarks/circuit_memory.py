"""Peak memory of `experiment=circuit` (and of `lm_patching` with `patching.method=atp`)
against what any gradient method on the model needs: its weights plus one batch's
activations, measured as a process that loads the same model, runs one batch of the same
prompts forward with gradients and back (the logit difference), and ends. Each measurement
is its own process (peak resident memory, ru_maxrss), the imports the same in each, so the
differences are the work's. Random-init GPT-2 (6 layers, width 512, 16 heads: many heads,
where a circuit's senders multiply) with lm_models' tokenizer on lm_patching.py's prompts.

    python tests/benchmarks/circuit_memory.py [--rows 32] [--batch 16]

Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import hookrun

HERE = Path(__file__).resolve().parent
CHILD = """
import json, resource, sys
sys.path[:0] = [{lm!r}, {here!r}]
import torch, transformers, hookrun
torch.set_num_threads(2)
mode, folder, data, batch = {mode!r}, {folder!r}, {data!r}, {batch}
if mode == "imports":
    pass
elif mode == "forward":
    rows = [json.loads(line) for line in open(data)][:batch]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "right"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    got = tok([r["counterfactual"] for r in rows], return_tensors="pt", padding=True)
    read = got["attention_mask"].sum(1) - 1
    right = torch.tensor([tok(r["answer"])["input_ids"][0] for r in rows])
    wrong = torch.tensor([tok(r["counterfactual_answer"])["input_ids"][0] for r in rows])
    logits = model(**got).logits[torch.arange(len(rows)), read]
    every = torch.arange(len(rows))
    (logits[every, right] - logits[every, wrong]).sum().backward()
else:
    hookrun.run(
        [*mode.split(), "model=hf", f"model.path={{folder}}", f"dataset.path={{data}}",
         f"batch_size={{batch}}", "render=false", "progress=false"],
        run_dir=folder + "-" + str(abs(hash(mode))),
    )
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
RUNS = {
    "imports only": "imports",
    "weights + one batch forward and backward": "forward",
    "a hookrun run doing nothing (lm_patching, ~patching)": "experiment=lm_patching ~patching",
    "experiment=circuit (eap)": "experiment=circuit",
    "experiment=circuit (eap_ig, 8 steps)": "experiment=circuit circuit.method=eap_ig",
    "experiment=circuit + circuit.paths=[logits]": "experiment=circuit circuit.paths=[logits]",
    "lm_patching, method=atp, 4 site kinds": (
        "experiment=lm_patching patching.method=atp patching.sites=[resid,attn,mlp,heads]"
    ),
}


# glibc's malloc as it comes (its threshold for giving big blocks their own mapping rises
# to the largest block freed, so later blocks of that size stay in a heap that freed holes
# fragment: the resident peak is what the heap kept), and with the threshold fixed at
# 1 MiB (every block of a tensor's size mapped and returned when freed: the resident peak
# is the tensors the work held at once).
MALLOC = {
    "glibc malloc as it comes": {},
    "MALLOC_MMAP_THRESHOLD_=1048576": {"MALLOC_MMAP_THRESHOLD_": "1048576"},
}


def _model(folder: Path) -> int:
    import torch
    import transformers
    from lm_models import tokenizer

    tok = tokenizer()
    config = transformers.GPT2Config(
        n_layer=6,
        n_embd=512,
        n_head=16,
        n_positions=128,
        vocab_size=len(tok) + 4,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    sys.path[:0] = [str(HERE.parent / "lm"), str(HERE)]
    from lm_patching import _prompts

    work = Path(tempfile.mkdtemp(prefix="circuit_memory_"))
    weights = _model(work / "gpt2")
    _prompts(work / "p.jsonl", args.rows, False)
    print(
        f"hookrun {hookrun.__version__}: random GPT-2, 6 layers, width 512, 16 heads, "
        f"{weights / 2**20:.0f} MiB of weights; {args.rows} prompts, batch {args.batch}; "
        "peak resident memory above the imports"
    )
    for allocator, env in MALLOC.items():
        peaks = {}
        for name, mode in RUNS.items():
            code = CHILD.format(
                lm=str(HERE.parent / "lm"),
                here=str(HERE),
                mode=mode,
                folder=str(work / "gpt2"),
                data=str(work / "p.jsonl"),
                batch=args.batch,
            )
            out = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                env={**os.environ, **env},
            )
            if out.returncode:
                raise SystemExit(f"{name}: {out.stderr[-2000:]}")
            peaks[name] = float(out.stdout.split()[-1])
        base = peaks["imports only"]
        need = peaks["weights + one batch forward and backward"] - base
        print(f"{allocator} (imports: {base:.0f} MiB)")
        for name, peak in peaks.items():
            if name != "imports only":
                print(f"  {name:48s} {peak - base:7.0f} MiB  {(peak - base) / need:5.2f}x")
        print(json.dumps({k: round(v) for k, v in peaks.items()}))


if __name__ == "__main__":
    main()
