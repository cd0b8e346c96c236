"""The site's generated references, a mkdocs-gen-files script.

reference/config.md, reference/cli.md, reference/api.md and reference/layout.md, each made
from the code or from the one place its text lives, so no page can drift from what hookrun
does.

tests/docs/test_reference.py builds the pages through the same functions.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The captures.h5 layout is written once, in this section of docs/architecture.md.
LAYOUT_SECTION = "## captures.h5 (the data contract)"
# The Python API: what a user calls, then what an extender subclasses.
API = {
    "Running and reading": ["hookrun.run", "hookrun.compose", "hookrun.open", "hookrun.Result"],
    "Files and data": ["hookrun.io.results.Results", "hookrun.io.activations.TokenBatches"],
    "Extending hookrun": [
        "hookrun.stage.Stage",
        "hookrun.stage.Plan",
        "hookrun.runtime.actions.Action",
        "hookrun.stages.derive.registry.Method",
    ],
}
# The entry points besides `python -m hookrun`, each module's `parser()`.
COMMANDS = ("hookrun.verify", "hookrun.render.__main__", "hookrun.view.__main__", "hookrun.choices")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _groups(conf: Path) -> dict[str, list[str]]:
    """Config group → its options: every folder of conf/ with YAML files in it."""
    folders = sorted(p for p in conf.rglob("*") if p.is_dir() and any(p.glob("*.yaml")))
    return {
        p.relative_to(conf).as_posix(): sorted(f.stem for f in p.glob("*.yaml")) for p in folders
    }


def config_page() -> str:
    """The configuration reference: the config groups, then every key of every node."""
    from hookrun.config.schema import conf_dir
    from hookrun.reference import config_keys

    lines = [
        "# Configuration reference",
        "",
        "Generated from the code (`hookrun.reference.config_keys`): each key as you type it",
        "on the command line (`python -m hookrun sink.dtype=float16`), its type, default,",
        "valid choices and meaning. `hooks.<name>` stands for a hook's own name.",
        "",
        "## Config groups",
        "",
        "A group picks one YAML file of `conf/<group>/`: `python -m hookrun model=tiny_lm`.",
        "",
        "| group | options |",
        "|---|---|",
    ]
    for group, options in _groups(conf_dir()).items():
        lines.append(f"| `{group}=` | {', '.join(f'`{o}`' for o in options)} |")
    section = None
    for key in config_keys():
        node = key.key.split(".")[0] if "." in key.key else "top level"
        if node != section:
            section = node
            lines += ["", f"## {node}", ""]
            lines += [
                "| key | type | default | choices | when | meaning |",
                "|---|---|---|---|---|---|",
            ]
        choices = ", ".join(f"`{c}`" for c in key.choices)
        lines.append(
            f"| `{key.key}` | {_cell(key.type)} | {_code(_cell(key.default))} | {choices} "
            f"| {_code(key.when)} | {_cell(key.meaning)} |"
        )
    return "\n".join(lines) + "\n"


def _help(parser: argparse.ArgumentParser) -> str:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=88)
    return parser.format_help()


def cli_page() -> str:
    """The CLI reference: `python -m hookrun` (Hydra), then each other entry point's help."""
    import importlib

    lines = [
        "# Command-line reference",
        "",
        "## python -m hookrun",
        "",
        "The run itself, a Hydra application: every argument is an override of the",
        "[configuration](config.md).",
        "",
        "```bash",
        "python -m hookrun experiment=guided_bp             # a config group's option",
        "python -m hookrun batch_size=8 sink.dtype=float16  # any key, in full",
        "python -m hookrun +hooks.out.select.name=layer4 +hooks.out.at=output \\",
        "    +hooks.out.action=capture                       # + adds a key the config lacks",
        "python -m hookrun -m seed=0,1,2                     # a sweep: one job per value",
        "python -m hookrun experiment=grad_cam --cfg job     # print the composed config",
        "python -m hookrun experiment=grad_cam dry_run=true  # the plan, no batch run",
        "python -m hookrun --help                            # the groups and their options",
        "```",
        "",
        "The keys most runs set: `experiment`, `model`, `dataset`, `device`, `batch_size`,",
        "`limit`, `sink.path`, `sink.dtype`, `resume` and `hydra.run.dir` (where the run's",
        "folder goes). Bad input ends the run with one line naming the key and exit status 2.",
    ]
    for name in COMMANDS:
        parser = importlib.import_module(name).parser()
        lines += ["", f"## {parser.prog}", "", "```text", _help(parser).rstrip(), "```"]
    return "\n".join(lines) + "\n"


def api_page() -> str:
    """The Python API reference: one mkdocstrings block per documented object."""
    lines = ["# Python API reference", ""]
    for title, names in API.items():
        lines += [f"## {title}", ""]
        for name in names:
            lines += [f"::: {name}", "    options:", "      heading_level: 3", ""]
    return "\n".join(lines)


def layout_section(text: str) -> str:
    """The captures.h5 section of docs/architecture.md, without its heading."""
    start = text.index(LAYOUT_SECTION) + len(LAYOUT_SECTION)
    end = text.find("\n## ", start)
    return text[start : end if end >= 0 else None].strip()


def layout_page() -> str:
    """The captures.h5 layout, from its one place in docs/architecture.md."""
    section = layout_section((ROOT / "docs" / "architecture.md").read_text())
    # Its links are relative to docs/, the page is one folder down.
    section = re.sub(r"\]\((?!https?:|#)", "](../", section)
    return f"# captures.h5 layout\n\n{section}\n"


PAGES = {
    "reference/config.md": config_page,
    "reference/cli.md": cli_page,
    "reference/api.md": api_page,
    "reference/layout.md": layout_page,
}


def write(pages: Iterable[str] = PAGES) -> None:
    """Write the pages into the site being built (mkdocs-gen-files' virtual files)."""
    import mkdocs_gen_files

    for path in pages:
        with mkdocs_gen_files.open(path, "w") as page:
            page.write(PAGES[path]())


if __name__ in ("__main__", "<run_path>"):  # mkdocs-gen-files runs it with runpy.run_path
    write()
