"""Generation with one steering vector (hookrun's decoding loop, stages/generate/decode.py,
under an `add {vector}` hook at a middle block's output) against Hugging Face's
`model.generate` without hooks and nnsight's `generate` with the same intervention at every
step (`for step in tracer.iter[...]`; the `bench` extra), tokens per second, side by side in
one process, repetitions interleaved. The three give the same tokens (checked here).

    python tests/benchmarks/generate.py [--tokens 32] [--reps 5] [--device cpu|cuda]

Models: the shipped tiny_lm (GPT-2, 2 layers, width 128) and a random-init Llama (4 layers,
width 256, 8 heads of which 4 key-value); prompts: the first rows of the shipped corpus, cut
to 8–24 tokens (rows of different lengths: both sides left-pad); greedy, every row generating
`--tokens` tokens (no end token stops a row). Not part of the test run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

import hookrun
from hookrun.models.language import LanguageModel
from hookrun.runtime.hooks import Recorder, attach
from hookrun.runtime.hookspec import HookConfig, HookSpec
from hookrun.runtime.plan import compile_plan
from hookrun.runtime.probe import probe_shapes
from hookrun.runtime.selectors import SelectConfig
from hookrun.runtime.sites import Site
from hookrun.stages.generate.decode import Sampling, decode

TINY = Path(hookrun.__file__).parent / "models" / "checkpoints" / "tiny_lm"


def _models() -> dict[str, tuple[torch.nn.Module, str]]:
    tiny = transformers.AutoModelForCausalLM.from_pretrained(TINY).eval()
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=tiny.config.vocab_size,
    )
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config).eval()
    return {
        "tiny_lm (GPT-2, 2 layers)": (tiny, "transformer.h.1"),
        "Llama, 4 layers": (llama, "model.layers.2"),
    }


def _prompts(tok, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    lines = [x for x in (TINY / "heldout.jsonl").read_text().splitlines() if x.strip()]
    ids = []
    for i in range(rows):
        text = lines[i % len(lines)]
        ids.append(tok(text)["input_ids"][: 8 + (i * 5) % 17])
    width = max(map(len, ids))
    right = torch.zeros(rows, width, dtype=torch.int64)
    for r, row in enumerate(ids):
        right[r, : len(row)] = torch.tensor(row)
    return right, torch.tensor([len(r) for r in ids])


def _left(right: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    width = right.shape[1]
    ids = torch.zeros_like(right)
    mask = torch.zeros_like(right)
    for r, n in enumerate(lengths.tolist()):
        ids[r, width - n :] = right[r, :n]
        mask[r, width - n :] = 1
    return ids, mask


def _module(root, path: str):
    for part in path.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


def _times(language, plan, prompts, tokens: int, steer) -> dict[str, list[float]]:
    """Seconds of each repetition, interleaved: hookrun's loop under `plan`, model.generate,
    nnsight's generate adding the vector (`steer`: block path, vector, repetitions)."""
    block, vector, reps = steer
    right, lengths = prompts
    left, mask = _left(right, lengths)
    ends = torch.tensor([], dtype=torch.int64, device=right.device)
    recorder = Recorder(0, torch.float32)
    made: dict[str, torch.Tensor] = {}

    def ours() -> None:
        with torch.inference_mode(), attach(plan, language, recorder):
            # Each step a forward pass of its own: the hooks' call counts start again.
            out = decode(
                language,
                (right, torch.arange(right.shape[1])[None] < lengths[:, None]),
                tokens,
                Sampling(),
                (ends, 0),
                None,
                lambda: recorder.begin(0),
            )
        made["hookrun"] = out.tokens

    def theirs() -> None:
        with torch.inference_mode():
            language.hf.generate(
                left,
                attention_mask=mask,
                max_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )

    runs = {"ours": ours, "theirs": theirs}
    try:
        import nnsight

        wrapped = nnsight.TransformersModel(language.hf, tokenizer=language.tokenizer)

        def sight() -> None:
            site = _module(wrapped, block)
            with torch.inference_mode():
                gen = dict(max_new_tokens=tokens, do_sample=False)
                with wrapped.generate(left, attention_mask=mask, pad_token_id=0, **gen) as tracer:
                    for _ in tracer.iter[0:tokens]:
                        site.output = site.output + vector.to(left.device)
                    result = nnsight.save(tracer.result)
            made["nnsight"] = result[:, left.shape[1] :]

        runs["nnsight"] = sight
    except ImportError:
        pass
    times: dict[str, list[float]] = {key: [] for key in runs}
    for fn in runs.values():
        fn()  # warm-up
    if "nnsight" in made:  # the same intervention: the same tokens
        assert torch.equal(made["hookrun"], made["nnsight"].to(made["hookrun"].device))
    for _ in range(reps):
        for key, fn in runs.items():
            start = time.perf_counter()
            fn()
            if right.device.type == "cuda":
                torch.cuda.synchronize()
            times[key].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    tok = transformers.AutoTokenizer.from_pretrained(TINY)
    print(
        f"generation, {args.tokens} new tokens a row, greedy, median of {args.reps}; "
        f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, device {device}"
    )
    print(
        "| model | rows | hookrun + steering tok/s | model.generate (no hook) tok/s | ratio "
        "| nnsight generate + steering tok/s | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    folder = Path(tempfile.mkdtemp())
    for name, (hf, block) in _models().items():
        # No end token: every row makes --tokens tokens on every side (min_new_tokens would
        # ban the end token instead, which hookrun's loop does not do).
        hf.generation_config.eos_token_id = None
        hf.to(device)
        language = LanguageModel(hf, tok)
        torch.manual_seed(1)
        vector = 2 * torch.randn(hf.config.hidden_size)
        np.save(folder / "v.npy", vector.numpy())
        steer = {"vector": str(folder / "v.npy")}
        spec = HookSpec.from_config(
            "steer",
            HookConfig(select=SelectConfig(name=block), at=Site.output, action="add", args=steer),
        )
        plan = compile_plan((spec,), language)
        sample = torch.zeros(3, 8, dtype=torch.int64)  # a token row: ids, mask, read marker
        sample[0], sample[1], sample[2, -1] = _prompts(tok, 1)[0][0, :8], 1, 1
        shapes, _, plan = probe_shapes(language, plan, sample.to(device))
        for hook, site, leaf in plan.sites(shapes):  # the vector read, as a run's prepare does
            hook.action.prepare(leaf.shape, site, f"hooks.{hook.name}", 1)
        for rows in (8, 32):
            right, lengths = _prompts(tok, rows)
            right, lengths = right.to(device), lengths.to(device)
            steer_args = (block, vector, args.reps)
            times = _times(language, plan, (right, lengths), args.tokens, steer_args)
            made = rows * args.tokens
            rate = {k: made / statistics.median(v) for k, v in times.items()}
            a, b, c = rate["ours"], rate["theirs"], rate.get("nnsight", float("nan"))
            print(
                f"| {name} | {rows} | {a:.0f} | {b:.0f} | {a / b:.2f}× | {c:.0f} | {a / c:.2f}× |"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
