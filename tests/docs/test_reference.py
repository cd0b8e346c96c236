"""The generated references (docs/gen_reference.py) hold every key a user can set, each with
its meaning, and follow the code: a key removed from the schema leaves the page."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hookrun import api
from hookrun.config.schema import conf_dir
from hookrun.reference import HOOK, config_keys
from hookrun.stage import STAGES

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs/gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _leaves(node, key=""):
    """Every key the composed config sets, as a user types it (a hook's name as <name>)."""
    if isinstance(node, dict):  # an empty node ({}: a stage off) sets no key
        for name, value in node.items():
            inner = HOOK if key == "hooks" else f"{key}.{name}" if key else str(name)
            yield from _leaves(value, inner)
    elif key and key != "hooks":
        yield key


def _set_keys(overrides):
    cfg, _, _ = api._compose(overrides)  # as hookrun.run and the CLI compose
    return set(_leaves(OmegaConf.to_container(cfg, resolve=False)))


def _documented(page: str) -> dict[str, str]:
    """Key → meaning of every row of the configuration reference."""
    documented: dict[str, str] = {}
    for line in page.splitlines():
        cells = re.split(r"(?<!\\)\|", line)[1:-1]  # a cell's own | is written \|
        if len(cells) == 6 and cells[0].strip().startswith("`"):
            key = cells[0].strip().strip("`")
            documented[key] = documented.get(key) or cells[5].strip()
    return documented


@pytest.fixture(scope="module")
def config_page():
    return _generator().config_page()


def _known(key: str, documented: dict[str, str]) -> bool:
    """A key of a free-form mapping (`model.kwargs.num_classes`) is its mapping's key."""
    while key and key not in documented:
        key = key.rpartition(".")[0]
    return bool(key) and bool(documented[key])


@pytest.mark.parametrize("experiment", [None, *EXPERIMENTS])
def test_every_key_a_run_sets_is_documented_with_a_meaning(config_page, experiment):
    documented = _documented(config_page)
    overrides = [f"experiment={experiment}"] if experiment else []
    missing = sorted(k for k in _set_keys(overrides) if not _known(k, documented))
    assert not missing, f"keys of {experiment or 'the default'} without a meaning: {missing}"


def test_every_schema_key_has_a_meaning():
    assert [k.key for k in config_keys() if not k.meaning] == []


def test_a_key_removed_from_the_schema_leaves_the_reference(monkeypatch):
    circuit = STAGES.get("circuit", "stage")
    (schema,) = circuit.schema().values()
    kept = [(f.name, f.type, f) for f in dataclasses.fields(schema) if f.name != "k"]
    without_k = dataclasses.make_dataclass("CircuitConfig", kept)
    without_k.__module__ = schema.__module__  # where its annotations' names resolve
    assert "| `circuit.k` |" in _generator().config_page()
    monkeypatch.setattr(circuit, "schema", classmethod(lambda cls: {"circuit": without_k}))
    page = _generator().config_page()
    assert "| `circuit.k` |" not in page and "| `circuit.method` |" in page


def test_the_config_groups_and_their_options_are_listed(config_page):
    for group in ("model", "dataset", "experiment", "device", "evaluate", "metrics"):
        options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
        row = next(line for line in config_page.splitlines() if line.startswith(f"| `{group}=`"))
        assert all(f"`{o}`" in row for o in options), row


def test_the_cli_reference_holds_every_entry_point_s_help():
    page = _generator().cli_page()
    for prog in (
        "python -m hookrun.verify",
        "python -m hookrun.render",
        "python -m hookrun.choices",
    ):
        assert f"## {prog}" in page and f"usage: {prog}" in page


def test_the_layout_page_is_the_architecture_section():
    gen = _generator()
    page = gen.layout_page()
    assert "| `/captures/<layer>/<site>" in page and "Root attributes" in page
