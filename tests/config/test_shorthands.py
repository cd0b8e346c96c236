"""`lrp.…` on the command line and in hookrun.run is short for `derive.lrp.…` (issue 45's
spelling): the same config, the same refusals, Hydra's +/~ prefixes and sweeps kept."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

import hookrun
from hookrun.config.shorthands import expanded
from hookrun.errors import HookrunError


def test_short_keys_are_written_out_and_others_left_alone():
    given = ["-m", "lrp.composite=a,b", "+lrp.rules.x={rule: flat}", "~lrp.low", "lrp=null"]
    assert expanded(given) == [
        "-m",
        "derive.lrp.composite=a,b",
        "+derive.lrp.rules.x={rule: flat}",
        "~derive.lrp.low",
        "derive.lrp=null",
    ]
    untouched = ["experiment=lrp", "lrpx.a=1", "derive.lrp.gamma=0.5", "hooks.lrp.at=output"]
    assert expanded(untouched) == untouched


def _lrp(overrides: list[str]) -> dict:
    return yaml.safe_load(hookrun.compose(["experiment=lrp", *overrides]).config_yaml)["derive"][
        "lrp"
    ]


def test_the_short_key_sets_what_the_long_one_sets():
    short = _lrp(["lrp.composite=epsilon_gamma_box", "lrp.low=-2", "lrp.high=2"])
    long = _lrp(
        ["derive.lrp.composite=epsilon_gamma_box", "derive.lrp.low=-2", "derive.lrp.high=2"]
    )
    assert short == long and short["composite"] == "epsilon_gamma_box" and short["low"] == -2


def test_a_bad_value_by_the_short_key_is_refused_in_one_line():
    with pytest.raises(HookrunError, match=r"derive\.lrp\.composite: 'nope' .*; valid: ") as err:
        hookrun.compose(["experiment=lrp", "lrp.composite=nope"])
    assert "epsilon_plus_flat" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_the_command_line_takes_the_short_key(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hookrun",
            "experiment=lrp",
            "lrp.composite=epsilon_plus",
            "dry_run=true",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epsilon_plus" in done.stdout + done.stderr
