"""Train hookrun's `tiny_lm`: a 2-layer GPT-2 on the Python standard library's docstrings.

    python scripts/train_tiny_lm.py [--out hookrun/models/checkpoints/tiny_lm]

Everything comes from the machine, with no download: the corpus is the documentation strings
of a fixed, sorted list of standard-library modules (and their public sub-modules, classes,
functions and methods) of the running Python, which the Python Software Foundation License
lets us copy and redistribute (PSF License Agreement, section 2); the byte-level BPE tokenizer
is trained on it here with the `tokenizers` library. A few documents are held out and written
beside the model as `heldout.jsonl` (one {"text": ...} per line).

Training has two phases (`train`): docstring text alone, in which layer 0 forms a
previous-token head, then text beside rows of a random segment repeated, in which layer 1
forms an induction head on top of it (Olsson et al. 2022). At the end the script measures
the induction score of every head on held-out repeated sequences (another seed), for the
trained model and the same architecture with random weights, and records both in
training.json with the held-out loss.

Fixed seed, CPU, two threads: the same Python 3.11 and torch give the same corpus, tokenizer and
numbers. The folder gets the save_pretrained files (config.json, model.safetensors, tokenizer)
and `training.json` with the figures this run measured (losses, induction scores, times, sizes).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import pkgutil
import platform
import re
import time
import warnings
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parents[1] / "hookrun" / "models" / "checkpoints" / "tiny_lm"
EOS = "<|endoftext|>"
# Portable, non-deprecated standard-library modules (no optional C libraries, no platform
# modules, no modules with side effects on import); packages are walked with pkgutil.
MODULE_NAMES = (
    "abc argparse array ast asyncio base64 bdb binascii bisect builtins calendar cmath cmd "
    "code codecs codeop collections colorsys compileall concurrent configparser contextlib "
    "contextvars copy copyreg csv dataclasses datetime decimal difflib dis doctest email enum "
    "errno faulthandler filecmp fileinput fnmatch fractions ftplib functools gc getopt "
    "getpass gettext glob graphlib gzip hashlib heapq hmac html http imaplib importlib "
    "inspect io ipaddress itertools json keyword linecache locale logging mailbox marshal "
    "math mimetypes mmap modulefinder multiprocessing netrc numbers opcode operator optparse "
    "os pathlib pdb pickle pickletools pkgutil plistlib poplib pprint profile pstats pty "
    "py_compile pyclbr pydoc queue quopri random re reprlib rlcompleter runpy sched secrets "
    "select selectors shelve shlex shutil signal smtplib socket socketserver stat statistics "
    "string stringprep struct subprocess symtable sys sysconfig tabnanny tarfile tempfile "
    "textwrap threading time timeit token tokenize tomllib trace traceback tracemalloc tty "
    "types typing unicodedata unittest urllib uuid warnings wave weakref wsgiref xml xmlrpc "
    "zipapp zipfile zipimport zlib zoneinfo"
)
MODULES = sorted(MODULE_NAMES.split())
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")  # a repr with a memory address changes every run
HELDOUT_EVERY, HELDOUT_DOCS, HELDOUT_BYTES = 19, 200, 200_000


# ---------------------------------------------------------------- corpus


def stdlib_modules() -> list:
    """The modules of MODULES and their public sub-modules that import, sorted by name."""
    found = {}
    for name in MODULES:
        try:
            found[name] = module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this build lacks is skipped
            continue
        for info in pkgutil.walk_packages(getattr(module, "__path__", []), name + ".", lambda _: 0):
            if any(part.startswith(("_", "test")) for part in info.name.split(".")[1:]):
                continue
            try:
                found[info.name] = importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - e.g. asyncio.windows_events on Linux
                continue
    return [found[name] for name in sorted(found)]


def cleaned(doc: object) -> str | None:
    if not isinstance(doc, str):
        return None
    text = inspect.cleandoc(doc).strip()
    return None if len(text) < 40 or ADDRESS.search(text) else text


def heading(qualname: str, obj: object) -> str:
    """`name(params)`: parameter names only (defaults and annotations can differ per machine)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return qualname
    empty = inspect.Parameter.empty
    params = [p.replace(default=empty, annotation=empty) for p in signature.parameters.values()]
    return qualname + str(signature.replace(parameters=params, return_annotation=empty))


