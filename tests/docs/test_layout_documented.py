"""The captures.h5 table (docs/architecture.md, the site's reference/layout.md) names every
path a run writes: a few small real runs, vision and language, walked group by group and
dataset by dataset, each path matched against a row of the table.

A row's paths are the backticked spans of its path cell (and the `/…` spans its meaning
cell adds, but for the dimensions' row, which names examples there); each becomes a regex:
`<name>` a path component, `<k>` a number, `<layer>` a module name or
`<module>/<function>.<k>`, `<group>` a group at any depth, `<dimension>` a name
io/dimensions.py or a stage gives an axis, `{a,b}` either word, `[x]` optional, `…suffix`
the span before it with `suffix` added. A group is documented where a row's path lies in it.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import h5py
import pytest
from sae_folders import write_sae

import hookrun
from hookrun.io.dimensions import AXES, BATCH, ENTRY, FOLD, LAYOUT_AXES
from hookrun.io.layout import is_dimension

ROOT = Path(__file__).resolve().parents[2]
VISION = ["dataset=fake", "dataset.image_size=32", "limit=2", "render=false"]
VISION += ["model.weights=null", "progress=false"]  # mobilenet_v2, random: no download
LANGUAGE = ["limit=2", "render=false", "progress=false"]  # the shipped tiny_lm
RUNS = {
    # Linear only: the capture of every Conv2d writes the same paths, 50 times slower.
    "capture": ["experiment=capture", "hooks.capture.select.type=[Linear]", *VISION],
    "grad_cam": ["experiment=grad_cam", *VISION],
    "integrated_gradients": [
        "experiment=integrated_gradients",
        "derive.integrated_gradients.steps=2",
        *VISION,
    ],
    "lm_cache": ["experiment=lm_cache", *LANGUAGE],
    "circuit": ["experiment=circuit", *LANGUAGE],
    # A spliced SAE recording everything it can (its folder written by the fixture).
    "sae": [
        "experiment=sae",
        "hooks.sae.args.record=[latents,reconstruction,error,attribution]",
        "target.kind=predicted",
        *LANGUAGE,
    ],
}


def _section() -> str:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs/gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)  # type: ignore[union-attr]
    return gen.layout_section((ROOT / "docs" / "architecture.md").read_text())


def _dimension_names() -> str:
    """Every name an axis can have: the core names, the stages' (registered on import)."""
    import hookrun.stages  # noqa: F401  (each stage adds its axes' names)

    words = {w for rule in AXES.values() for w in re.split(r"[\s|]+", rule)}  # a|b: by rank
    words |= {w for names in LAYOUT_AXES.values() for w in names} | {BATCH, FOLD, ENTRY}
    plain = sorted(re.escape(w) for w in words if not w.startswith("{"))
    # dim_<k>: an axis nothing names; `_<size>` (then `_` more): a name taken at another size.
    return rf"(?:{'|'.join(plain)}|dim_\d+)(?:_\d+_*)?"


def _regex(template: str, dimension: str) -> str:
    out, i = [], 0
    while i < len(template):
        c = template[i]
        if c == "<":
            end = template.index(">", i)
            name = template[i + 1 : end]
            if name == "k":
                out.append(r"\d+")
            elif name.startswith("layer") or name == "module":
                out.append(r"[^/]+(?:/[^/]+\.\d+)?")  # a module, or a function site in one
            elif name == "dimension":
                out.append(dimension)
            elif name == "group":
                out.append(r"(?:[^/]+/)*[^/]+")  # any group, at any depth
            else:
                out.append(r"[^/]+?")
            i = end + 1
        elif c == "{":
            end = template.index("}", i)
            words = template[i + 1 : end].split(",")
            out.append("(?:" + "|".join(re.escape(w.strip()) for w in words) + ")")
            i = end + 1
        elif c == "[":
            out.append("(?:")
            i += 1
        elif c == "]":
            out.append(")?")
            i += 1
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def _components(template: str) -> list[str]:
    """A path template split at each `/` outside a placeholder, `{…}` or `[…]`."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(template):
        if c in "<{[":
            depth += 1
        elif c in ">}]":
            depth -= 1
        elif c == "/" and depth == 0:
            parts.append(template[start:i])
            start = i + 1
    return [*parts, template[start:]]


def documented(section: str) -> tuple[list[re.Pattern], list[re.Pattern], list[re.Pattern]]:
    """The table's paths as regexes: every other dataset's, the named dimensions', and
    the groups they lie in (each of a path's leading components)."""
    dimension = _dimension_names()
    paths: list[re.Pattern] = []
    dimensions: list[re.Pattern] = []
    groups: list[re.Pattern] = []
    for line in section.splitlines():
        cells = line.split(" | ")
        if not line.startswith("| `/"):
            continue
        into = dimensions if "<dimension>" in cells[0] else paths
        spans = re.findall(r"`([^`]+)`", cells[0])
        if into is paths:  # the dimensions' row names examples there, not more paths
            spans += [s for s in re.findall(r"`([^`]+)`", cells[-1]) if s.startswith("/")]
        previous = ""
        for span in spans:
            if span.startswith("…"):
                span = previous + span[1:]
            elif not span.startswith("/"):
                continue
            previous = span
            template = span.lstrip("/")
            into.append(re.compile(_regex(template, dimension)))
            # A dimension lies in a group some dataset of another row made.
            parts = [] if into is dimensions else _components(template)
            for k in range(1, len(parts)):
                groups.append(re.compile(_regex("/".join(parts[:k]), dimension)))
    return paths, dimensions, groups


def undocumented(path: Path, section: str) -> list[str]:
    """Every group and dataset of the file at `path` that no row of the table names."""
    paths, dimensions, groups = documented(section)
    found: list[str] = []

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Group):
            rows = groups
        elif is_dimension(obj):
            rows = dimensions
        else:
            rows = paths
        if not any(r.fullmatch(name) for r in rows):
            found.append(name)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("layout")
    write_sae(out / "sae_folder", 128, 64)  # tiny_lm's width
    runs = {**RUNS, "sae": [*RUNS["sae"], f"hooks.sae.args.path={out / 'sae_folder'}"]}
    return {name: hookrun.run(o, run_dir=out / name).path for name, o in runs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("experiment", list(RUNS))
def test_every_path_a_run_writes_is_in_the_layout_table(files, experiment):
    missing = undocumented(files[experiment], _section())
    assert not missing, f"experiment={experiment} writes paths the table lacks: {missing}"


@pytest.mark.slow
def test_a_path_whose_row_is_gone_is_found(files, tmp_path):
    """The check is no wider than the table: without the derived row, grad_cam's map and
    IG's completeness gap are undocumented; a made-up dataset is so with every row."""
    section = _section()
    row = next(line for line in section.splitlines() if line.startswith("| `/derived/<method>"))
    without = section.replace(row + "\n", "")
    assert "derived/grad_cam/features.18" in undocumented(files["grad_cam"], without)
    gap = "derived/integrated_gradients/input.completeness_gap"
    assert gap in undocumented(files["integrated_gradients"], without)
    assert gap not in undocumented(files["integrated_gradients"], section)
    copy = tmp_path / "captures.h5"
    shutil.copy(files["capture"], copy)
    with h5py.File(copy, "a") as f:
        f.create_dataset("samples/made_up", data=[0])
        f.create_group("made_up_group")
    assert {"samples/made_up", "made_up_group"} <= set(undocumented(copy, section))
