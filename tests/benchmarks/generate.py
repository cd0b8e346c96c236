"""Generation with one steering vector against Hugging Face's `model.generate` without hooks,
two ways, each side by side with its repetitions interleaved:

- whole runs (the default): `python -m hookrun experiment=generate` with an `add {vector}` hook
  at a middle block, and a process that loads the same model and calls `model.generate` on
  the same prompts; each side net of its own start-up, marked inside the process (hookrun:
  from the start of its stream of batches — after composing, loading the model and data,
  probing and planning — to the run's return: file complete, pictures drawn, summary made;
  Hugging Face: from the model and prompts loaded to the last generate call's tokens). Wall
  and CPU seconds (time.process_time: every thread) of that span, and of each process whole
  (its rusage) for scale. On a machine shared with other work the start-up's own CPU time
  varies by seconds from one process to the next, more than the work: subtracting a
  separate start-up process drowned the figures. hookrun with the fluency pass
  (generate.fluency=true, the default) and without, with pictures and without, and with no
  hook at all (its tokens checked equal to model.generate's);
- the decoding loop alone (`--loop`): hookrun's loop (stages/generate/decode.py) under the
  hook, `model.generate` without hooks and nnsight's `generate` with the same intervention
  at every step (`for step in tracer.iter[...]`; the `bench` extra), tokens per second in
  one process. The three give the same tokens (checked here).

    python tests/benchmarks/generate.py [--reps 3] [--threads 1]          # whole runs
    python tests/benchmarks/generate.py --loop [--tokens 32] [--reps 3] [--device cpu|cuda]

Whole runs: a random-init Llama (4 layers, width 256, 8 heads of which 4 key-value) with the
shipped tiny_lm's tokenizer, 64 prompts (the shipped corpus's first rows cut to 8-24 tokens)
x 48 new tokens in batches of 16, greedy, no end token. The loop: the shipped tiny_lm (GPT-2,
2 layers, width 128) and the same Llama; prompts as above (rows of different lengths: both
sides left-pad); greedy, every row generating `--tokens` tokens (no end token stops a row).
Not part of the test run.
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
from typing import Any

import h5py
import numpy as np
import torch
import transformers

import hookrun
from hookrun.models.language import LanguageModel
from hookrun.runtime.hooks import Recorder, attach
from hookrun.runtime.hookspec import HookConfig, HookSpec
from hookrun.runtime.plan import compile_plan
from hookrun.runtime.selectors import SelectConfig
from hookrun.runtime.shape_probe import probe_shapes
from hookrun.runtime.sites import Site
from hookrun.stages.generate.decode import Sampling, decode

TINY = Path(hookrun.__file__).parent / "models" / "checkpoints" / "tiny_lm"
WHOLE_ROWS, WHOLE_TOKENS, WHOLE_BATCH = 64, 48, 16


def _llama(vocab: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _models() -> dict[str, tuple[torch.nn.Module, str]]:
    tiny = transformers.AutoModelForCausalLM.from_pretrained(TINY).eval()
    llama = _llama(tiny.config.vocab_size)
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


def _whole_folder(folder: Path) -> None:
    """The Llama and its tokenizer (save_pretrained), the prompts (.jsonl) and the vector."""
    tok = transformers.AutoTokenizer.from_pretrained(TINY)
    llama = _llama(len(tok))
    llama.generation_config.eos_token_id = None  # no end token: every row makes every token
    llama.config.eos_token_id = None
    llama.save_pretrained(folder / "llama")
    tok.save_pretrained(folder / "llama")
    right, lengths = _prompts(tok, WHOLE_ROWS)
    texts = [tok.decode(row[:n]) for row, n in zip(right.tolist(), lengths.tolist(), strict=True)]
    rows = "".join(json.dumps({"prompt": t}) + "\n" for t in texts)
    (folder / "prompts.jsonl").write_text(rows, encoding="utf-8")
    torch.manual_seed(1)
    np.save(folder / "v.npy", (2 * torch.randn(llama.config.hidden_size)).numpy())


def _mark(marks: Path, name: str) -> None:
    """Append (name, wall seconds, CPU seconds of this process so far) to `marks`."""
    with open(marks, "a", encoding="utf-8") as f:
        f.write(json.dumps([name, time.perf_counter(), time.process_time()]) + "\n")


def hugging_face_side(folder: Path, marks: Path) -> None:
    """The other side of a whole run: load the model, tokenize the prompts as hookrun's
    dataset=prompts does (no special tokens), left-pad batches and call model.generate
    without hooks; its tokens into tokens.npy. Marked once loaded and once generated."""
    tok = transformers.AutoTokenizer.from_pretrained(folder / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder / "llama").eval()
    lines = (folder / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines]
    tok.padding_side = "left"
    _mark(marks, "start")
    made = []
    with torch.inference_mode():
        for start in range(0, len(prompts), WHOLE_BATCH):
            batch = tok(
                prompts[start : start + WHOLE_BATCH],
                add_special_tokens=False,
                padding=True,
                return_tensors="pt",
            )
            out = model.generate(
                **batch, max_new_tokens=WHOLE_TOKENS, do_sample=False, pad_token_id=0
            )
            made.append(out[:, batch["input_ids"].shape[1] :].numpy())
    np.save(folder / "tokens.npy", np.concatenate(made))
    _mark(marks, "end")


def hookrun_side(marks: Path, overrides: list[str]) -> None:
    """`python -m hookrun OVERRIDES`, run as that command runs (its __main__, its exit),
    marked where its stream of batches starts (start-up done) and where the run returns."""
    import runpy

    from hookrun.pipeline import runner

    stream, execute = runner.stream, runner.execute

    def marked_stream(run: Any) -> int:
        _mark(marks, "start")
        return stream(run)

    def marked_execute(*args: Any, **kwargs: Any) -> Any:
        try:
            return execute(*args, **kwargs)
        finally:
            _mark(marks, "end")

    runner.stream, runner.execute = marked_stream, marked_execute
    sys.argv = ["hookrun", *overrides]
    runpy.run_module("hookrun", run_name="__main__", alter_sys=True)


def _timed(command: list[str], env: dict[str, str], marks: Path) -> tuple[float, ...]:
    """Wall and CPU seconds of one process's marked span, then of the process whole."""
    marks.unlink(missing_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([*command[:3], str(marks), *command[3:]], env=env, capture_output=True)
    if done.returncode:
        raise RuntimeError(f"{command}: {done.stderr.decode()[-2000:]}")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    seen = {name: (w, c) for name, w, c in map(json.loads, marks.read_text().splitlines())}
    (w0, c0), (w1, c1) = seen["start"], seen["end"]
    return w1 - w0, c1 - c0, wall, cpu


def whole_runs(reps: int, threads: int | None) -> None:
    """The table of whole runs, each side net of its own start-up (medians of `reps`)."""
    folder = Path(tempfile.mkdtemp())
    _whole_folder(folder)
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    steer = (
        "+hooks.steer={select: {name: model.layers.2}, at: output, action: add, "
        f"args: {{vector: {folder / 'v.npy'}}}}}"
    )
    base = [
        "experiment=generate",
        "model=hf",
        f"model.path={folder / 'llama'}",
        f"dataset.path={folder / 'prompts.jsonl'}",
        f"batch_size={WHOLE_BATCH}",
        f"generate.max_new_tokens={WHOLE_TOKENS}",
        "generate.stop_at_eos=false",
        "progress=false",
    ]

    def ours(name: str, *extra: str) -> list[str]:
        where = [f"hydra.run.dir={folder / 'runs' / name}", "sink.overwrite=true"]
        return [sys.executable, __file__, "--hookrun-side", *base, *extra, *where]

    runs = {
        "model.generate (no hook)": [sys.executable, __file__, "--hf-side", str(folder)],
        "hookrun, no hook": ours("plain", "render=false"),
        "hookrun + steering, generate.fluency=false": ours(
            "steer", steer, "generate.fluency=false", "render=false"
        ),
        "hookrun + steering (fluency scored: the default)": ours("fluency", steer, "render=false"),
        "hookrun + steering, fluency, render=true (generation.png)": ours("drawn", steer),
    }
    marks = folder / "marks.jsonl"
    times: dict[str, list[tuple[float, ...]]] = {k: [] for k in runs}
    for command in runs.values():  # warm-up: the page cache, the token cache's folders
        _timed(command, env, marks)
    for _ in range(reps):
        for key, command in runs.items():
            times[key].append(_timed(command, env, marks))
    with h5py.File(folder / "runs" / "plain" / "captures.h5") as f:
        ours_tokens = f["generation/tokens"][()]
    same = int((ours_tokens == np.load(folder / "tokens.npy")).all(axis=1).sum())

    def median(key: str, i: int) -> float:
        return statistics.median(t[i] for t in times[key])

    print(
        f"whole runs: {WHOLE_ROWS} prompts x {WHOLE_TOKENS} new tokens, batches of "
        f"{WHOLE_BATCH}, greedy; medians of {reps} repetitions, interleaved; "
        f"{platform.machine()}, {threads or torch.get_num_threads()} thread(s), torch "
        f"{torch.__version__}, transformers {transformers.__version__}, CPU; hookrun without "
        f"hooks gives model.generate's tokens on {same} of {WHOLE_ROWS} rows"
    )
    print(
        "| run | net of start-up: wall s | CPU s | model.generate / run: wall | CPU "
        "| whole process: wall s | CPU s |"
    )
    print("|---|---|---|---|---|---|---|")
    theirs = [median("model.generate (no hook)", i) for i in (0, 1)]
    for key in runs:
        w, c, whole_w, whole_c = (median(key, i) for i in range(4))
        print(
            f"| {key} | {w:.2f} | {c:.2f} | {theirs[0] / w:.2f}× | {theirs[1] / c:.2f}× "
            f"| {whole_w:.1f} | {whole_c:.1f} |"
        )
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loop", action="store_true", help="the decoding loop alone")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS each side")
    parser.add_argument("--device", default="cpu")
    if sys.argv[1:2] == ["--hookrun-side"]:  # the rest is hookrun's own command line
        hookrun_side(Path(sys.argv[2]), sys.argv[3:])
        return
    if sys.argv[1:2] == ["--hf-side"]:
        hugging_face_side(Path(sys.argv[3]), Path(sys.argv[2]))
        return
    args = parser.parse_args()
    if not args.loop:
        whole_runs(args.reps, args.threads)
        return
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