def module_docs(module) -> list[str]:
    """The module's docstring and those of its own public classes, functions and methods."""
    docs = [f"{module.__name__}\n\n{text}"] if (text := cleaned(module.__doc__)) else []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        qualname = f"{module.__name__}.{name}"
        if text := cleaned(obj.__doc__):
            docs.append(f"{heading(qualname, obj)}\n\n{text}")
        members = sorted(vars(obj).items()) if inspect.isclass(obj) else []
        for member_name, member in members:
            if member_name.startswith("_") and member_name != "__init__":
                continue
            if isinstance(member, (classmethod, staticmethod)):
                member = member.__func__
            if not (inspect.isroutine(member) or isinstance(member, property)):
                continue
            if text := cleaned(member.__doc__):
                title = f"{qualname}.{member_name}"
                title = title if isinstance(member, property) else heading(title, member)
                docs.append(f"{title}\n\n{text}")
    return docs


def build_corpus() -> tuple[list[str], list[str], int]:
    """(train documents, held-out documents, number of modules); duplicates dropped."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modules = stdlib_modules()
        seen, train, heldout = set(), [], []
        for module in modules:
            for doc in module_docs(module):
                body = doc.split("\n\n", 1)[1]
                if body in seen:
                    continue
                seen.add(body)
                digest = int(hashlib.sha256(doc.encode()).hexdigest(), 16)
                held = digest % HELDOUT_EVERY == 0 and len(heldout) < HELDOUT_DOCS
                if held and sum(len(d) + 16 for d in heldout) + len(doc) < HELDOUT_BYTES // 2:
                    heldout.append(doc)
                else:
                    train.append(doc)
    return train, heldout, len(modules)


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[str], vocab_size: int, context: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2's scheme) with EOS as its only special token (id 0)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        model_max_length=context,
    )


def token_stream(tokenizer: PreTrainedTokenizerFast, docs: list[str]) -> torch.Tensor:
    """Documents encoded and joined, each followed by EOS (the packing of dataset=text)."""
    ids = []
    for encoded in tokenizer.backend_tokenizer.encode_batch(docs):
        ids.extend(encoded.ids + [tokenizer.eos_token_id])
    return torch.tensor(ids, dtype=torch.int64)


# ---------------------------------------------------------------- rows


def text_rows(stream: torch.Tensor, n: int, context: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - context, (n,), generator=gen).tolist()
    return (
        torch.stack([stream[s : s + context] for s in starts]) if n else stream[:0].view(0, context)
    )


def repeated_rows(n: int, context: int, vocab: int, gen: torch.Generator) -> tuple:
    """(rows, masks): per row a random segment of 6-32 ids (EOS excluded) repeated to the end
    of the row; the mask (1 = in the loss) leaves out the first copy and the first token of
    the second, which nothing can predict."""
    rows, masks = torch.zeros(n, context, dtype=torch.int64), torch.zeros(n, context)
    for i in range(n):
        length = int(torch.randint(6, 33, (1,), generator=gen))
        segment = torch.randint(1, vocab, (length,), generator=gen)
        rows[i] = segment.repeat(context // length + 1)[:context]
        masks[i, length + 1 :] = 1
    return rows, masks


def row_losses(model, rows: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy per row (over the masked-in targets)."""
    logits = model(input_ids=rows).logits[:, :-1]
    losses = F.cross_entropy(logits.transpose(1, 2), rows[:, 1:], reduction="none")
    weights = torch.ones_like(losses) if masks is None else masks[:, 1:]
    return (losses * weights).sum(1) / weights.sum(1).clamp(min=1)


# ---------------------------------------------------------------- measurements


