"""Data-parallel training under torchrun (2 CPU ranks, gloo): every architecture's Trainer
stepped on two ranks' halves of each batch against one process on the whole batches (the
counters exactly, the weights and metrics to rounding); experiment=train_sae's weights on two
ranks against one process with the same global batch (topk, relu, batchtopk, streamed from the
model and read from a file); SIGTERM to the torchrun job then resume, to the same weights bit
for bit; a global batch the ranks do not divide refused in one line before any work.

The reference is one process with one thread (each torchrun rank's count): the two compute the
same sums, split differently across the ranks, so the weights agree to rounding (all but
0.1 % of entries to rtol 1e-5 / atol 1e-6, every one to lr / 10), not bit for bit. Adam moves
every weight by about lr a step whatever the size of its gradient, so a rounding-sized
relative difference in a rarely firing latent's small, cancelling gradient becomes lr times
it in the weight, each step: the jobs here train at lr 1e-4 (at 1e-3, 2 of batchtopk's 32768
decoder entries differed by 5e-6 after 48 steps). A wrong reduction misses by far more: a
batchtopk selecting k x its own half of the batch on each rank fires other latents, and AuxK
counting dead latents on its own half sees others."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import ONE_THREAD, TESTS, torchrun
from ddp_trainer_script import cases, train
from safetensors.torch import load_file

import hookrun
from hookrun.errors import HookrunError

pytestmark = pytest.mark.slow

LR = 1e-4
# 48 steps of 256 tokens (128 on each rank), a checkpoint every 4: seconds, long enough to stop.
BASE = [
    "experiment=train_sae",
    "sae.tokens=12288",
    "sae.batch=256",
    "sae.buffer=1024",
    "sae.width=256",
    "sae.checkpoint_tokens=1024",
    "sae.log_steps=2",
    f"sae.lr={LR}",
    "render=false",
    "progress=false",
]
# Three dictionaries from the same activations: each architecture's terms that are no plain
# mean over tokens (AuxK's dead latents, relu's L1, batchtopk's k·B over the whole batch and
# its threshold) are reduced over the ranks.
GRID = (
    "sae.grid=[{architecture:topk,k:8},{architecture:relu,l1_coefficient:0.5},"
    "{architecture:batchtopk,k:8}]"
)
SMALL = [*BASE, GRID, "sae.heldout.rows=4"]
NAMES = [
    "transformer.h.1.output.topk.w256.k8",
    "transformer.h.1.output.relu.w256.l1_0.5",
    "transformer.h.1.output.batchtopk.w256.k8",
]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS), env.get("PYTHONPATH", "")] if p)
    return {**env, **ONE_THREAD}


def _weights(run_dir: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "sae" / name / "sae_weights.safetensors"))


def _one_process(args: list[str], run_dir: Path) -> Path:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun rank
    try:
        hookrun.run(args, run_dir=run_dir)
    finally:
        torch.set_num_threads(threads)
    return run_dir


def _torchrun(args: list[str], run_dir: Path) -> Path:
    done = torchrun([*args, f"hydra.run.dir={run_dir}"], run_dir.parent, _env())
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def _close(single: Path, ranks: Path, names: list[str]) -> None:
    """The weights to rounding: at most 0.1 % of each tensor's entries past rtol 1e-5 / atol
    1e-6, none past a tenth of one step's lr. A rounding-sized difference in an entry's
    cancelling gradient is amplified by Adam to a fraction of lr in that entry alone (on
    CI's CPU a decoder entry of 32768 passed atol 1e-6 after 16 steps; here the largest gap
    was 3.8e-7, 759 entries past 1e-8);
    a wrong reduction moves most entries of the latents it touches by about lr a step."""
    for name in names:
        a, b = _weights(single, name), _weights(ranks, name)
        assert a.keys() == b.keys()
        for key in a:
            _rounded(b[key], a[key], f"{name} {key}")


def _rounded(two: torch.Tensor, one: torch.Tensor, what: str, lr: float = LR) -> None:
    gap = (two - one).abs()
    past = gap > 1e-6 + 1e-5 * one.abs()
    assert int(past.sum()) <= past.numel() // 1000, (what, int(past.sum()), past.numel())
    assert float(gap.max()) < lr / 10, (what, float(gap.max()))


def test_every_architectures_trainer_steps_on_two_ranks_as_on_one_process(tmp_path: Path):
    script = Path(__file__).with_name("ddp_trainer_script.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*cmd, str(script), str(tmp_path)], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, h in cases().items():
            one, logged = train(h)
            two = torch.load(tmp_path / f"{name}.pt", weights_only=False)
            state = one.state_dict()
            for key in ("n_steps", "n_tokens", "window_tokens"):
                assert two["state"][key] == state[key], (name, key)
            for key in ("tokens_since_fired", "fired_counts"):  # the whole batch's firing
                assert torch.equal(two["state"][key], state[key]), (name, key)
            if name != "relu" and name != "jumprelu":
                assert bool((state["tokens_since_fired"] > h.dead_tokens).any()), name  # AuxK on
            torch.testing.assert_close(
                two["state"]["topk_threshold"], state["topk_threshold"], rtol=1e-6, atol=0
            )
            for key, value in state["params"].items():
                _rounded(two["state"]["params"][key], value, f"{name} {key}", h.lr)
            for step, (a, b) in enumerate(zip(logged, two["metrics"], strict=True)):
                assert a.keys() == b.keys()
                for key in a:  # the whole batch's, not rank 0's half
                    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (name, step, key)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    return _one_process(SMALL, tmp_path_factory.mktemp("ddp") / "single")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    return _torchrun(SMALL, tmp_path_factory.mktemp("ddp") / "ranks")


def test_two_ranks_train_the_weights_of_one_process(single: Path, ranks: Path):
    _close(single, ranks, NAMES)
    with h5py.File(single / "captures.h5") as f, h5py.File(ranks / "captures.h5") as g:
        assert g.attrs["status"] == "complete" and g.attrs["step"] == 48
        for name in NAMES:
            # the curves are the whole batch's (loss, mse, EV, L0, dead), not rank 0's half
            fields = list(f[f"train/{name}/curves"].attrs["fields"])
            one, two = f[f"train/{name}/curves"][()], g[f"train/{name}/curves"][()]
            np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-4, err_msg=name)
            assert list(two[:, fields.index("tokens")]) == [256.0 * s for s in range(2, 49, 2)]
            if "topk." not in name:
                continue
            # the scoring run was a torchrun run too: rank 0 joined its shards
            np.testing.assert_allclose(
                g[f"train/{name}/scores"][()], f[f"train/{name}/scores"][()], rtol=1e-4
            )
    assert not (ranks / "checkpoints").exists()


def test_two_ranks_from_an_earlier_runs_file(tmp_path: Path):
    cache = hookrun.run(
        ["experiment=lm_cache", "sink.dtype=float32", "dataset.context=64", "render=false"],
        run_dir=tmp_path / "cache",
    )
    args = [*BASE, "sae.k=8", f"sae.from={cache.path}", "sae.tokens=4096", "sae.heldout.rows=0"]
    single = _one_process(args, tmp_path / "single")
    ranks = _torchrun(args, tmp_path / "ranks")
    _close(single, ranks, ["transformer.h.1.output.topk.w256.k8"])


def test_sigterm_to_torchrun_then_resume_ends_at_the_same_weights(ranks: Path, tmp_path: Path):
    run_dir = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen(
        [*cmd, "-m", "hookrun", *SMALL, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    state = run_dir / "checkpoints" / "train_state.pt"
    deadline = time.monotonic() + 300
    while not state.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it on to both ranks
    sent = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 30
    if proc.returncode == 0:
        pytest.skip("the job ended before the signal")  # a fast machine: nothing to stop
    # both ranks stopped, at the same step: by the signal, or told by the other that got it
    # first (torchrun passes it on to one rank, then the other)
    said = [line for line in err.splitlines() if line.startswith("hookrun: error: interrupted")]
    assert len(said) == 2, err[-3000:]
    assert "interrupted by SIGTERM" in "".join(said)
    with h5py.File(run_dir / "captures.h5") as f:
        assert f.attrs["status"] == "interrupted"
        assert 0 < f.attrs["step"] < f.attrs["steps"]
    _torchrun([*SMALL, "resume=true"], run_dir)
    for name in NAMES:  # the same ranks, the same sums: bit for bit
        a, b = _weights(ranks, name), _weights(run_dir, name)
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_a_global_batch_the_ranks_do_not_divide_is_refused(tmp_path: Path, monkeypatch):
    # As the job sees two torchrun ranks (training/parallel.py's joined); the refusal comes
    # before any collective, so no process group is needed (the torchrun tests above join one).
    from hookrun.training import job, parallel

    monkeypatch.setattr(job.parallel, "joined", lambda: parallel.Ranks(0, 2))
    with pytest.raises(HookrunError) as err:
        hookrun.run([*BASE, "sae.batch=255"], run_dir=tmp_path)
    assert str(err.value) == (
        "sae.batch: 255 under torchrun with 2 processes; valid: a multiple of 2 (each process "
        "steps on an equal slice of it)"
    )
    assert not (tmp_path / "captures.h5").exists() and not (tmp_path / "sae").exists()


def test_prefetch_true_under_torchrun_is_refused(tmp_path: Path, monkeypatch):
    # The prefetch thread's chunk gathers would interleave with the steps' collectives.
    from hookrun.training import job, parallel

    monkeypatch.setattr(job.parallel, "joined", lambda: parallel.Ranks(0, 2))
    with pytest.raises(HookrunError) as err:
        hookrun.run([*BASE, "sae.prefetch=true"], run_dir=tmp_path)
    assert str(err.value).startswith("sae.prefetch: true under torchrun with 2 processes; valid:")
    assert not (tmp_path / "captures.h5").exists() and not (tmp_path / "sae").exists()
