"""`sanity:` lists that would run a step twice are refused before any work, the way
`patching.layer` refuses a layer listed twice (issue 28, part 3)."""

from __future__ import annotations

import pytest
from conftest import hookrun_cli, run_config

from hookrun.errors import HookrunError


@pytest.mark.slow
def test_a_layer_listed_twice_is_refused_by_the_cli(tmp_path):
    proc = hookrun_cli(
        [
            "experiment=sanity_check",
            "sanity.layers=[classifier.1,classifier.1]",
            "hydra.run.dir=run",
        ],
        tmp_path,
    )
    lines = [x for x in proc.stderr.splitlines() if x.startswith("hookrun:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines == [
        "hookrun: error: sanity.layers: ['classifier.1', 'classifier.1'] names 'classifier.1' "
        "twice; valid: auto, or a list of distinct module names (randomised in that order)"
    ]
    assert not (tmp_path / "run" / "captures.h5").exists()


def test_a_method_listed_twice_names_it_and_the_choices(tmp_path):
    with pytest.raises(HookrunError) as err:
        run_config(
            tmp_path / "run", ["experiment=sanity_check", "sanity.methods=[saliency,saliency]"]
        )
    said = str(err.value)
    assert said.startswith("sanity.methods: ['saliency', 'saliency'] names 'saliency' twice"), said
    assert "valid: distinct methods, any of " in said and "grad_cam" in said
    assert not (tmp_path / "run" / "captures.h5").exists()
