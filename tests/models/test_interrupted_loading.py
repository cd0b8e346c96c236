"""SIGTERM / SIGINT while the model or the data is being loaded: the loaders wrap the
libraries' calls in broad `except Exception` (transformers, torch.load and datasets raise
many types for a bad file) to say "bad input" in one line; the signal's interruption must
pass through every one of them and end the run as interrupted (exit 143 / 130), not as bad
input (exit 2) naming the file the run was reading."""

from __future__ import annotations

import signal
import textwrap
import time
from pathlib import Path

import datasets
import pytest
import torch
import transformers
from conftest import spawn

import hookrun
from hookrun.errors import HookrunError, Interrupted

LM = ["experiment=lm_cache", "limit=2", "dataset.context=8", "batch_size=2", "render=false"]
DIGITS = ["model=digits_cnn", "dataset=digits", "limit=2", "render=false", "progress=false"]


def interrupting(original, seen: list):
    """`original`, but once hookrun's SIGTERM handler is in place (the run has begun; the
    config-time checks call some of these too, before it is) a real SIGTERM arrives in the
    middle of the call; what it raises there is noted in `seen`."""

    def call(*args, **kwargs):
        if callable(signal.getsignal(signal.SIGTERM)) and not seen:
            try:
                signal.raise_signal(signal.SIGTERM)
                time.sleep(5)  # the handler raises before this ends
            except BaseException as err:
                seen.append(type(err))
                raise
        return original(*args, **kwargs)

    return call


def hf_disk_folder(tmp_path: Path) -> list[str]:
    folder = tmp_path / "docs"
    text = ["the cat sat on the mat and the dog ran", "a quick brown fox jumps over the dog"]
    datasets.Dataset.from_dict({"text": text}).save_to_disk(str(folder))
    return [*LM, "dataset=hf_disk", f"dataset.path={folder}"]


# (what is loading, the object and attribute the loader calls, the run)
LOADERS = [
    ("hf weights", transformers.AutoModelForCausalLM, "from_pretrained", LM),
    ("hf tokenizer", transformers.AutoTokenizer, "from_pretrained", LM),
    ("hf config", transformers.AutoConfig, "from_pretrained", LM),
    ("hf meta build", transformers.AutoModelForCausalLM, "from_config", LM),
    ("state_dict file", torch, "load", DIGITS),
    ("datasets folder", datasets, "load_from_disk", None),
]


@pytest.mark.parametrize("what,owner,name,overrides", LOADERS, ids=[x[0] for x in LOADERS])
def test_a_signal_inside_a_loader_s_broad_except_stops_the_run_as_interrupted(
    tmp_path, monkeypatch, what, owner, name, overrides
):
    overrides = overrides or hf_disk_folder(tmp_path)
    seen: list = []
    monkeypatch.setattr(owner, name, interrupting(getattr(owner, name), seen))
    run_dir = tmp_path / "run"
    try:
        hookrun.run(overrides, run_dir=run_dir)
    except Interrupted as err:
        assert err.exit_code == 143
        assert (
            str(err)
            == f"interrupted by SIGTERM: nothing written ({run_dir / 'captures.h5'} was not made)"
        )
    except HookrunError as err:  # the bug: the interruption read as bad input
        pytest.fail(f"{what}: SIGTERM became bad input (exit {err.exit_code}): {err}")
    else:
        pytest.fail(f"{what}: the run ended normally after SIGTERM")
    assert seen == [Interrupted], what  # raised inside the loader's call, where it was caught
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the caller's handler is back
    assert not (run_dir / "captures.h5").exists()  # nothing is written before the first batch


def test_an_interruption_is_no_exception_a_broad_except_can_catch():
    # KeyboardInterrupt's place: `except Exception` (and `except HookrunError`) lets it pass.
    assert not issubclass(Interrupted, Exception)
    assert issubclass(Interrupted, BaseException)


# Put in front of the CLI's imports through PYTHONPATH: transformers' weight loading waits
# (up to two minutes) once it has begun, and says so by removing the flag file.
SLOW_LOADER = """
import os, time
import transformers

_flag = os.environ["HOOKRUN_TEST_SLOW_LOAD"]
_original = transformers.AutoModelForCausalLM.from_pretrained


def _slow(*args, **kwargs):
    if os.path.exists(_flag):
        os.unlink(_flag)
        time.sleep(120)
    return _original(*args, **kwargs)


transformers.AutoModelForCausalLM.from_pretrained = _slow
"""


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.slow
def test_a_signal_while_the_cli_loads_hf_weights_exits_as_interrupted(
    tmp_path, monkeypatch, signum, code
):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SLOW_LOADER))
    flag = tmp_path / "loading"
    flag.touch()
    monkeypatch.setenv("HOOKRUN_TEST_SLOW_LOAD", str(flag))
    monkeypatch.setenv("PYTHONPATH", f"{site}:{Path(hookrun.__file__).parents[1]}")
    run_dir = tmp_path / "run"
    proc = spawn([*LM, "progress=false", f"hydra.run.dir={run_dir}"], tmp_path)
    try:
        deadline = time.monotonic() + 120
        while flag.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not flag.exists() and proc.poll() is None, proc.poll()  # inside the load
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    name = signal.Signals(signum).name
    assert proc.returncode == code, err[-2000:]
    assert f"hookrun: error: interrupted by {name}" in err, err[-2000:]
    assert "cannot load the weights" not in err
    assert not (run_dir / "captures.h5").exists()
