"""experiment=train_sae as a user runs it: the saved folder, the run's file, resume after
kill -9 and SIGTERM to the same weights bit for bit, training from an earlier run's file,
and bad input refused in one line before any work."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import hookrun
from hookrun.errors import HookrunError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import hookrun_cli, spawn  # noqa: E402

pytestmark = pytest.mark.slow

# 48 steps of 256 tokens, a checkpoint every 4: small enough for seconds, long enough to kill.
SMALL = [
    "experiment=train_sae",
    "sae.tokens=12288",
    "sae.batch=256",
    "sae.buffer=1024",
    "sae.width=256",
    "sae.k=8",
    "sae.checkpoint_tokens=1024",
    "sae.log_steps=2",
    "sae.heldout.rows=4",
    "render=false",
    "progress=false",
]
NAME = "transformer.h.1.output.topk.w256.k8"


def _weights(run_dir: Path, name: str = NAME) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "sae" / name / "sae_weights.safetensors"))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("whole")
    done = hookrun_cli([*SMALL, f"hydra.run.dir={run_dir}"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_a_job_saves_a_folder_the_splice_loads_and_a_complete_file(uninterrupted: Path):
    folder = uninterrupted / "sae" / NAME
    assert (folder / "cfg.json").is_file() and (folder / "sae_weights.safetensors").is_file()
    with h5py.File(uninterrupted / "captures.h5") as f:
        assert f.attrs["status"] == "complete" and f.attrs["job"] == "train_sae"
        assert f.attrs["step"] == f.attrs["steps"] == 12288 // 256
        curves = f[f"train/{NAME}/curves"]
        fields = list(curves.attrs["fields"])
        assert curves.shape == (48 // 2, len(fields))
        assert list(curves[:, fields.index("step")]) == list(range(2, 49, 2))
        assert f"train/{NAME}/scores" in f  # scored on the held-out rows
    assert not (uninterrupted / "checkpoints").exists()  # a finished job keeps none
    # The saved folder splices in by its own hook name (no select), as any SAELens folder.
    spliced = hookrun.run(
        [
            "experiment=sae",
            f"hooks.sae.args.path={folder}",
            "~hooks.sae.select",
            "limit=4",
            "render=false",
            "progress=false",
        ],
        run_dir=uninterrupted / "splice",
    )
    with spliced.open() as res:
        assert "sae/transformer.h.1/output/latents" in res


def test_resume_after_kill_9_ends_at_the_same_weights(uninterrupted: Path, tmp_path: Path):
    run_dir = tmp_path / "killed"
    proc = spawn([*SMALL, f"hydra.run.dir={run_dir}"], tmp_path)
    state = run_dir / "checkpoints" / "train_state.pt"
    deadline = time.monotonic() + 300
    while not state.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(random.uniform(0, 0.5))  # anywhere after the first checkpoint
    proc.kill()
    proc.wait()
    assert not (run_dir / "sae" / NAME / "sae_weights.safetensors").exists() or proc.returncode == 0
    done = hookrun_cli([*SMALL, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    if proc.returncode != 0:  # killed with a checkpoint on disk: the resume says so
        assert "resume=true: continuing from the checkpoint at step" in done.stdout + done.stderr
    _same(_weights(uninterrupted), _weights(run_dir))
    with h5py.File(run_dir / "captures.h5") as f, h5py.File(uninterrupted / "captures.h5") as g:
        assert f[f"train/{NAME}/curves"][()].tobytes() == g[f"train/{NAME}/curves"][()].tobytes()


def test_sigterm_checkpoints_and_exits_then_resumes_to_the_same_weights(
    uninterrupted: Path, tmp_path: Path
):
    run_dir = tmp_path / "stopped"
    proc = spawn([*SMALL, f"hydra.run.dir={run_dir}"], tmp_path)
    state = run_dir / "checkpoints" / "train_state.pt"
    while not state.exists() and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    proc.wait(timeout=30)
    assert time.monotonic() - sent < 30
    if proc.returncode == 0:
        pytest.skip("the job ended before the signal")  # a fast machine: nothing to stop
    assert proc.returncode == 143, proc.stderr.read()[-2000:]
    with h5py.File(run_dir / "captures.h5") as f:
        assert f.attrs["status"] == "interrupted"
        assert 0 < f.attrs["step"] < f.attrs["steps"]
    done = hookrun_cli([*SMALL, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    _same(_weights(uninterrupted), _weights(run_dir))


def test_training_from_an_earlier_runs_file(tmp_path: Path):
    cache = hookrun.run(
        [
            "experiment=lm_cache",
            "sink.dtype=float32",
            "dataset.context=64",
            "render=false",
            "progress=false",
        ],
        run_dir=tmp_path / "cache",
    )
    run = hookrun.run(
        [*SMALL, f"sae.from={cache.path}", "sae.tokens=4096"], run_dir=tmp_path / "train"
    )
    assert (tmp_path / "train" / "sae" / NAME / "sae_weights.safetensors").is_file()
    assert "complete" in run.summary


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["sae.k=256"], "k: 256 with width 256; valid: 1 <= k < width"),
        (["sae.width=null", "sae.expansion=0.5", "sae.k=64"], "k: 64 with width 64"),
        (["sae.width=0"], "sae.width: 0; valid: an integer >= 1"),
        (["sae.sites=[transformer.h.9:output]"], "the model has no module 'transformer.h.9'"),
        (["sae.tokens=100"], "sae.tokens: 100 is fewer than one batch"),
        (["sae.architecture=topkk"], "did you mean 'topk'"),
        (["sae.prefetch=sometimes"], "sae.prefetch: 'sometimes'; valid: auto, true, false"),
        (
            [
                "sae.architecture=topk",
                "sae.sites=[{in: transformer.h.0.mlp:input, out: transformer.h.0.mlp:output}]",
            ],
            "sae.architecture: 'topk' for the transcoder transformer.h.0.mlp:input",
        ),
    ],
)
def test_bad_input_is_refused_before_any_work(tmp_path: Path, overrides: list[str], said: str):
    with pytest.raises(HookrunError, match=None) as err:
        hookrun.run([*SMALL, *overrides], run_dir=tmp_path)
    assert said in str(err.value)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "captures.h5").exists() and not (tmp_path / "sae").exists()


def test_a_cache_key_that_is_not_one_row_per_token_is_refused(tmp_path: Path):
    cache = hookrun.run(
        [
            "experiment=lm_cache",
            "+hooks.resid.args.positions=last",
            "limit=8",
            "render=false",
            "progress=false",
        ],
        run_dir=tmp_path / "cache",
    )
    with h5py.File(cache.path) as f:
        shape = f["captures/transformer.h.1/output"].shape
    assert len(shape) == 2  # (N, D): one token per row is still a token per row
    with h5py.File(cache.path, "a") as f:
        f["captures/transformer.h.1/output"].attrs["per_batch"] = 1
    with pytest.raises(HookrunError) as err:
        hookrun.run([*SMALL, f"sae.from={cache.path}"], run_dir=tmp_path / "train")
    assert "not one vector per token" in str(err.value)


def test_sae_dtype_bfloat16_trains_under_autocast_with_float32_weights(tmp_path: Path):
    short = [*SMALL, "sae.tokens=4096"]
    plain = hookrun.run(short, run_dir=tmp_path / "float32")
    low = hookrun.run([*short, "sae.dtype=bfloat16"], run_dir=tmp_path / "bfloat16")
    assert "complete" in plain.summary and "complete" in low.summary
    a, b = _weights(tmp_path / "float32"), _weights(tmp_path / "bfloat16")
    assert all(t.dtype == torch.float32 for t in b.values())
    assert not torch.equal(a["W_enc"], b["W_enc"])  # the forward really ran in bfloat16
    assert torch.allclose(a["W_enc"], b["W_enc"], atol=0.05)


def test_kill_9_during_the_final_scoring_then_resume_completes_with_the_same_weights(
    tmp_path: Path,
):
    """The scoring after the last step is part of the job: a kill there leaves the saved
    folder and the checkpoint; the resume saves the same weights and finishes the scores."""
    import hashlib

    # a scoring run of 48 one-row batches: long enough to be killed inside
    args = [*SMALL, "sae.tokens=4096", "sae.heldout.rows=48", "batch_size=1"]
    run_dir = tmp_path / "run"
    proc = spawn([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    scores = run_dir / "scores" / NAME / "captures.h5"
    deadline = time.monotonic() + 300
    while not scores.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(random.uniform(0, 0.3))
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the job ended before the kill"
    weights = run_dir / "sae" / NAME / "sae_weights.safetensors"
    before = hashlib.sha256(weights.read_bytes()).hexdigest()
    with h5py.File(run_dir / "captures.h5") as f:
        assert f.attrs["status"] != "complete"
    done = hookrun_cli([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == before
    with h5py.File(run_dir / "captures.h5") as f:
        assert f.attrs["status"] == "complete"
        assert f"train/{NAME}/scores" in f
        assert all(np.isfinite(f[f"train/{NAME}/scores"][()]))
    verified = subprocess.run(
        [sys.executable, "-m", "hookrun.verify", str(run_dir / "captures.h5")],
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_prefetch_ends_at_the_weights_of_a_job_without_it(uninterrupted: Path, tmp_path: Path):
    # The next chunk made in a thread while the steps run (auto leaves it off on the CPU,
    # so `uninterrupted` made each chunk in turn): the same chunks, the same weights.
    run_dir = tmp_path / "ahead"
    done = hookrun_cli([*SMALL, "sae.prefetch=true", f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    _same(_weights(uninterrupted), _weights(run_dir))
    with h5py.File(run_dir / "captures.h5") as f, h5py.File(uninterrupted / "captures.h5") as g:
        assert f[f"train/{NAME}/curves"][()].tobytes() == g[f"train/{NAME}/curves"][()].tobytes()


def test_sigterm_with_a_chunk_in_the_making_stops_then_resumes_to_the_same_weights(
    uninterrupted: Path, tmp_path: Path
):
    # A chunk of 4 steps, the next one always in the making: SIGTERM finds the thread
    # running; the job gives its chunk up, joins it, checkpoints and exits 143.
    run_dir = tmp_path / "stopped"
    args = [*SMALL, "sae.prefetch=true", f"hydra.run.dir={run_dir}"]
    proc = spawn(args, tmp_path)
    state = run_dir / "checkpoints" / "train_state.pt"
    while not state.exists() and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(random.uniform(0, 0.3))
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    proc.wait(timeout=30)
    assert time.monotonic() - sent < 30
    if proc.returncode == 0:
        pytest.skip("the job ended before the signal")
    err = proc.stderr.read()
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    done = hookrun_cli([*args, "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    _same(_weights(uninterrupted), _weights(run_dir))


def test_the_scoring_runs_use_the_jobs_model_not_a_second_copy(tmp_path: Path, monkeypatch):
    # A large model is not built a second time at the end of its training: every scoring
    # run is lent the job's model, and its file names the weights the job loaded.
    from hookrun.pipeline import prepare

    built = []
    real = prepare.build_model
    monkeypatch.setattr(prepare, "build_model", lambda *a, **k: built.append(a) or real(*a, **k))
    grid = "sae.grid=[{architecture:topk,k:8},{architecture:relu}]"
    hookrun.run([*SMALL, grid, "sae.tokens=1024"], run_dir=tmp_path)
    assert len(built) == 1
    with h5py.File(tmp_path / "captures.h5") as f:
        job_weights = (f.attrs["weights_file"], f.attrs["weights_sha256"])
        assert job_weights[1]  # tiny_lm's shipped weights, hashed
        for name in (
            "transformer.h.1.output.topk.w256.k8",
            "transformer.h.1.output.relu.w256.l1_1",
        ):
            scored = f[f"train/{name}/scores"].attrs["file"]
            with h5py.File(scored) as g:
                assert (g.attrs["weights_file"], g.attrs["weights_sha256"]) == job_weights
                assert g.attrs["status"] == "complete"


def test_normalize_takes_its_factor_from_the_first_chunk_and_makes_it_once(
    tmp_path: Path, monkeypatch
):
    # expected_average_only_in: sqrt(d_in) / the mean norm of the first chunk's vectors (the
    # first sae.buffer real tokens of the training rows, in order), checked against an
    # lm_cache capture of the same rows; the chunk is made once, for the factor and the
    # first steps (the model batches run are those of a job without normalize).
    from hookrun.training import sources

    runs = []
    real = sources.ModelActivations._run
    monkeypatch.setattr(sources.ModelActivations, "_run", lambda s, b: runs.append(1) or real(s, b))
    args = [*SMALL, "sae.tokens=2048", "sae.heldout.rows=0"]
    hookrun.run([*args, "sae.normalize=expected_average_only_in"], run_dir=tmp_path / "norm")
    normalized = len(runs)
    runs.clear()
    hookrun.run(args, run_dir=tmp_path / "plain")
    assert normalized == len(runs)
    cache = hookrun.run(
        [
            "experiment=lm_cache",
            "sink.dtype=float32",
            "dataset.context=64",  # train_sae's rows
            "limit=16",
            "render=false",
            "progress=false",
        ],
        run_dir=tmp_path / "cache",
    )
    with h5py.File(cache.path) as f:
        rows = f["captures/transformer.h.1/output"][()]  # (16, 64, 128): every token real
        assert "mask" not in f["samples"] or f["samples/mask"][()].all()
    vectors = rows.reshape(-1, rows.shape[-1])[:1024].astype(np.float64)  # sae.buffer tokens
    factor = np.sqrt(vectors.shape[1]) / np.linalg.norm(vectors, axis=1).mean()
    with h5py.File(tmp_path / "norm" / "captures.h5") as f:
        assert f[f"train/{NAME}"].attrs["scale"] == pytest.approx(factor, rel=1e-5)


def test_resume_without_a_checkpoint_says_it_starts_from_step_0(tmp_path: Path):
    run_dir = tmp_path / "fresh"
    done = hookrun_cli(
        [*SMALL, "sae.tokens=512", f"hydra.run.dir={run_dir}", "resume=true"], tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resume=true: no checkpoint in" in done.stdout + done.stderr
    assert "training from step 0" in done.stdout + done.stderr


def test_progress_shows_the_steps_and_the_last_logged_figures(tmp_path: Path):
    """progress=true: one bar over the job's steps, the last logged loss, explained
    variance and L0 beside it, read back here against the file's last curve row."""
    args = [a for a in SMALL if a != "progress=false"]
    done = hookrun_cli([*args, "progress=true", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    bars = [line for line in done.stderr.replace("\r", "\n").splitlines() if "train_sae:" in line]
    assert bars and "48/48" in bars[-1]
    with h5py.File(tmp_path / "captures.h5") as f:
        curves = f[f"train/{NAME}/curves"]
        fields = list(curves.attrs["fields"])
        last = curves[-1]
    assert f"loss {last[fields.index('loss')]:.4g}" in bars[-1]
    assert f"L0 {last[fields.index('l0')]:.4g}" in bars[-1]
