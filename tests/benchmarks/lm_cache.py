"""`experiment=lm_cache` (issue 19) beside a bare forward, hand-written hooks, TransformerLens
and nnsight: tokens/s side by side in one process, and peak RSS at 1× and 8× the tokens.

    python tests/benchmarks/lm_cache.py [--rows 1024] [--reps 3] [--device cuda] [--dir DIR]
    python tests/benchmarks/lm_cache.py --child VARIANT --rows N --dir DIR   (one run, for RSS)

Not part of the test run, and not in run.py: it needs transformers, TransformerLens and nnsight
(`pip install -e '.[bench]'`); the last two are comparisons only, never hookrun dependencies.

The workload: a GPT-2-architecture model saved with save_pretrained — the shipped
hookrun/models/checkpoints/tiny_lm/ where this checkout has it, else a seeded random GPT-2
(2 layers, d=192, 4 heads, vocab 4096, n_positions 128) with a byte-level BPE trained by the
`tokenizers` library on the corpus — and a corpus of Python standard-library docstrings (on
every machine), one document per line, packed into rows of 128 tokens. Every variant runs
the same model weights (its own copy, sdpa attention: transformers' default and what
experiment=lm_cache loads; TransformerLens switches its copy to eager itself) on `--rows` rows
in batches of 32 and writes every block's output for every token as float16 to a new .h5 file:

- hookrun: `hookrun.run([experiment=lm_cache, model=hf, model.path=…, dataset=text, …,
  limit=ROWS])` in this process, timed whole: config, model load from the folder,
  tokenizing the corpus, the file's open and close — everything but the interpreter's start
  and the imports (the others' model loading is outside their timings); once more with
  `render=false` (no residual_norms.png);
- bare: the HF model's forward alone (no hooks, nothing written), its logits at every
  position as the model computes them (hookrun's model=hf unembeds only each row's read
  position, the one its /model/output keeps);
- hand: `register_forward_hook` on every block, each batch written into h5py datasets;
- TransformerLens: `TransformerBridge.boot_transformers(path, hf_model=…)`,
  `run_with_cache(names_filter=blocks.*.hook_out)` per batch, written with h5py;
- nnsight: `TransformersModel(hf_model).trace(...)` saving every block's output per batch,
  written with h5py;
- hand, TransformerLens and nnsight once more as whole jobs, the way a script runs them:
  the model and tokenizer loaded from the folder and the corpus file tokenized inside the
  timing (and the bridge booted, the nnsight wrapper made), like hookrun's whole run.

Repetitions are interleaved (one warm-up each, each repetition starting one variant later);
the table gives each variant's best and median tokens/s, and hookrun's ratio to each variant
as the median over repetitions of the ratio within one repetition (on a shared machine the
neighbours' load drifts within minutes: a repetition's variants run close together). Peak
RSS: each variant once in its own process under /usr/bin/time (hookrun through `python -m
hookrun`), with ROWS and 8 × ROWS rows. torch runs on 2 threads (`--threads`).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "hookrun" / "models" / "checkpoints" / "tiny_lm"
CONTEXT, BATCH = 128, 32
ONE_BATCH = "hookrun, render=false, one batch"
DEVICE = torch.device("cpu")  # --device: where every variant runs (set once, in main)
EOS = "<|endoftext|>"
# Standard-library modules whose docstrings make the corpus (every Python has them).
MODULES = (
    "argparse asyncio collections concurrent.futures contextlib csv dataclasses datetime "
    "decimal difflib email enum fractions functools gettext heapq html http.client "
    "http.server inspect io ipaddress itertools json logging mailbox multiprocessing "
    "numbers os pathlib pickle pprint pydoc queue random re shutil smtplib socket "
    "sqlite3 statistics string subprocess tarfile tempfile textwrap threading time "
    "tkinter turtle unittest urllib.parse urllib.request uuid warnings xml.dom zipfile"
)


# -- the workload ----------------------------------------------------------------------------


@functools.cache
def documents() -> list[str]:
    """Docstrings of the standard library, one document per line (whitespace collapsed)."""
    import importlib

    docs: list[str] = []
    seen: set[str] = set()
    for name in MODULES.split():
        try:
            module = importlib.import_module(name)
        except ImportError:  # tkinter on a headless build
            continue
        objects = [module]
        for _, obj in sorted(vars(module).items()):
            objects.append(obj)
            if inspect.isclass(obj):
                objects += [v for _, v in sorted(vars(obj).items())]
        for obj in objects:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40 and doc not in seen:
                seen.add(doc)
                docs.append(" ".join(doc.split()))
    return docs


def build_model(folder: Path, docs: list[str]) -> Path:
    """The shipped tiny_lm where it exists; else a seeded random GPT-2 and a BPE tokenizer."""
    if (SHIPPED / "config.json").is_file():
        return SHIPPED
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    out = folder / "model"
    if (out / "config.json").is_file():
        return out
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(docs[:2000], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=EOS
    )
    eos = tokenizer.convert_tokens_to_ids(EOS)
    config = GPT2Config(
        vocab_size=4096,
        n_positions=CONTEXT,
        n_embd=192,
        n_layer=2,
        n_head=4,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, attn_implementation="sdpa"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model.eval().to(DEVICE), tokenizer


def corpus(folder: Path, model_dir: Path, docs: list[str], rows: int) -> tuple[Path, np.ndarray]:
    """A .txt of whole documents (cycled) holding at least `rows` + 1 packed rows, and the
    first `rows` rows packed here (documents joined by the end-of-text token)."""
    path, cached = folder / f"corpus{rows}.txt", folder / f"tokens{rows}.npy"
    if path.is_file() and cached.is_file():
        return path, np.load(cached)
    _, tokenizer = load_hf(model_dir)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    lines, ids = [], []
    need = (rows + 1) * CONTEXT
    for i in range(10**9):
        doc = docs[i % len(docs)]
        lines.append(doc)
        ids += tokenizer(doc)["input_ids"] + [eos]
        if len(ids) >= need:
            break
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokens = np.asarray(ids[: rows * CONTEXT], dtype=np.int64).reshape(rows, CONTEXT)
    np.save(cached, tokens)
    return path, tokens


def tokenize_file(path: Path, tokenizer, rows: int) -> np.ndarray:
    """What a hand-written script does before its loop: the corpus file's documents
    tokenized and packed into `rows` rows of CONTEXT tokens, joined by the end-of-text token."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    docs = path.read_text(encoding="utf-8").splitlines()
    ids = [i for encoded in tokenizer(docs)["input_ids"] for i in (*encoded, eos)]
    return np.asarray(ids[: rows * CONTEXT], dtype=np.int64).reshape(rows, CONTEXT)