@torch.no_grad()
def attentions(model, rows: torch.Tensor) -> tuple:
    """Every layer's attention probabilities (eager attention for this call only)."""
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        return model(input_ids=rows, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(implementation)


def induction_scores(model, vocab: int, setting: tuple[int, int, bool], seed: int) -> list:
    """Per layer and head: mean attention from each token of the 2nd..last copy of a random
    segment to the token after its previous copy (Olsson et al. 2022), over 32 sequences."""
    length, repeats, bos = setting
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, vocab, (32, length), generator=gen).repeat(1, repeats)
    if bos:
        rows = torch.cat([torch.zeros(32, 1, dtype=torch.int64), rows], dim=1)
    queries = torch.arange(int(bos) + length, rows.shape[1])
    keys = queries - length + 1
    return [a[:, :, queries, keys].mean(dim=(0, 2)).tolist() for a in attentions(model, rows)]


def previous_token_score(model, stream: torch.Tensor, context: int) -> float:
    """The largest mean attention of a layer-0 head from each text token to the one before
    it (16 text rows, a fixed draw): how far the previous-token head has formed."""
    rows = text_rows(stream, 16, context, torch.Generator().manual_seed(3))
    first = attentions(model, rows)[0]
    queries = torch.arange(1, context)
    return max(float(first[:, h, queries, queries - 1].mean()) for h in range(first.shape[1]))


SETTINGS = ((25, 2, False), (50, 2, False), (20, 3, True), (40, 2, True))


