"""graph.interventions against circuit-tracer 0.5's `feature_intervention` (freeze_attention,
its default) on the same random GPT-2 and transcoders (JumpReLU, W_skip, random LN affines:
the transcoders read the normalised ln_2 input, not the MLP's): the last position's logits
of each intervention, edits at several layers together (a later layer's latents recomputed
under the earlier edit), each op of Dictionaries I's edits, a negative position, and the
beginning of the text; then the refusals."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from graph_models import run_reference, save_gpt2, write_transcoders

import hookrun
from hookrun.errors import HookrunError

PROMPT = "def add(a, b): return a"


@pytest.fixture
def setup(tmp_path):
    model = save_gpt2(tmp_path / "model", n_layer=3, ln_affine=True, ln_f_scale=40.0, seed=5)
    write_transcoders(tmp_path / "tc", model, threshold=0.3, skip=True, seed=4)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n", encoding="utf-8")
    return tmp_path


def _model(tmp_path):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(tmp_path / "model")


def _args(tmp, *extra):
    return [
        "experiment=attribution_graph",
        "model=hf",
        f"model.path={tmp / 'model'}",
        "model.attention=eager",
        f"dataset.path={tmp / 'prompts.jsonl'}",
        f"graph.transcoders={tmp / 'tc'}",
        "graph.batch=64",
        "progress=false",
        "render=false",
        *extra,
    ]


def _top(features, activations, layer, position):
    """The most active latent of `layer` at `position`, and its activation."""
    mine = (features[:, 0] == layer) & (features[:, 1] == position)
    assert mine.any()
    best = np.flatnonzero(mine)[np.argmax(activations[mine])]
    return int(features[best, 2]), float(activations[best])


def test_intervention_logits_equal_circuit_tracers(setup):
    tmp = setup
    clean = hookrun.run(_args(tmp), run_dir=tmp / "clean")
    with h5py.File(clean.path, "r") as f:
        g = f["graph/0"]
        tokens, features, acts = g["tokens"][()], g["features"][()], g["activations"][()]
        clean_logits = g["logits"][()]
    last = len(tokens) - 1
    f0, a0 = _top(features, acts, 0, last)
    f1, a1 = _top(features, acts, 1, last - 1)
    f2, _ = _top(features, acts, 2, last)
    f3, a3 = _top(features, acts, 0, 2)
    ours = [
        # layer 0 doubled, and layer 2's (recomputed under it) zeroed, at the last position
        [
            {"layer": 0, "position": -1, "latents": [f0], "op": "set", "value": 2 * a0},
            {"layer": 2, "position": last, "latents": [f2], "op": "zero"},
        ],
        # nothing edited before layer 1: its latents are the clean ones, scale = set
        {"layer": 1, "position": -2, "latents": [f1], "op": "scale", "value": 3.0},
        # the beginning of the text (no latents there: set adds value x decoder row), a clamp
        [
            {"layer": 0, "position": 0, "latents": [3], "op": "set", "value": 5.0},
            {"layer": 0, "position": 2, "latents": [f3], "op": "clamp", "value": a3 / 4},
        ],
    ]
    theirs = [
        [[0, last, f0, 2 * a0], [2, last, f2, 0.0]],
        [[1, last - 1, f1, 3.0 * a1]],
        [[0, 0, 3, 5.0], [0, 2, f3, a3 / 4]],
    ]
    arg = "graph.interventions=" + json.dumps(ours).replace('"', "")
    result = hookrun.run(_args(tmp, arg), run_dir=tmp / "run")
    with h5py.File(result.path, "r") as f:
        assert f.attrs["interventions"] == 3
        got = f["graph/0/intervention_logits"][()]
        assert np.array_equal(f["graph/0/logits"][()], clean_logits)
        assert "intervention 2:" in result.summary
    ref = run_reference(
        {
            "model": str(tmp / "model"),
            "transcoders": str(tmp / "tc"),
            "tokens": tokens.tolist(),
            "max_n_logits": 10,
            "desired_logit_prob": 0.95,
            "batch_size": 64,
            "max_feature_nodes": 8,
            "node_threshold": 0.8,
            "edge_threshold": 0.98,
            "intervention_sets": theirs,
        },
        tmp,
    )["intervention_set_logits"].numpy()
    assert got.shape == ref.shape == (3, clean_logits.shape[0])
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(got, ref, atol=1e-5 * scale)
    for k in range(3):  # every intervention moved the logits, far beyond the tolerance
        assert np.abs(got[k] - clean_logits).max() > 1e-2 * scale


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[{layer:7,position:-1,latents:[1]}]", r"graph.interventions\[0\].layer: 7; valid: a "),
        ("[{layer:0,position:-1,latents:[96]}]", r"\[0\].latents: 96; valid: latents below "),
        ("[{layer:0,position:30,latents:[1]}]", r"\[0\].position: 30 on a prompt of \d+ tokens"),
        ("[{layer:0,position:1,latents:[1],op:flip}]", r"\[0\].op: 'flip'; valid: zero, scale"),
        ("[{layer:0,position:1,latents:[1],op:set}]", r"\[0\].value: None with op set"),
        ("[{position:1,latents:[1]}]", r"\[0\]: layer and position missing"),
        ("[{layer:0,position:1,latent:[1]}]", r"\[0\]: latent unknown; valid: layer, position"),
        (
            "[[{layer:0,position:1,latents:[1]},{layer:0,position:[2,1],latents:[2,1]}]]",
            r"\[0\]\[1\]: latent 1 of layer 0 at position 1 edited twice",
        ),
    ],
)
def test_bad_interventions_refused_in_one_line(setup, value, message):
    tmp = setup
    with pytest.raises(HookrunError, match=message) as err:
        hookrun.run(_args(tmp, f"graph.interventions={value}"), run_dir=tmp / "run")
    assert "\n" not in str(err.value)
    assert not (tmp / "run" / "captures.h5").exists()


def test_no_interventions_store_none(setup):
    result = hookrun.run(_args(setup), run_dir=setup / "run")
    with h5py.File(result.path, "r") as f:
        assert f.attrs["interventions"] == 0
        assert "intervention_logits" not in f["graph/0"]
        logits = torch.from_numpy(f["graph/0/logits"][()])
        tokens = torch.from_numpy(f["graph/0/tokens"][()])
    with torch.no_grad():
        want = _model(setup)(tokens[None]).logits[0, -1]
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


def test_one_edit_given_alone_is_one_intervention():
    from hookrun.stages.graph.config import parse_graph

    edit = {"layer": 1, "position": -1, "latents": [40], "op": "zero"}
    alone = parse_graph({"transcoders": "tc", "interventions": edit})
    listed = parse_graph({"transcoders": "tc", "interventions": [edit]})
    assert alone.interventions == listed.interventions
    assert len(alone.interventions) == 1 and alone.interventions[0][0].layer == 1
    assert parse_graph({"transcoders": "tc"}).interventions == []