def whole_job(variant: Callable, model_dir: Path, corpus_path: Path, rows: int, *extra):
    """`variant` as a script runs it whole: the model and tokenizer loaded from the folder,
    the corpus file tokenized, then (for TransformerLens and nnsight: after their own
    setup over the model) the loop; hookrun's whole run does the same."""

    def run() -> None:
        model, tokenizer = load_hf(model_dir)
        data = batches(tokenize_file(corpus_path, tokenizer, rows))
        needs_tokenizer = "tokenizer" in inspect.signature(variant).parameters
        setup = (model, tokenizer) if needs_tokenizer else (model,)
        if variant is lens:
            variant(*setup, model_dir, data, *extra)()
        else:
            variant(*setup, data, *extra)()

    return run


def batches(tokens: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.from_numpy(tokens).to(DEVICE)
    return [(b, torch.ones_like(b)) for b in ids.split(BATCH)]


# -- the variants: each call runs the corpus once and writes a new file ----------------------


def numbered(folder: Path, stem: str) -> Iterator[Path]:
    for i in range(10**9):
        yield folder / f"{stem}{i}.h5"


def block_datasets(f: h5py.File, model, rows: int) -> list[h5py.Dataset]:
    cfg = model.config
    shape = (rows, CONTEXT, cfg.n_embd)
    return [f.create_dataset(f"blocks/{i}", shape, "float16") for i in range(cfg.n_layer)]


def bare(model, data) -> Callable[[], None]:
    def run() -> None:
        with torch.inference_mode():
            for ids, mask in data:
                model(input_ids=ids, attention_mask=mask, use_cache=False)

    return run


def hand(model, data, folder: Path) -> Callable[[], None]:
    """The tutorial way, streaming: a forward hook per block writes each batch to h5py."""
    paths, rows = numbered(folder, "hand"), sum(len(ids) for ids, _ in data)

    def run() -> None:
        path, at = next(paths), [0]
        with h5py.File(path, "w") as f:
            sets = block_datasets(f, model, rows)

            def hook(i: int):
                def write(module, args, out) -> None:
                    out = out[0] if isinstance(out, tuple) else out
                    sets[i][at[0] : at[0] + len(out)] = out.to(torch.float16).cpu().numpy()

                return write

            handles = [b.register_forward_hook(hook(i)) for i, b in enumerate(model.transformer.h)]
            try:
                with torch.inference_mode():
                    for ids, mask in data:
                        model(input_ids=ids, attention_mask=mask, use_cache=False)
                        at[0] += len(ids)
            finally:
                for h in handles:
                    h.remove()
        path.unlink()

    return run


def lens(model, tokenizer, model_dir: Path, data, folder: Path, keep: bool = False):
    """TransformerLens 4: the bridge over its own copy of the HF model; `keep`: the caches
    stay in memory to the end, then one write (the notebook way)."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(
        str(model_dir), hf_model=model, tokenizer=tokenizer, device=str(DEVICE)
    )
    layers = model.config.n_layer
    names = [f"blocks.{i}.hook_out" for i in range(layers)]
    wanted = set(names)
    paths, rows = numbered(folder, "lens"), sum(len(ids) for ids, _ in data)

    def run() -> None:
        path, at, kept = next(paths), 0, []
        with h5py.File(path, "w") as f:
            sets = block_datasets(f, model, rows)
            with torch.inference_mode():
                for ids, mask in data:
                    _, cache = bridge.run_with_cache(
                        ids, attention_mask=mask, names_filter=lambda n: n in wanted
                    )
                    if keep:
                        kept.append(cache)
                        continue
                    for i, name in enumerate(names):
                        sets[i][at : at + len(ids)] = cache[name].to(torch.float16).cpu().numpy()
                    at += len(ids)
            for i, name in enumerate(names):
                if kept:
                    sets[i][:] = torch.cat([c[name] for c in kept]).to(torch.float16).cpu().numpy()
        path.unlink()

    return run


def sight(model, tokenizer, data, folder: Path) -> Callable[[], None]:
    """nnsight: a trace per batch saving every block's output, written with h5py."""
    import nnsight
    from nnsight import TransformersModel

    wrapped = TransformersModel(model, tokenizer=tokenizer)
    blocks = wrapped.transformer.h
    paths, rows = numbered(folder, "sight"), sum(len(ids) for ids, _ in data)

    def run() -> None:
        path, at = next(paths), 0
        with h5py.File(path, "w") as f:
            sets = block_datasets(f, model, rows)
            with torch.inference_mode():
                for ids, mask in data:
                    with wrapped.trace(input_ids=ids, attention_mask=mask, use_cache=False):
                        saved = nnsight.save([])
                        for block in blocks:
                            saved.append(block.output)
                    for i, out in enumerate(saved):
                        sets[i][at : at + len(ids)] = out.to(torch.float16).cpu().numpy()
                    at += len(ids)
        path.unlink()

    return run


def hookrun_args(model_dir: Path, corpus_path: Path, rows: int, extra=()) -> list[str]:
    return [
        "experiment=lm_cache",
        "model=hf",
        f"model.path={model_dir}",
        "dataset=text",
        f"dataset.path={corpus_path}",
        f"dataset.context={CONTEXT}",
        f"batch_size={BATCH}",
        f"limit={rows}",
        "progress=false",
        f"device.name={DEVICE}",
        *extra,
    ]


def hookrun_variant(model_dir: Path, corpus_path: Path, rows: int, folder: Path, extra=()):
    import hookrun

    args, dirs = hookrun_args(model_dir, corpus_path, rows, extra), numbered(folder, "hookrun")
    threads = torch.get_num_threads()
    last: dict = {}

    def run() -> None:
        where = next(dirs).with_suffix("")
        result = hookrun.run(args, run_dir=where)
        last.update(rows=result.rows, profile=result.profile, seconds=result.seconds)
        if "tokens" not in last:
            with h5py.File(result.path, "r") as f:
                last["tokens"] = f["samples/tokens"][:] if "samples/tokens" in f else None
                last["datasets"] = sorted(
                    n for n, o in _walk(f) if isinstance(o, h5py.Dataset) and "captures" in n
                )
        shutil.rmtree(where)
        torch.set_num_threads(threads)  # whatever the run set, the next variant gets the same

    run.last = last  # type: ignore[attr-defined]
    return run


def _walk(f: h5py.File) -> list:
    found: list = []
    f.visititems(lambda name, obj: found.append((name, obj)))
    return found


# -- peak RSS, each variant in its own process -----------------------------------------------

RSS_VARIANTS = ("bare", "hand", "hookrun", "lens", "lens_keep", "sight")


def child(variant: str, rows: int, folder: Path) -> None:
    """One variant, once, in this process (run under /usr/bin/time by `peak_rss`)."""
    model_dir = build_model(folder, [])
    _, tokens = corpus(folder, model_dir, [], rows)
    data = batches(tokens)
    model, tokenizer = load_hf(model_dir)
    out = folder / f"child-{variant}"
    out.mkdir(exist_ok=True)
    if variant == "bare":
        bare(model, data)()
    elif variant == "hand":
        hand(model, data, out)()
    elif variant in ("lens", "lens_keep"):
        lens(model, tokenizer, model_dir, data, out, keep=variant == "lens_keep")()
    elif variant == "sight":
        sight(model, tokenizer, data, out)()
    shutil.rmtree(out)


def peak_rss_mib(variant: str, rows: int, folder: Path, model_dir: Path) -> float:
    corpus_path, _ = corpus(folder, model_dir, documents(), rows)
    if variant == "hookrun":
        where = folder / f"rss-hookrun-{rows}"
        args = [
            sys.executable,
            "-m",
            "hookrun",
            *hookrun_args(model_dir, corpus_path, rows),
            f"hydra.run.dir={where}",
        ]
    else:
        where = None
        args = [sys.executable, __file__, "--child", variant, "--rows", str(rows)]
        args += ["--threads", str(torch.get_num_threads()), "--device", str(DEVICE)]
        args += ["--dir", str(folder)]
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "maxrss_kib=%M", *args], capture_output=True, text=True
    )
    if where is not None:
        shutil.rmtree(where, ignore_errors=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"{variant} with {rows} rows failed ({proc.returncode})")
    return int(re.findall(r"maxrss_kib=(\d+)", proc.stderr)[-1]) / 1024


