"""The benchmark scripts (tests/benchmarks/, run by hand, not collected) still name what
hookrun has: a module moved or a name renamed inside hookrun fails here, not the next time
someone measures. Imports are resolved without running the scripts (they need the bench
extras and minutes)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parent / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_hookrun_name_a_benchmark_imports_exists(script):
    tree = ast.parse(script.read_text(encoding="utf-8"))
    found = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hookrun"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                found += 1
                assert hasattr(module, alias.name) or importlib.util.find_spec(
                    f"{node.module}.{alias.name}"
                ), f"{script.name}: from {node.module} import {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hookrun"):
                    found += 1
                    importlib.import_module(alias.name)
    # captum_ig.py is the other side of a comparison: Captum alone, nothing of hookrun.
    assert found or script.name == "captum_ig.py", f"{script.name} imports nothing of hookrun"
