"""Fingerprints of one small run of every experiment, to show that a change to hookrun's
inside changed no number: for each run, every dataset's dtype, shape and the SHA-256 of its
bytes, and every attribute of the file, its groups and its datasets, except those that say
when, where or with which versions it was made.

    python scripts/run_fingerprints.py before.json            # runs every experiment (~5 min)
    python scripts/run_fingerprints.py after.json
    python scripts/run_fingerprints.py --compare before.json after.json   # exit 1 on a change

Each run is `hookrun.run(overrides)` from Python, in a fresh folder under --work (default:
TMPDIR/hookrun-fingerprints, emptied first: the same paths before and after, since a `patch`
run's config names its source file), with pictures off (they are drawn from the file).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np

# Root attributes that name the machine or the software, not the numbers (`patch_sources`
# holds the SHA-256 of a whole source file, whose own root attributes name the git commit).
_VARYING = {
    "hookrun_version",
    "hookrun_git_commit",
    "torch_version",
    "torchvision_version",
    "h5py_version",
    "hostname",
    "patch_sources",
}
# Image runs: two of the shipped photos (the experiments' default model and data).
_IMAGES = ["limit=2", "batch_size=2"]
RUNS: dict[str, list[str]] = {
    **{
        name: [f"experiment={name}", *_IMAGES]
        for name in (
            "capture",
            "feature_maps",
            "grad_cam",
            "grad_cam_pp",
            "cam",
            "layer_cam",
            "guided_bp",
            "guided_grad_cam",
            "saliency",
            "grad_scale",
        )
    },
    "integrated_gradients": [
        "experiment=integrated_gradients",
        *_IMAGES,
        "++derive.integrated_gradients.steps=8",
    ],
    "smoothgrad": ["experiment=smoothgrad", *_IMAGES, "++derive.smoothgrad.samples=4"],
    "grad_cam_bfloat16": ["experiment=grad_cam", *_IMAGES, "sink.dtype=bfloat16"],
    "capture_float16_lzf": [
        "experiment=capture",
        *_IMAGES,
        "sink.dtype=float16",
        "sink.compression=lzf",
    ],
    "faithfulness": [
        "experiment=grad_cam",
        *_IMAGES,
        "evaluate=faithfulness",
        "evaluate.deletion.steps=4",
        "evaluate.insertion.steps=4",
        "evaluate.road.fractions=[0.2,0.6]",
    ],
    "sanity_check": [
        "experiment=sanity_check",
        "limit=1",
        "sanity.layers=[classifier.1,features.18]",
        "++sanity.derive.integrated_gradients.steps=4",
        "++sanity.derive.smoothgrad.samples=2",
    ],
    "resnet18_random": [
        "model=resnet18",
        "dataset=fake",
        "dataset.image_size=32",
        "dataset.size=3",
        "batch_size=2",
        "experiment=guided_grad_cam",
        "model.cam_layer=layer4",
    ],
    "seed_mlp": [
        "model=seed_mlp",
        "dataset=constant",
        "dataset.shape=[3]",
        "dataset.size=1",
        "++hooks.g.select.type=ReLU",
        "++hooks.g.at=grad_input",
        "++hooks.g.action=clamp",
        "++hooks.g.args.min=0.0",
        "++hooks.x.select.name=input",
        "++hooks.x.at=grad_output",
        "++hooks.x.action=capture",
    ],
    "lm_cache": ["experiment=lm_cache", "limit=4", "batch_size=2"],
    "lm_cache_bfloat16": ["experiment=lm_cache", "limit=4", "batch_size=2", "sink.dtype=bfloat16"],
    "lm_patching": ["experiment=lm_patching", "limit=2", "batch_size=2"],
    "lm_patching_heads": [
        "experiment=lm_patching",
        "limit=2",
        "batch_size=2",
        "patching.sites=[resid,heads]",
    ],
    "logit_lens": ["experiment=logit_lens", "limit=2", "batch_size=2"],
    "induction": ["experiment=induction", "dataset.size=4", "batch_size=2"],
    "circuit": ["experiment=circuit", "limit=4", "batch_size=2", "circuit.k=[0,3]"],
    "steering": ["experiment=steering", "limit=4", "batch_size=2", "generate.max_new_tokens=3"],
    "generate": ["experiment=generate", "limit=4", "batch_size=2", "generate.max_new_tokens=4"],
    "metrics": [
        "experiment=logit_lens",
        "limit=2",
        "batch_size=2",
        "metrics=lm",
        "metrics.names=[loss,kl]",
    ],
    "lm_gradients": [
        "experiment=integrated_gradients",
        "model=tiny_lm",
        "dataset=prompts",
        "dataset.path=${pkg_dir:hookrun}/models/checkpoints/patching_prompts.jsonl",
        "limit=2",
        "batch_size=2",
        "target.kind=logit_diff",
        "++derive.integrated_gradients.steps=4",
    ],
}
# Runs that read another run's file: (name, source run, overrides before the source's path).
DEPENDENT = {
    "patch": ("grad_cam", ["experiment=patch", *_IMAGES], "hooks.ablate.args.file"),
}


def fingerprint(path: Path) -> dict[str, Any]:
    """Every dataset's dtype, shape and bytes' SHA-256; every attribute but _VARYING's."""
    out: dict[str, Any] = {}

    def attrs(obj: Any) -> dict[str, str]:
        return {
            k: _text(v)
            for k, v in obj.attrs.items()
            if not (obj.name == "/" and k in _VARYING)
            and k not in ("REFERENCE_LIST", "DIMENSION_LIST")
        }

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            data = obj[()]
            digest = hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()
            out[name] = {"dtype": str(obj.dtype), "shape": list(obj.shape), "sha256": digest}
            out[name]["attrs"] = attrs(obj)
        else:
            out[name + "/"] = {"attrs": attrs(obj)}

    with h5py.File(path, "r") as f:
        out["/"] = {"attrs": attrs(f)}
        f.visititems(visit)
    return out


