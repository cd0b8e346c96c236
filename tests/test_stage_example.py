"""docs/architecture.md's worked example is true: a new stage is its folder and one line in
hookrun/stages/__init__.py. The example's code is taken from the document itself, put into a
copy of the package with no other file changed, and run as a user runs hookrun; what it
stores is checked against the model's output computed here with numpy."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import hookrun_cli

import hookrun

pytestmark = pytest.mark.slow  # every test here takes over ~1.5 s

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _example_files() -> dict[str, str]:
    """The worked example's files, as the document spells them (`# path` heads each one)."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"```python\n(# hookrun/stages/outnorm/.*?)```", text, re.S)
    assert match, "docs/architecture.md lost its worked example"
    parts = re.split(r"^# (hookrun/stages/outnorm/\S+)\n", match.group(1), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.fixture(scope="module")
def package_with_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("with_outnorm")
    source = Path(hookrun.__file__).resolve().parent
    shutil.copytree(source, root / "hookrun", ignore=shutil.ignore_patterns("__pycache__"))
    if not (root / "hookrun" / "conf").is_dir():  # a checkout: conf/ beside the package
        shutil.copytree(source.parent / "conf", root / "conf")
    before = {p.relative_to(root) for p in root.rglob("*") if p.is_file()}
    for name, body in _example_files().items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(body, encoding="utf-8")
    with open(root / "hookrun/stages/__init__.py", "a", encoding="utf-8") as f:
        f.write("from hookrun.stages import outnorm as outnorm\n")
    after = {p.relative_to(root) for p in root.rglob("*") if p.is_file()}
    # The folder's two files are all that is new; the one changed file is the registration.
    assert after - before == {
        Path("hookrun/stages/outnorm/__init__.py"),
        Path("hookrun/stages/outnorm/stage.py"),
    }
    return root


def test_a_new_stage_is_its_folder_and_one_line(
    package_with_example: Path, tmp_path: Path, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", str(package_with_example))
    args = ["experiment=saliency", "model=digits_cnn", "dataset=digits", "limit=5", "batch_size=2"]
    dry = hookrun_cli([*args, "+outnorm={p: 1}", "dry_run=true"], tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "outnorm" in dry.stdout + dry.stderr  # the dry run sizes the stage's dataset
    done = hookrun_cli([*args, "+outnorm={p: 1}", "progress=false", "hydra.run.dir=run"], tmp_path)
    assert done.returncode == 0, done.stderr
    path = tmp_path / "run" / "captures.h5"
    with h5py.File(path, "r") as f:
        assert f.attrs["status"] == "complete"
        norms = f["outnorm/norm"][()]
        logits = f["model/output"][()].astype(np.float64)
        assert f["outnorm/norm"].dims[0][0].name == "/sample"  # its axis named as the stage said
    np.testing.assert_allclose(norms, np.abs(logits).sum(axis=1), rtol=1e-5)  # p=1: the L1 norm
    # Verify reads the stage's dataset like every other one; a typo in its node is refused.
    verify = subprocess.run(
        [sys.executable, "-m", "hookrun.verify", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 0 and "intact" in verify.stdout, verify.stdout + verify.stderr
    typo = hookrun_cli([*args, "+outnorm={q: 1}"], tmp_path)
    assert typo.returncode == 2 and "outnorm" in typo.stderr + typo.stdout
