"""The extension points are registries, and every list of choices a user reads — error
messages, the README, the config comments — is the registry's, so none can drift."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import compose_config

from hookrun.choices import choices_table
from hookrun.config.build import build_spec
from hookrun.data.kinds import DATASETS
from hookrun.errors import HookrunError
from hookrun.models.sources import MODEL_SOURCES
from hookrun.runtime.actions import ACTIONS
from hookrun.stages.derive.registry import METHODS
from hookrun.stages.evaluate.registry import FAITHFULNESS_METRICS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize(
    ("override", "key", "registry"),
    [
        ("dataset.kind=nope", "dataset.kind", DATASETS),
        ("++hooks.h.action=nope", "hooks.h.action", ACTIONS),
        ("++derive.nope.layer=layer4", "derive.nope", METHODS),
        ("++model.source=nope", "model.source", MODEL_SOURCES),
        ("+evaluate.metrics=[nope]", "evaluate.metrics[0]", FAITHFULNESS_METRICS),
    ],
)
def test_errors_list_the_registrys_choices(override, key, registry):
    overrides = [override]
    if key == "hooks.h.action":
        overrides += ["++hooks.h.select.name=fc", "++hooks.h.at=output"]
    with pytest.raises(HookrunError) as err:
        build_spec(compose_config(overrides))
    message = str(err.value)
    assert message.startswith(f"{key}: 'nope'")
    assert f"valid: {', '.join(registry.choices())}" in message


def test_readme_lists_exactly_the_registered_choices():
    assert choices_table() in README, "run: python -m hookrun.choices --write"
    for registry in (DATASETS, ACTIONS, METHODS, FAITHFULNESS_METRICS, MODEL_SOURCES):
        assert registry.choices() and all(f"`{n}`" in choices_table() for n in registry.choices())


@pytest.mark.slow
def test_every_dataset_kind_and_experiment_has_a_preset_that_composes():
    for kind in DATASETS.choices():
        assert (ROOT / "conf" / "dataset" / f"{kind}.yaml").is_file(), kind
    for experiment in sorted((ROOT / "conf" / "experiment").glob("*.yaml")):
        if experiment.stem == "patch":  # needs a stored run: the missing file is named
            with pytest.raises(HookrunError, match=r"hooks.ablate.args.file: .*does not exist"):
                build_spec(compose_config(["experiment=patch", "hooks.ablate.args.file=no.h5"]))
            continue
        if experiment.stem == "sae":  # needs a dictionary: the missing path is named
            with pytest.raises(HookrunError, match=r"^hooks.sae.args.path: null; valid: a SAELens"):
                build_spec(compose_config(["experiment=sae"]))
            continue
        spec = build_spec(compose_config([f"experiment={experiment.stem}"]), experiment.stem)
        # lm_patching's work is its patching grid (the `patching:` node), generate's its
        # generation, circuit's its edges: a stage's node, not hooks (features reads hooks).
        acts = (
            spec.hooks
            or spec.patching
            or spec.generate
            or spec.circuit
            or spec.stage("sae")
            or spec.stage("graph")
        )
        assert acts, experiment.stem
