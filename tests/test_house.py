"""The house rules, checked on every test run: one module owns the captures.h5 layout; no
import cycle between modules, nor between subpackages (a top-level module counting as one
of its own); the hook runtime and the pipeline name no stage; every hook goes through the
runtime's one registration (runtime/handles.py); nothing in the repository points outside
it. (Limits of 400 lines a module and 6 parameters a function were dropped: they were met by
moving code to stay under them and by tuples bundling parameters; size is a signal, not a
rule.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted((ROOT / "hookrun").rglob("*.py"))
# A captures.h5 path or a root attribute, spelled out.
LAYOUT = re.compile(
    r"""f?["'](captures|samples|derived|evaluate|sanity)/|\.attrs\[|\.attrs\.get\(|attrs\.update\("""
)


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_one_module_spells_the_captures_layout():
    owners = [p.relative_to(ROOT).as_posix() for p in MODULES if LAYOUT.search(p.read_text())]
    assert owners == ["hookrun/io/layout.py"]


def test_no_import_cycles():
    names = {_name(p): p for p in MODULES}
    graph: dict[str, set[str]] = {n: set() for n in names}
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module in names:
                targets = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                graph[name] |= {t for t in targets if t in names and t != name}
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        assert node not in stack, " -> ".join([*stack, node])
        if node in done:
            return
        for nxt in graph[node]:
            visit(nxt, [*stack, node])
        done.add(node)

    for name in graph:
        visit(name, [])


def _unit(module: str) -> str:
    """The subpackage (or top-level module) a hookrun module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(path: Path) -> list[str]:
    """Every hookrun module `path` imports, also inside functions, but not under
    TYPE_CHECKING (annotations only)."""
    tree = ast.parse(path.read_text())
    hidden = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in node.body
        for n in ast.walk(inner)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return [n for n in found if n.startswith("hookrun.")]


def test_no_import_cycle_between_subpackages():
    units = {p.name.removesuffix(".py") for p in (ROOT / "hookrun").iterdir()}
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        mine = _unit(_name(path))
        for imported in _imports(path):
            other = _unit(imported)
            if other != mine and other in units:
                graph.setdefault(mine, set()).add(other)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert [unit for unit in sorted(graph) if unit in reach(unit)] == []


def test_the_runtime_and_the_pipeline_name_no_stage():
    """A new capability is a stage in its own folder: the hook runtime and the run's
    orchestration import no stage and spell no stage's name (derive, evaluate, sanity,
    patching, induction, logit_lens)."""
    from hookrun.runtime.actions import ACTIONS
    from hookrun.stage import stages

    names = {stage.name for stage in stages()} | {s.node for s in stages() if s.node}
    assert names >= {"derive", "evaluate", "sanity", "patching", "induction", "logit_lens"}
    # A node that is also an action's name (the training stage's `sae:`, the splice's
    # `action: sae`) is the runtime's own word there: the stage's name is still checked.
    names -= {s.node for s in stages() if s.node in ACTIONS.choices()} - {s.name for s in stages()}
    # The attribution graphs' node `graph:` is also autograd's word ("the graph", "create_graph")
    # throughout the runtime: its stage's name, attribution_graph, is still checked.
    names.discard("graph")
    word = re.compile(r"\b(" + "|".join(sorted(names)) + r")\b", re.IGNORECASE)
    found = []
    for package in ("runtime", "pipeline"):
        for path in sorted((ROOT / "hookrun" / package).rglob("*.py")):
            text = path.read_text()
            stage_modules = [m for m in _imports(path) if m.split(".")[:2] == ["hookrun", "stages"]]
            found += [f"{path.name}: imports {m}" for m in stage_modules]
            found += [f"{path.name}: {m.group(0)!r}" for m in word.finditer(text)]
    assert found == []


def test_every_hook_is_registered_by_the_runtime():
    """One place puts hooks on modules (and takes every one off): runtime/handles.py."""
    calls = re.compile(r"\.register_forward(_pre)?_hook\b|\.register_full_backward")
    found = [
        path.relative_to(ROOT).as_posix() for path in MODULES if calls.search(path.read_text())
    ]
    assert found == ["hookrun/runtime/handles.py"]


def test_nothing_points_outside_the_repository():
    files = [*MODULES, *(ROOT / "conf").rglob("*.yaml"), *(ROOT / "tests").rglob("*.py")]
    files += [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / ".ci" / "run"]
    outside = "../" + "shared"  # split so this file does not name it
    assert [p.name for p in files if outside in p.read_text()] == []


def test_every_package_ships_in_the_wheel():
    """pyproject.toml lists hookrun's packages (conf/ is mapped into it, which setuptools'
    discovery cannot do): a new folder, such as a new stage's, must be listed there too, or
    the installed wheel lacks it (tests/packaging/ finds that too, in minutes)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "hookrun").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found - listed == set(), (
        f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
    )
