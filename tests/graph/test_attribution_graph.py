"""experiment=attribution_graph against circuit-tracer 0.5.0 (circuit_tracer_script.py in
.venv-circuit-tracer, itself checked against hand computations in
test_circuit_tracer_reference.py) on the same random GPT-2s and transcoders: the same active
features, logit nodes and selected features, the adjacency to 1e-4 of its largest entry, the
same pruned nodes and edges, cumulative scores and replacement/completeness scores, and the
same graph JSON; then the refusals."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from graph_models import run_reference, save_gpt2, write_transcoders

import hookrun
from hookrun.errors import HookrunError

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]

PROMPT = "def add(a, b): return"
VARIANTS = {
    "relu": ({"n_layer": 2}, {}, None),
    "jumprelu_skip": (
        {"n_layer": 3, "ln_f_scale": 40.0, "seed": 5},
        {"threshold": 0.3, "skip": True, "seed": 4},
        None,
    ),
    "max_feature_nodes": ({"n_layer": 2}, {}, 40),
}


def _setup(tmp_path, model_opts, tc_opts):
    model = save_gpt2(tmp_path / "model", **model_opts)
    write_transcoders(tmp_path / "tc", model, **tc_opts)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n", encoding="utf-8")
    return model, prompts


def _args(tmp_path, prompts, *extra):
    return [
        "experiment=attribution_graph",
        "model=hf",
        f"model.path={tmp_path / 'model'}",
        "model.attention=eager",
        f"dataset.path={prompts}",
        f"graph.transcoders={tmp_path / 'tc'}",
        "graph.batch=16",
        "progress=false",
        *extra,
    ]


def _csr_dense(g) -> torch.Tensor:
    crow, col, val = (
        torch.from_numpy(g[k][()]) for k in ("adjacency_crow", "adjacency_col", "adjacency_val")
    )
    n = crow.numel() - 1
    dense = torch.zeros(n, n)
    dense[torch.repeat_interleave(torch.arange(n), crow[1:] - crow[:-1]), col] = val
    return dense


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_graph_equals_circuit_tracer(variant, tmp_path):
    model_opts, tc_opts, max_features = VARIANTS[variant]
    _, prompts = _setup(tmp_path, model_opts, tc_opts)
    extra = [] if max_features is None else [f"graph.max_feature_nodes={max_features}"]
    result = hookrun.run(_args(tmp_path, prompts, *extra), run_dir=tmp_path / "run")
    with h5py.File(result.path, "r") as f:
        g = f["graph/0"]
        tokens = g["tokens"][()].tolist()
        assert tokens[0] == 0  # the BOS prepended: circuit-tracer's position 0
        ref = run_reference(
            {
                "model": str(tmp_path / "model"),
                "transcoders": str(tmp_path / "tc"),
                "tokens": tokens,
                "max_n_logits": 10,
                "desired_logit_prob": 0.95,
                "batch_size": 16,
                "max_feature_nodes": max_features,
                "node_threshold": 0.8,
                "edge_threshold": 0.98,
            },
            tmp_path,
        )
        assert np.array_equal(g["features"][()], ref["active_features"].numpy())
        np.testing.assert_allclose(g["activations"][()], ref["activation_values"], atol=1e-5)
        assert np.array_equal(g["selected"][()], ref["selected_features"].numpy())
        assert g["logit_tokens"][()].tolist() == ref["logit_tokens"].tolist()
        np.testing.assert_allclose(
            g["logit_probabilities"][()], ref["logit_probabilities"], rtol=1e-5
        )
        ours, theirs = _csr_dense(g), ref["adjacency_matrix"]
        assert ours.shape == theirs.shape
        scale = max(1.0, float(theirs.abs().max()))
        assert float((ours - theirs).abs().max()) <= 1e-4 * scale
        assert np.array_equal(g["node_mask"][()], ref["node_mask"].numpy())
        edges = torch.zeros(theirs.shape, dtype=torch.bool)
        crow = torch.from_numpy(g["adjacency_crow"][()])
        rows = torch.repeat_interleave(torch.arange(crow.numel() - 1), crow[1:] - crow[:-1])
        edges[rows, torch.from_numpy(g["adjacency_col"][()])] = torch.from_numpy(g["edge_mask"][()])
        assert torch.equal(edges, ref["edge_mask"])
        np.testing.assert_allclose(g["cumulative"][()], ref["cumulative_scores"], atol=1e-5)
        assert g.attrs["replacement_score"] == pytest.approx(ref["replacement_score"], abs=1e-5)
        assert g.attrs["completeness_score"] == pytest.approx(ref["completeness_score"], abs=1e-5)
    ours_json = json.loads((tmp_path / "run" / "graph" / "row-0.json").read_text(encoding="utf-8"))
    theirs_json = ref["graph_json"]
    assert ours_json["metadata"]["prompt_tokens"] == theirs_json["metadata"]["prompt_tokens"]

    def shape(node):
        return {k: v for k, v in node.items() if k not in ("influence", "activation", "token_prob")}

    key = lambda n: (n["node_id"], n["feature_type"])  # noqa: E731
    assert sorted(map(shape, ours_json["nodes"]), key=key) == sorted(
        map(shape, theirs_json["nodes"]), key=key
    )
    links = lambda j: sorted((x["source"], x["target"], round(x["weight"], 3)) for x in j["links"])  # noqa: E731
    assert len(ours_json["links"]) == len(theirs_json["links"])
    assert [x[:2] for x in links(ours_json)] == [x[:2] for x in links(theirs_json)]
    assert (tmp_path / "run" / "graph" / "graph-metadata.json").is_file()
    assert list((tmp_path / "run" / "images").rglob("*.png"))


@pytest.fixture
def small(tmp_path):
    _setup(tmp_path, {"n_layer": 2, "n_positions": 8}, {})
    return tmp_path


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["graph.node_threshold=0"], "graph.node_threshold: 0.0; valid: a number in (0, 1]"),
        (["graph.edge_threshold=1.5"], "graph.edge_threshold: 1.5; valid: a number in (0, 1]"),
        (["graph.batch=0"], "graph.batch: 0; valid: an integer >= 1"),
        (["graph.logit_probability=-0.1"], "graph.logit_probability: -0.1"),
    ],
)
def test_bad_values_refused_in_one_line(small, extra, message):
    prompts = small / "prompts.jsonl"
    with pytest.raises(
        HookrunError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ) as err:
        hookrun.run(_args(small, prompts, *extra), run_dir=small / "run")
    assert "\n" not in str(err.value)
    assert not (small / "run" / "captures.h5").exists()


def test_missing_layer_wrong_width_and_long_prompt_refused(small, tmp_path):
    prompts = small / "prompts.jsonl"
    (small / "tc" / "layer_1.safetensors").rename(small / "layer_1.keep")
    with pytest.raises(HookrunError, match=r"graph.transcoders: .* none for layers \[1\]"):
        hookrun.run(_args(small, prompts), run_dir=small / "run1")
    (small / "layer_1.keep").rename(small / "tc" / "layer_1.safetensors")
    model = save_gpt2(small / "wide", n_layer=2, n_embd=32, n_head=4, n_positions=8)
    del model
    args = _args(small, prompts)
    args[2] = f"model.path={small / 'wide'}"
    with pytest.raises(HookrunError, match=r"graph.transcoders: .* maps 64 -> 64 .* 32 -> 32"):
        hookrun.run(args, run_dir=small / "run2")
    long = small / "long.jsonl"
    long.write_text(json.dumps({"prompt": PROMPT * 4}) + "\n", encoding="utf-8")
    with pytest.raises(
        HookrunError, match=r"dataset.context: a prompt of \d+ tokens, the model has 8"
    ):
        hookrun.run(_args(small, long, "dataset.context=64"), run_dir=small / "run3")
    for run in ("run1", "run2", "run3"):
        assert not (small / run / "captures.h5").exists()


def test_kill_9_then_resume_leaves_a_complete_file_with_every_graph(tmp_path):
    """A real process killed (-9) mid-job, then `resume=true`: the file holds every prompt's
    graph, its JSON beside it, and verify finds it intact; a resume of a complete file
    changes nothing; a graph missing from a complete file is reported as damage."""
    import os
    import signal
    import subprocess
    import sys
    import time

    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "hookrun", "experiment=attribution_graph", "progress=false"]
    args.append(f"hydra.run.dir={run_dir}")
    proc = subprocess.Popen(args, cwd=tmp_path, start_new_session=True)
    time.sleep(4.0)  # model and transcoders loaded, graphs being computed (or not yet)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    path = run_dir / "captures.h5"
    if path.exists():  # the kill came after the rename: the file is whole already
        with h5py.File(path, "r") as f:
            assert f.attrs["status"] == "complete"
    done = subprocess.run([*args, "resume=true"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    prompts = ROOT / "hookrun/models/checkpoints/lens_prompts.jsonl"
    rows = len(prompts.read_text(encoding="utf-8").splitlines())
    with h5py.File(path, "r") as f:
        assert f.attrs["status"] == "complete" and f.attrs["rows"] == rows
        assert sorted(f["graph"], key=int) == [str(r) for r in range(rows)]
    for r in range(rows):
        assert json.loads((run_dir / "graph" / f"row-{r}.json").read_text())["links"]
    verified = subprocess.run(
        [sys.executable, "-m", "hookrun.verify", str(path)], capture_output=True, text=True
    )
    assert verified.returncode == 0, verified.stdout
    before = path.stat().st_mtime_ns
    again = subprocess.run([*args, "resume=true"], cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode == 0 and path.stat().st_mtime_ns == before
    with h5py.File(path, "a") as f:
        del f["graph/2/adjacency_val"]
    damaged = subprocess.run(
        [sys.executable, "-m", "hookrun.verify", str(path)], capture_output=True, text=True
    )
    assert damaged.returncode == 1 and "/graph/2/adjacency_val: missing" in damaged.stdout


def test_a_resume_after_kill_9_takes_the_graphs_already_computed(tmp_path):
    """Each graph is kept in a row file as soon as it is computed: a process killed (-9)
    once some are there, then resumed, computes only the rest (the log says how many it
    took), and its file equals an uninterrupted run's, dataset for dataset. The row files
    are gone once the file is whole."""
    import os
    import signal
    import subprocess
    import sys
    import time

    base = [sys.executable, "-m", "hookrun", "experiment=attribution_graph", "progress=false"]
    base.append("render=false")
    run_dir = tmp_path / "run"
    args = [*base, f"hydra.run.dir={run_dir}"]
    rows_dir = run_dir / "captures.h5.rows"
    proc = subprocess.Popen(args, cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(rows_dir.glob("row-*.h5"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    taken = len(list(rows_dir.glob("row-*.h5")))
    assert 3 <= taken < 8, taken  # killed with some graphs done and some not
    assert not (run_dir / "captures.h5").exists()
    done = subprocess.run([*args, "resume=true"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    log = (run_dir / "hookrun.log").read_text(encoding="utf-8")
    assert f"{taken} of 8 graphs taken from the row files of an earlier run" in log
    assert not rows_dir.exists()
    fresh = subprocess.run(
        [*base, f"hydra.run.dir={tmp_path / 'fresh'}"], cwd=tmp_path, capture_output=True
    )
    assert fresh.returncode == 0
    with (
        h5py.File(run_dir / "captures.h5", "r") as ours,
        h5py.File(tmp_path / "fresh" / "captures.h5", "r") as theirs,
    ):
        assert ours.attrs["rows"] == theirs.attrs["rows"] == 8
        for r in range(8):
            a, b = ours[f"graph/{r}"], theirs[f"graph/{r}"]
            assert sorted(a) == sorted(b)
            for name in a:
                assert np.array_equal(a[name][()], b[name][()]), (r, name)
            assert dict(a.attrs) == dict(b.attrs)
    verified = subprocess.run(
        [sys.executable, "-m", "hookrun.verify", str(run_dir / "captures.h5")],
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0, verified.stdout


def test_a_new_run_leaves_no_graph_files_of_an_earlier_one(tmp_path):
    """A run over a folder an earlier run of more prompts used (sink.overwrite=true): the
    JSON, pages and pictures are this run's only, as its listing says."""
    small = tmp_path
    _, prompts = _setup(small, {"n_layer": 2}, {})
    run_dir = small / "run"
    hookrun.run(_args(small, prompts, "render=true"), run_dir=run_dir)
    images = run_dir / "images" / "attribution_graph"
    for stale in (run_dir / "graph" / "row-5.json", run_dir / "graph" / "row-5.html"):
        stale.write_text("{}", encoding="utf-8")
    (images / "attribution_graph_row5.png").write_bytes(b"")
    hookrun.run(_args(small, prompts, "render=true", "sink.overwrite=true"), run_dir=run_dir)
    assert sorted(p.name for p in (run_dir / "graph").iterdir()) == [
        "graph-metadata.json",
        "row-0.html",
        "row-0.json",
    ]
    assert [p.name for p in images.iterdir()] == ["attribution_graph_row0.png"]


def test_transcoders_reading_hook_mlp_in_are_refused(small):
    """TransformerLens's hook_mlp_in is the residual before ln_2, a path the frozen model does
    not carry: refused in one line, naming the reads it does carry."""
    config = small / "tc" / "config.yaml"
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace("ln2.hook_normalized", "hook_mlp_in"), encoding="utf-8")
    valid = r"valid: an MLP's input \(blocks.<i>.ln2.hook_normalized, blocks.<i>.mlp.hook_in\)"
    with pytest.raises(HookrunError, match=r"reads 'blocks.0.hook_mlp_in'; " + valid) as err:
        hookrun.run(_args(small, small / "prompts.jsonl"), run_dir=small / "run")
    assert "\n" not in str(err.value)
    assert not (small / "run" / "captures.h5").exists()
