"""The LRP map is consumed like every other derived map: evaluate=faithfulness scores it,
experiment=sanity_check checks it by model randomisation, and a sweep's ranking reads it as
method `lrp` at layer `input`."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import read, run_config

from hookrun.stages.evaluate.ranking import job_means

pytestmark = pytest.mark.slow  # each runs hookrun on a ResNet-18

SMALL = ["model=resnet18", "model.weights=null", "dataset=fake", "dataset.image_size=32"]
SMALL += ["dataset.size=2", "batch_size=2", "render=false"]


def test_faithfulness_scores_the_lrp_map_and_the_ranking_reads_it(tmp_path):
    args = ["experiment=lrp", *SMALL, "evaluate=faithfulness", "evaluate.deletion.steps=3"]
    args += ["evaluate.insertion.steps=3", "evaluate.road.fractions=[0.3,0.6]"]
    path = run_config(tmp_path, args, "lrp").path
    data = read(path)
    assert data["derived/lrp/input"].shape == (2, 3, 32, 32)
    for metric in ("deletion", "insertion"):
        assert np.isfinite(data[f"evaluate/{metric}/derived/lrp/input.auc"]).all()
    assert np.isfinite(data["evaluate/road/derived/lrp/input.score"]).all()
    # The gap is no attribution: nothing scores it.
    assert not [k for k in data if k.startswith("evaluate/") and "completeness_gap" in k]
    means = job_means(path)
    assert means["attributions"] == {"derived/lrp/input": ("lrp", "input")}
    assert "road:derived/lrp/input" in means["means"]


def test_the_sanity_check_takes_lrp(tmp_path):
    args = ["experiment=sanity_check", *SMALL, "sanity.methods=[lrp]", "sanity.layers=[fc,layer4]"]
    data = read(run_config(tmp_path, args, "sanity_check").path)
    similarity = data["sanity/lrp/spearman_abs"]
    assert similarity.shape == (2, 3)  # the original model and two randomisation steps
    np.testing.assert_allclose(similarity[:, 0], 1.0, rtol=1e-6)  # the original against itself
    assert data["sanity/lrp/maps"].shape == (2, 3, 32, 32)