# -- the table -------------------------------------------------------------------------------


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("torch", "transformers", "h5py", "transformer-lens", "nnsight"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} absent")
    return ", ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024, help="rows of 128 tokens (the 1×)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: every variant there")
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temp)")
    parser.add_argument("--out", type=Path, default=None, help="also write the section here")
    parser.add_argument(
        "--rss", default=",".join(RSS_VARIANTS), help="peak RSS of these ('' for none)"
    )
    parser.add_argument("--only", default="", help="comma-separated timed variants")
    parser.add_argument("--child", choices=RSS_VARIANTS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(args.threads)
    folder = args.dir or Path(tempfile.mkdtemp(prefix="hookrun-lm-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.child, args.rows, folder)
        return

    from loops import timed  # this folder (first on sys.path); the RSS children skip it

    docs = documents()
    model_dir = build_model(folder, docs)
    corpus_path, tokens = corpus(folder, model_dir, docs, args.rows)
    data = batches(tokens)
    tokens_total = tokens.size
    copies = [load_hf(model_dir) for _ in range(3)]  # the bridge and nnsight wrap their own
    (model, tokenizer), lens_copy, sight_copy = copies
    # The whole-job variants tokenize the corpus file themselves: the same rows.
    assert np.array_equal(tokenize_file(corpus_path, tokenizer, args.rows), tokens)
    work = folder / "timed"
    work.mkdir(exist_ok=True)
    variants = {
        "bare": bare(model, data),
        "hand": hand(model, data, work),
        "hookrun": hookrun_variant(model_dir, corpus_path, args.rows, work),
        # The whole run less its picture (residual_norms.png), which the others do not draw.
        "hookrun, render=false": hookrun_variant(
            model_dir, corpus_path, args.rows, work, ["render=false"]
        ),
        # One batch: the run's fixed cost (config, model load, tokenizing, the probe's
        # forward, the file), which the others' timings leave out.
        ONE_BATCH: hookrun_variant(model_dir, corpus_path, BATCH, work, ["render=false"]),
        "TransformerLens": lens(*lens_copy, model_dir, data, work),
        "nnsight": sight(*sight_copy, data, work),
        # Each as a script runs it whole (model load, tokenizing, its own setup, the loop),
        # beside hookrun's whole run.
        "hand, whole job": whole_job(hand, model_dir, corpus_path, args.rows, work),
        "TransformerLens, whole job": whole_job(lens, model_dir, corpus_path, args.rows, work),
        "nnsight, whole job": whole_job(sight, model_dir, corpus_path, args.rows, work),
    }
    if args.only:
        keep = set(args.only.split(","))
        variants = {k: v for k, v in variants.items() if k.split(",")[0] in keep}
    started = time.perf_counter()
    for run in variants.values():  # one warm-up each
        run()
    walls: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(args.reps):
        # Interleaved, each repetition starting one variant later: a neighbour's burst hits
        # every variant alike, and no variant always runs first.
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            wall, seconds = timed(variants[name], DEVICE)
            walls[name].append(wall)
            cpu[name].append(seconds)
    print(f"timed in {time.perf_counter() - started:.0f} s: {walls}, CPU {cpu}", flush=True)

    last = getattr(variants.get("hookrun"), "last", {})
    same = last.get("tokens") is not None and np.array_equal(last["tokens"], tokens)
    profile_run = hookrun_variant(model_dir, corpus_path, args.rows, work, ["profile=true"])
    if "hookrun" in variants:
        profile_run()
    rss = {}
    for variant in [v for v in args.rss.split(",") if v]:
        rss[variant] = tuple(
            peak_rss_mib(variant, n, folder, model_dir) for n in (args.rows, 8 * args.rows)
        )
        print(f"rss {variant}: {rss[variant]}", flush=True)

    lines = table(args, (walls, cpu), tokens_total, rss, model_dir)
    lines.append("")
    lines.append(
        f"hookrun's rows hold the same token ids as the others': {same} "
        f"({last.get('rows')} rows stored; captured datasets: {last.get('datasets')})."
    )
    prof = profile_run.last.get("profile")  # type: ignore[attr-defined]
    if prof:
        whole = profile_run.last["seconds"]  # type: ignore[attr-defined]
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(prof.items(), key=lambda kv: -kv[1]))
        lines.append(f"hookrun with profile=true: {whole:.2f} s in all; stages (s): {parts}.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        old = args.out.read_text() if args.out.is_file() else ""
        head = "## lm_cache (issue 19)"
        kept = old.split(head)[0].rstrip("\n")
        args.out.write_text((kept + "\n\n" if kept else "") + head + "\n\n" + text)


def _where() -> str:
    if DEVICE.type == "cuda":
        return torch.cuda.get_device_name(DEVICE)
    return "CPU"


def table(args, times, tokens: int, rss, model_dir: Path) -> list[str]:
    walls, cpu = times
    which = "the shipped tiny_lm" if model_dir == SHIPPED else "a random GPT-2"
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads, {_where()}; {versions()}"
    )
    lines = [
        f"{which} ({cfg.n_layer} layers, d={cfg.n_embd}, {cfg.n_head} heads, vocab "
        f"{cfg.vocab_size}), {args.rows} rows × {CONTEXT} tokens in batches of {BATCH}, every "
        f"block's output for every token → float16 HDF5; {args.reps} repetitions, interleaved; "
        f"{machine}.",
        "",
        "| variant | tokens/s: best (median) | hookrun / variant, throughput: median of the "
        "repetitions' ratios (best / best) | CPU seconds: variant / hookrun (medians) | goal |",
        "|---|---|---|---|---|",
    ]
    goals = {"hand": "≥ 1.0×", "TransformerLens": "≥ 1.5×", "nnsight": "≥ 1.5×"}
    goals |= {f"{name}, whole job": goal for name, goal in goals.items()}
    best = {name: tokens / min(w) for name, w in walls.items()}
    median = {name: tokens / statistics.median(w) for name, w in walls.items()}
    for name in [n for n in walls if n != ONE_BATCH]:
        ratio = work = "—"
        if "hookrun" in walls and name != "hookrun":
            work = f"{statistics.median(cpu[name]) / statistics.median(cpu['hookrun']):.2f}×"
            pairs = zip(walls[name], walls["hookrun"], strict=True)
            paired = statistics.median(w / h for w, h in pairs)
            ratio = f"{paired:.2f}× ({best['hookrun'] / best[name]:.2f}×)"
        cells = f"{best[name]:,.0f} ({median[name]:,.0f}) | {ratio} | {work}"
        lines.append(f"| {name} | {cells} | {goals.get(name, '—')} |")
    if ONE_BATCH in walls and "hookrun, render=false" in walls and "bare" in walls:
        # Per repetition: the whole run less the one-batch run = the other batches' cost.
        pairs = zip(walls["hookrun, render=false"], walls[ONE_BATCH], strict=True)
        rest = statistics.median(whole - one for whole, one in pairs)
        fixed = (
            statistics.median(walls[ONE_BATCH])
            - statistics.median(walls["bare"]) * BATCH / args.rows
        )
        lines += [
            "",
            f"hookrun's fixed cost (render=false, one batch of {BATCH} rows, less a bare forward "
            f"of one batch): {fixed:.2f} s; past it, hookrun (render=false) streams "
            f"{tokens * (1 - BATCH / args.rows) / rest:,.0f} tokens/s (median over repetitions "
            f"of the whole run less the one-batch run), bare forward {median['bare']:,.0f}.",
        ]
    if rss:
        lines += [
            "",
            f"| peak RSS (own process) | {args.rows} rows | {8 * args.rows} rows | 8× / 1× "
            "| goal |",
            "|---|---|---|---|---|",
        ]
        for name, (small, large) in rss.items():
            goal = "≤ 1.1×" if name == "hookrun" else "—"
            lines.append(
                f"| {name} | {small:.0f} MiB | {large:.0f} MiB | {large / small:.2f}× | {goal} |"
            )
    return lines


if __name__ == "__main__":
    main()