def _text(value: Any) -> str:
    """An attribute as text, the checkout's folder as `<checkout>` (the shipped files' paths,
    as `${pkg_dir:hookrun}` resolves them, name it: two checkouts compare equal)."""
    if isinstance(value, np.ndarray):
        text = repr(value.tolist())
    elif isinstance(value, bytes):
        text = value.decode(errors="replace")
    else:
        text = repr(value)
    return text.replace(_CHECKOUT, "<checkout>")


_CHECKOUT = str(Path(__file__).resolve().parents[1])


def take(out: Path, work: Path) -> None:
    import hookrun

    prints: dict[str, Any] = {}
    paths: dict[str, Path] = {}
    for name, overrides in RUNS.items():
        print(f"run {name}: {' '.join(overrides)}", flush=True)
        result = hookrun.run([*overrides, "render=false", "progress=false"], run_dir=work / name)
        paths[name] = result.path
        prints[name] = fingerprint(result.path)
    for name, (source, overrides, key) in DEPENDENT.items():
        args = [*overrides, f"{key}={paths[source]}", "render=false", "progress=false"]
        print(f"run {name}: {' '.join(args)}", flush=True)
        prints[name] = fingerprint(hookrun.run(args, run_dir=work / name).path)
    out.write_text(json.dumps(prints, indent=1, sort_keys=True))
    print(f"{len(prints)} runs fingerprinted into {out}")


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    differ = 0
    for run in sorted(a.keys() | b.keys()):
        if run not in a or run not in b:
            print(f"{run}: only in {'after' if run in b else 'before'}")
            differ += 1
            continue
        for key in sorted(a[run].keys() | b[run].keys()):
            if a[run].get(key) != b[run].get(key):
                print(f"{run} {key}:\n  before {a[run].get(key)}\n  after  {b[run].get(key)}")
                differ += 1
    print(f"{len(a)} runs compared: {'the same' if not differ else f'{differ} differences'}")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path)
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("give OUT.json, or --compare BEFORE AFTER")
    work = args.work or Path(tempfile.gettempdir()) / "hookrun-fingerprints"
    shutil.rmtree(work, ignore_errors=True)
    take(args.out, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
