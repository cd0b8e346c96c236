"""Every tutorial script in docs/tutorials/ runs as a reader runs it (a fresh process in an
empty folder) and writes what its page says: the datasets, their shapes and a file marked
complete. The site's pages include these scripts whole, so a tutorial cannot drift from what
runs."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "docs" / "tutorials"


def _run(script: str, cwd: Path, timeout: int = 600) -> str:
    """Run docs/tutorials/SCRIPT in `cwd` with this checkout's hookrun first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    done = subprocess.run(
        [sys.executable, str(TUTORIALS / script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _complete(path: Path) -> h5py.File:
    f = h5py.File(path, "r")
    assert f.attrs["status"] == "complete", path
    return f


def test_every_tutorial_script_has_a_test_and_a_page():
    scripts = sorted(p.name for p in TUTORIALS.glob("*.py"))
    tested = {name[len("test_") :] + ".py" for name in globals() if name.startswith("test_")}
    assert scripts and set(scripts) <= tested, set(scripts) - tested
    pages = "".join(p.read_text() for p in TUTORIALS.glob("*.md"))
    for script in scripts:
        assert f'--8<-- "docs/tutorials/{script}"' in pages, script


def test_vision_attribution(tmp_path):
    out = _run("vision_attribution.py", tmp_path)
    with _complete(tmp_path / "outputs" / "vision" / "captures.h5") as f:
        assert f["derived/grad_cam/features"].shape == (8, 8, 8)
        assert f["evaluate/deletion/derived/grad_cam/features"].shape == (8, 21)
        assert f["evaluate/road/derived/grad_cam/features.score"].shape == (8,)
    assert "evaluate derived/grad_cam/features: deletion AUC" in out


def test_lm_cache(tmp_path):
    out = _run("lm_cache.py", tmp_path)
    with _complete(tmp_path / "outputs" / "lm_cache" / "captures.h5") as f:
        resid = f["captures/transformer.h.1/output"]
        assert resid.shape == (16, 128, 128) and resid.dtype == "float16"
    assert "tokens read by TokenBatches 2048" in out  # 16 packed rows x 128 tokens
    assert "first token's vector (128,)" in out


def test_patching_circuits(tmp_path):
    out = _run("patching_circuits.py", tmp_path)
    with _complete(tmp_path / "outputs" / "patching" / "captures.h5") as f:
        grid = f["patching/resid"]
        assert grid.shape[:2] == (4, 2)  # rows, tiny_lm's layers
        assert f["patching/resid_atp"].shape == grid.shape
        assert -1 <= f["patching/resid_atp"].attrs["pearson"] <= 1
    with _complete(tmp_path / "outputs" / "circuit" / "captures.h5") as f:
        assert f["circuit/edges"].shape[0] == 4
        assert f["circuit/faithfulness"].shape == (3,)  # circuit.k=[5,10,20]
        assert (f["circuit/faithfulness_kept"][:] <= [5, 10, 20]).all()
    assert "largest edges:" in out


def test_steering_generation(tmp_path):
    out = _run("steering_generation.py", tmp_path)
    with _complete(tmp_path / "outputs" / "steering" / "captures.h5") as f:
        assert f["steering/vector/transformer.h.0/output"].shape == (128,)
        assert f["generation/tokens"].shape == (4, 8)
        assert f["metrics/kl"].shape == (4,)
    assert "mean effect" in out


@pytest.mark.slow  # four hookrun processes: about a minute on two busy cores
def test_sweeps_resume(tmp_path):
    out = _run("sweeps_resume.py", tmp_path)
    with open(tmp_path / "multirun" / "scales" / "sweep_summary.csv") as summary:
        jobs = list(csv.DictReader(summary))
    assert [job["status"] for job in jobs] == ["complete", "complete"]
    for job in ("0", "1"):
        with _complete(tmp_path / "multirun" / "scales" / job / "captures.h5") as f:
            assert f["captures/input/grad_output"].shape == (4, 1, 8, 8)
    assert "exit status 143" in out and "after the signal: interrupted" in out
    with _complete(tmp_path / "outputs" / "killed" / "captures.h5") as f:
        assert f.attrs["completed"] == 40
        assert f["samples/index"][:].tolist() == list(range(40))


def test_sae(tmp_path):
    out = _run("sae.py", tmp_path)
    with _complete(tmp_path / "outputs" / "sae" / "captures.h5") as f:
        latents = f["sae/transformer.h.1/output/latents"]
        assert latents.attrs["sparse"] == "rows" and list(latents.attrs["shape"]) == [128, 512]
        table = f["sae/transformer.h.1/output/scores"]
        scores = dict(zip(table.attrs["fields"], table[:], strict=True))
    # A trained SAE: sparse and reconstructing (a random one recovers no CE: < 0).
    assert 1 < scores["l0"] < 128 and scores["explained_variance"] > 0.3
    # 32 packed rows of 128 tokens, the end-of-text separators (special) left out
    assert scores["ce_loss_score"] > 0.5 and 3500 < scores["tokens"] < 4096
    assert "sae_scores: transformer.h.1/output:" in out
    assert (tmp_path / "outputs" / "sae" / "images" / "sae" / "sae_scores.png").is_file()
