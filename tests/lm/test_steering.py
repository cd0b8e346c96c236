"""experiment=steering on the shipped tiny_lm: the vector is the difference of the two
prompt sets' mean block output at their last tokens, measured by hand with a forward hook
on each prompt alone; it is stored at /steering/vector/<site> with where it came from; the
effect (the answer's log probability change) equals a hand forward with the vector added;
and a layer x scale sweep ends in a ranking sorted by effect, with its picture."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import hookrun_cli, killed_after, read, run_config
from PIL import Image

from hookrun.errors import HookrunError

CHECKPOINTS = Path(__file__).resolve().parents[2] / "hookrun" / "models" / "checkpoints"
LAYER = "transformer.h.0"


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = CHECKPOINTS / "tiny_lm"
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (CHECKPOINTS / name).read_text().splitlines()]


def _block_output(model, ids: list[int], layer: str, added=None) -> torch.Tensor:
    """`layer`'s output over one row alone, `added` added to it (a hand forward hook);
    and the logits."""
    seen = {}

    def hook(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        if added is not None:
            first = first + torch.as_tensor(added, dtype=first.dtype)
        seen["out"] = first[0].double()
        return (first, *output[1:]) if isinstance(output, tuple) else first

    handle = dict(model.named_modules())[layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
    finally:
        handle.remove()
    return seen["out"], logits


def _hand_vector(model, tok, layer: str, bos: bool = False) -> np.ndarray:
    means = []
    lead = [tok.bos_token_id] if bos else []
    for name in ("steering_plus.jsonl", "steering_minus.jsonl"):
        last = [
            _block_output(model, lead + tok(r["prompt"])["input_ids"], layer)[0][-1]
            for r in _rows(name)
        ]
        means.append(torch.stack(last).mean(0))
    return (means[0] - means[1]).numpy()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_vector_is_measured_stored_and_added_as_by_hand(tiny, tmp_path):
    model, tok = tiny
    result = run_config(
        tmp_path / "run",
        ["experiment=steering", "steering.scale=1.5", "generate.max_new_tokens=3", "render=false"],
    )
    want = _hand_vector(model, tok, LAYER)
    key = f"steering/vector/{LAYER}/output"
    with h5py.File(result.path) as f:
        got = f[key][()]
        said = dict(f[key].attrs)
        group = dict(f["steering"].attrs)
        hooked = f["metrics/answer_logprob"][()]
        unhooked = f["metrics/answer_logprob_unhooked"][()]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    plus, minus = CHECKPOINTS / "steering_plus.jsonl", CHECKPOINTS / "steering_minus.jsonl"
    assert said["file"] == f"{plus.resolve()}, {minus.resolve()}"
    assert said["sha256"] == f"{_sha(plus)}, {_sha(minus)}"
    assert said["action"] == "add" and said["scale"] == 1.5 and said["hook"] == "steer"
    assert json.loads(said["source"])["plus"]["positions"] == "last"
    assert group["effect"] == "answer_logprob" and list(group["layers"]) == [LAYER]
    # The effect: each row's answer log probability with 1.5 x the hand vector added.
    for r, row in enumerate(_rows("steering_prompts.jsonl")):
        ids = tok(row["prompt"])["input_ids"]
        answer = tok(row["answer"])["input_ids"][0]
        for added, stored in ((1.5 * want, hooked), (None, unhooked)):
            logits = _block_output(model, ids, LAYER, added)[1]
            want_lp = float(logits[-1].double().log_softmax(-1)[answer])
            assert abs(float(stored[r]) - want_lp) < 1e-4, (r, added is None)
    assert float(np.mean(hooked - unhooked)) > 0.5  # the shipped sets steer toward " file"
    # python -m hookrun.verify: the vectors (no sample axis) are no damage.
    from hookrun.verify import verify

    assert result.summary.count("steering vector at ") == 1, result.summary  # no scale
    intact, said = verify(result.path)
    assert intact and said[-1].strip() == "intact", said


def test_prompts_with_a_bos_are_measured_with_it_and_the_scale_is_the_hooks(tiny, tmp_path):
    """dataset.prepend_bos=true: the prompt sets are read with it too; the /steering
    attributes say what the hook did (an override of hooks.steer's scale included)."""
    model, tok = tiny
    args = ["experiment=steering", "dataset.prepend_bos=true", "hooks.steer.args.scale=2.5"]
    args += ["generate.max_new_tokens=1", "limit=2", "render=false"]
    result = run_config(tmp_path / "run", args)
    with h5py.File(result.path) as f:
        got = f[f"steering/vector/{LAYER}/output"][()]
        group = dict(f["steering"].attrs)
    np.testing.assert_allclose(got, _hand_vector(model, tok, LAYER, bos=True), atol=1e-5)
    assert group["scale"] == 2.5 and list(group["layers"]) == [LAYER]


@pytest.mark.slow
def test_a_layer_by_scale_sweep_is_ranked_by_effect(tmp_path):
    proc = hookrun_cli(
        [
            "-m",
            "experiment=steering",
            "steering.layers=transformer.h.0,transformer.h.1",
            "steering.scale=0,1",
            "generate.max_new_tokens=3",
            "render=false",
            "progress=false",
            f"hydra.sweep.dir={tmp_path / 's'}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "s" / "steering_ranking.csv") as f:
        ranked = list(csv.DictReader(f))
    with open(tmp_path / "s" / "sweep_summary.csv") as f:
        jobs = {row["job"]: row for row in csv.DictReader(f)}
    assert len(ranked) == 4 and [int(r["rank"]) for r in ranked] == [1, 2, 3, 4]
    effects = [float(r["effect"]) for r in ranked]
    assert effects == sorted(effects, reverse=True)
    for row in ranked:
        with h5py.File(jobs[row["job"]]["file"]) as f:
            change = np.mean(f["metrics/answer_logprob"][()]) - np.mean(
                f["metrics/answer_logprob_unhooked"][()]
            )
            fluency = np.nanmean(f["generation/logprobs_unhooked"][()])
            layers = list(f["steering"].attrs["layers"])
        np.testing.assert_allclose(float(row["effect"]), change, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(float(row["fluency"]), fluency, rtol=1e-5)
        assert row["layers"] == layers[0] and f"steering.layers={layers[0]}" in row["overrides"]
        if float(row["scale"]) == 0:
            assert float(row["effect"]) == 0.0  # the vector times 0: the plain model
    assert ranked[0]["layers"] == LAYER and float(ranked[0]["scale"]) == 1.0
    with Image.open(tmp_path / "s" / "steering_ranking.png") as picture:
        assert picture.size[0] >= 400 and len(np.unique(np.asarray(picture.convert("L")))) > 10
    text = (tmp_path / "s" / "steering_ranking.md").read_text()
    assert text.count("\n| ") == 5 and "change of answer_logprob" in text


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["steering.effect=loss"], "steering.effect: 'loss'; valid: answer_logprob, logit_diff"),
        # The hook reads the value first: the refusal names where it went.
        (["steering.positions=first"], "vector.plus.positions: 'first'; valid: last, all"),
        (["steering.layers=[]"], "steering.layers: []; valid: one module name or a list"),
        (["steering.scale=nan"], "hooks.steer.args.scale: nan is not a finite number; valid:"),
        (["hooks.steer.args.scale=nan"], "hooks.steer.args.scale: nan is not a finite number; v"),
        # The hook's own scale given: steering.scale is read by nothing, and refused itself.
        (["hooks.steer.args.scale=2", "steering.scale=-inf"], "steering.scale: -inf; valid: a"),
        (["steering.effect=logit_diff"], "steering.effect: logit_diff with target.kind=answer;"),
        (["steering.effect=null"], "steering.effect: null; valid: answer_logprob, logit_diff"),
        (["~hooks.steer"], "steering: no hook adds or removes a vector; valid:"),
        (["steering.layers=3"], "steering.layers: 3; valid: one module name or a list"),
        (["steering.plus=null"], "hooks.steer.args.vector.plus.prompts: null; valid: a .jsonl"),
        (
            [
                "+hooks.again={select: {name: transformer.h.0}, at: output, action: add, "
                "args: {vector: {prompts: ${steering.plus}}}}"
            ],
            "hooks.again: a second vector at /captures/transformer.h.0/output (hooks.steer",
        ),
        (["steering.plus=nowhere.jsonl"], "hooks.steer.args.vector.plus.prompts: 'nowhere.jsonl'"),
    ],
)
def test_bad_steering_is_refused_before_any_work(tmp_path, extra, said):
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", ["experiment=steering", "render=false", *extra])
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run" / "captures.h5").exists()


@pytest.mark.slow
def test_killed_and_resumed_gives_the_same_file(tmp_path):
    """kill -9 mid-run, then resume: every dataset (the vector, the metrics, the text) is
    the uninterrupted run's; a second resume of the complete file changes nothing."""
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in _rows("steering_prompts.jsonl")]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))  # 32 rows, 16 batches
    args = [
        "experiment=steering",
        f"dataset.path={data}",
        "batch_size=2",
        "generate.max_new_tokens=4",
        "render=false",
        "progress=false",
    ]
    whole = read(run_config(tmp_path / "whole", args).path)
    run_dir = tmp_path / "killed"
    killed_after(args, tmp_path, run_dir, rows=4)
    for _ in range(2):
        done = hookrun_cli([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        got = read(run_dir / "captures.h5")
        assert got.keys() == whole.keys()
        assert "steering/vector/transformer.h.0/output" in got
        for key in whole:
            np.testing.assert_array_equal(got[key], whole[key], err_msg=key)


def test_the_effects_metric_is_computed_whatever_metrics_names_lists(tiny, tmp_path, caplog):
    """steering.effect=logit_diff with metrics.names=[loss]: the metrics stage computes the
    logit difference too (and says so in the log), each row's equal to a hand forward with
    the vector added; the ranking's effect is its change."""
    model, tok = tiny
    rows = [dict(r, counterfactual_answer=" list") for r in _rows("steering_prompts.jsonl")[:4]]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["experiment=steering", f"dataset.path={data}", "target.kind=logit_diff"]
    args += ["steering.effect=logit_diff", "metrics.names=[loss]", "generate.max_new_tokens=1"]
    with caplog.at_level("INFO", logger="hookrun"):
        result = run_config(tmp_path / "run", [*args, "render=false"])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("metrics: ")]
    assert "metrics: logit_diff computed too, for steering.effect (metrics.names: loss)" in said
    with h5py.File(result.path) as f:
        hooked, unhooked = f["metrics/logit_diff"][()], f["metrics/logit_diff_unhooked"][()]
        assert "metrics/answer_logprob" not in f and f["steering"].attrs["effect"] == "logit_diff"
    vector = _hand_vector(model, tok, LAYER)
    for r, row in enumerate(rows):
        ids = tok(row["prompt"])["input_ids"]
        answer, other = tok(row["answer"])["input_ids"][0], tok(" list")["input_ids"][0]
        for added, stored in ((vector, hooked), (None, unhooked)):
            logits = _block_output(model, ids, LAYER, added)[1][-1].double()
            assert abs(float(stored[r]) - float(logits[answer] - logits[other])) < 1e-4, r


def test_text_rows_are_steered(tiny, tmp_path):
    """dataset=text rows (the token cache's): the effect on each row's next token equals a
    hand forward of the row with the vector added."""
    model, tok = tiny
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Return the name of the file.\nOpen the list and read each line.\n")
    args = ["experiment=steering", "dataset=text", f"dataset.path={corpus}", "dataset.pack=false"]
    args += ["dataset.context=16", "target.kind=next_token", "generate.max_new_tokens=2"]
    result = run_config(tmp_path / "run", [*args, "render=false"])
    with h5py.File(result.path) as f:
        hooked = f["metrics/answer_logprob"][()]
        unhooked = f["metrics/answer_logprob_unhooked"][()]
    vector = _hand_vector(model, tok, LAYER)
    for r, line in enumerate(corpus.read_text().splitlines()):
        ids = tok(line, add_special_tokens=False)["input_ids"][:16]
        for added, stored in ((vector, hooked), (None, unhooked)):
            logits = _block_output(model, ids[:-1], LAYER, added)[1][-1].double()
            assert abs(float(stored[r]) - float(logits.log_softmax(-1)[ids[-1]])) < 1e-4, r
    assert (hooked != unhooked).all()


def test_steering_without_metrics_is_refused(tmp_path):
    """An experiment file's `metrics: null` under steering: nothing would measure the effect."""
    from conftest import compose_config

    from hookrun.config.build import build_spec
    from hookrun.pipeline.runner import execute

    cfg = compose_config(["experiment=steering", "render=false", "progress=false"])
    cfg.metrics = None
    with pytest.raises(HookrunError) as err:
        execute(build_spec(cfg, "steering"), tmp_path / "run")
    said = str(err.value)
    assert said.startswith("steering.effect: answer_logprob, but the run computes no metrics")
    assert "valid: metrics=lm" in said and not (tmp_path / "run" / "captures.h5").exists()