def induction_report(model, vocab: int, seed: int) -> dict:
    model.eval()
    report = {}
    for setting in SETTINGS:
        scores = induction_scores(model, vocab, setting, seed)
        best = max(
            (s, layer, head) for layer, row in enumerate(scores) for head, s in enumerate(row)
        )
        key = f"length={setting[0]} repeats={setting[1]} bos={setting[2]}"
        report[key] = {
            "scores": scores,
            "best": {"score": best[0], "layer": best[1], "head": best[2]},
        }
    return report


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, context: int) -> float:
    """Mean next-token loss on the held-out documents packed into rows of `context` tokens."""
    model.eval()
    rows = stream[: len(stream) // context * context].view(-1, context)
    logits = torch.cat([model(input_ids=batch).logits[:, :-1] for batch in rows.split(32)])
    return float(F.cross_entropy(logits.transpose(1, 2), rows[:, 1:]))


# ---------------------------------------------------------------- training


def optimiser_for(model, lr: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def train(model, stream: torch.Tensor, args, log: list) -> float:
    """Two phases, each AdamW with a linear warm-up to a constant rate.

    Text (`text_steps` steps of `batch` docstring rows of `text_context` tokens, rate `lr`):
    a previous-token head forms in layer 0, because predicting text needs the token before.
    Repeats (`repeat_steps` steps, a fresh optimiser at `repeat_lr`): the same text rows plus
    `repeat_rows` rows of a random segment repeated (loss on the repeats only, weighing as
    much as the text); a layer-1 head then learns to attend to the token after the earlier
    copy of the current one through that previous-token head: an induction head (Olsson
    et al. 2022). Trained on repeats alone, or from the start, this model found other ways
    to copy (heads that average a few recent tokens) and no induction head. Returns the
    mean text loss of the last 50 steps."""
    vocab, text_tail, start = model.config.vocab_size, [], time.perf_counter()
    phases = (("text", args.text_steps, args.lr, args.warmup),)
    phases += (("repeats", args.repeat_steps, args.repeat_lr, args.repeat_warmup),)
    for phase, steps, lr, warmup in phases:
        optimiser = optimiser_for(model, lr)
        gen = torch.Generator().manual_seed(args.seed)  # each phase draws from the seed
        for step in range(1, steps + 1):
            for group in optimiser.param_groups:
                group["lr"] = lr * min(1.0, step / warmup)
            model.train()
            text = row_losses(model, text_rows(stream, args.batch, args.text_context, gen)).mean()
            loss, repeat = text, None
            if phase == "repeats":
                rows, masks = repeated_rows(args.repeat_rows, args.repeat_context, vocab, gen)
                repeat = row_losses(model, rows, masks).mean()
                loss = text + repeat
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimiser.step()
            text_tail = (text_tail + [float(text.detach())])[-50:]
            if step % args.log_every == 0 or step == steps:
                model.eval()
                entry = {"phase": phase, "step": step, "text_loss": float(text.detach())}
                entry["repeat_loss"] = None if repeat is None else float(repeat.detach())
                entry["previous_token"] = previous_token_score(model, stream, args.text_context)
                scores = induction_scores(model, vocab, SETTINGS[0], args.seed + 7)
                entry["induction"] = max(max(r) for r in scores)
                entry["seconds"] = round(time.perf_counter() - start, 1)
                log.append(entry)
                print(json.dumps(entry), flush=True)
    return sum(text_tail) / len(text_tail)


def make_model(args, vocab: int, seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=args.context,
        n_embd=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(config)


def _shown(value: object) -> object:
    """An argument as training.json records it: a path inside the repository relative to
    it (the file then says the same wherever the repository is)."""
    if not isinstance(value, Path):
        return value
    root = Path(__file__).resolve().parents[1]
    resolved = value.resolve()
    return str(resolved.relative_to(root)) if resolved.is_relative_to(root) else str(value)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-steps", type=int, default=3000)
    parser.add_argument("--repeat-steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=16, help="text rows per step")
    parser.add_argument("--text-context", type=int, default=128)
    parser.add_argument("--repeat-rows", type=int, default=16, help="repeated rows per step")
    parser.add_argument("--repeat-context", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="the model's positions")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--repeat-lr", type=float, default=1e-3)
    parser.add_argument("--repeat-warmup", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    began = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    train_docs, heldout_docs, n_modules = build_corpus()
    tokenizer = train_tokenizer(train_docs, args.vocab, args.context)
    stream = token_stream(tokenizer, train_docs)
    heldout_stream = token_stream(tokenizer, heldout_docs)
    print(
        f"{n_modules} modules, {len(train_docs)} train docs ({len(stream)} tokens), "
        f"{len(heldout_docs)} held-out docs ({len(heldout_stream)} tokens)",
        flush=True,
    )

    model, log = make_model(args, len(tokenizer), args.seed), []
    train_start = time.perf_counter()
    train_loss = train(model, stream, args, log)
    train_seconds = time.perf_counter() - train_start
    held = heldout_loss(model, heldout_stream, args.context)
    induction = induction_report(model, len(tokenizer), args.seed + 1000)
    random_init = induction_report(
        make_model(args, len(tokenizer), args.seed + 1), len(tokenizer), args.seed + 1000
    )

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    with open(args.out / "heldout.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in heldout_docs)
    best = {k: v["best"] for k, v in induction.items()}
    record = {
        "script": "scripts/train_tiny_lm.py",
        "rebuild": "python scripts/train_tiny_lm.py",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "arguments": {k: _shown(v) for k, v in vars(args).items()},
        "corpus": {
            "source": "docstrings of Python standard-library modules (PSF License)",
            "modules": n_modules,
            "train_documents": len(train_docs),
            "train_tokens": len(stream),
            "heldout_documents": len(heldout_docs),
            "heldout_tokens": len(heldout_stream),
        },
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_loss_last_50_steps": train_loss,
        "heldout_loss": held,
        "induction": induction,
        "random_init_induction": random_init,
        "log": log,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - began, 1),
        "bytes": {p.name: p.stat().st_size for p in sorted(args.out.iterdir()) if p.is_file()},
    }
    record["bytes"].pop("training.json", None)
    with open(args.out / "training.json", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"train loss (text, last 50 steps) {train_loss:.4f}; held-out loss {held:.4f}")
    for key, value in best.items():
        worst_random = max(random_init[key]["best"]["score"], 0.0)
        print(
            f"induction [{key}] best head L{value['layer']}H{value['head']} "
            f"{value['score']:.3f}; random init best {worst_random:.3f}"
        )
    print(
        f"training {train_seconds:.0f} s, total {time.perf_counter() - began:.0f} s; "
        f"{args.out}: {folder_bytes(args.out)} bytes"
    )


if __name__ == "__main__":
    main()
