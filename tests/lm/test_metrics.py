"""The numbers an intervention needs (`metrics:`), against Hugging Face computed by hand row by
row: the loss equals `model(ids, labels=ids).loss` of the row alone, with the run's hooks
(a zeroed MLP, registered here by hand) and without; the per-token loss, the target's log
probability, the logit difference and the KL from the same logits — on prompts and on a text
corpus (packed, one row per document, from a `datasets` folder). A head-ablation multirun
puts each job's loss change in sweep_summary.csv."""

from __future__ import annotations

import csv

import h5py
import numpy as np
import pytest
import torch
from conftest import hookrun_cli, run_config
from lm_models import save_lm, tokenizer, write_jsonl

from hookrun.errors import HookrunError

ROWS = [
    {
        "prompt": "The cat sat on the",
        "answer": " mat",
        "counterfactual": "The dog sat on the",
        "counterfactual_answer": " cat",
    },
    {
        "prompt": "A quick brown fox jumps over the lazy",
        "answer": " dog",
        "counterfactual": "A quick brown cat jumps over the lazy",
        "counterfactual_answer": " cat",
    },
    {
        "prompt": "Hooks capture",
        "answer": " every",
        "counterfactual": "Hooks return",
        "counterfactual_answer": " the",
    },
]
MLP = {"gpt2": "transformer.h.1.mlp", "llama": "model.layers.1.mlp"}


def _args(tmp_path, *extra: str) -> list[str]:
    return [
        "model=hf",
        f"model.path={tmp_path / 'lm'}",
        "model.attention=eager",
        "dataset=prompts",
        f"dataset.path={tmp_path / 'prompts.jsonl'}",
        "batch_size=3",
        "render=false",
        *extra,
    ]


def _read(path) -> dict[str, np.ndarray]:
    with h5py.File(path) as f:
        return {k: f[f"metrics/{k}"][()] for k in f["metrics"]}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_each_metric_equals_hugging_face_by_hand(tmp_path, family):
    model, _ = save_lm(tmp_path / "lm", family)
    write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    zero = [
        f"++hooks.z.select.name={MLP[family]}",
        "++hooks.z.at=output",
        "++hooks.z.action=zero",
    ]
    names = "++metrics.names=[loss,token_loss,answer_logprob,logit_diff,kl]"
    result = run_config(tmp_path / "run", _args(tmp_path, "target.kind=logit_diff", names, *zero))
    got = _read(result.path)
    tok = tokenizer()
    handle = None
    for hooked in (False, True):
        if hooked:
            module = dict(model.named_modules())[MLP[family]]
            handle = module.register_forward_hook(lambda m, a, o: torch.zeros_like(o))
        suffix = "" if hooked else "_unhooked"
        for r, row in enumerate(ROWS):
            ids = torch.tensor([tok(row["prompt"])["input_ids"]])
            answer = tok(row["answer"])["input_ids"][0]
            other = tok(row["counterfactual_answer"])["input_ids"][0]
            with torch.no_grad():
                out = model(ids, labels=ids)
            np.testing.assert_allclose(got[f"loss{suffix}"][r], float(out.loss), atol=1e-5)
            logp = out.logits[0].log_softmax(-1)
            per_token = -logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
            n = ids.shape[1]
            np.testing.assert_allclose(got[f"token_loss{suffix}"][r, : n - 1], per_token, atol=1e-5)
            assert np.isnan(got[f"token_loss{suffix}"][r, n - 1 :]).all()
            np.testing.assert_allclose(
                got[f"answer_logprob{suffix}"][r], float(logp[-1, answer]), atol=1e-5
            )
            diff = float(out.logits[0, -1, answer] - out.logits[0, -1, other])
            np.testing.assert_allclose(got[f"logit_diff{suffix}"][r], diff, atol=1e-5)
    handle.remove()
    for r, row in enumerate(ROWS):  # KL(unhooked ‖ hooked), the mean over the row's tokens
        ids = torch.tensor([tok(row["prompt"])["input_ids"]])
        with torch.no_grad():
            plain = model(ids).logits[0].log_softmax(-1)
            handle = dict(model.named_modules())[MLP[family]].register_forward_hook(
                lambda m, a, o: torch.zeros_like(o)
            )
            zeroed = model(ids).logits[0].log_softmax(-1)
            handle.remove()
        want = float((plain.exp() * (plain - zeroed)).sum(-1).mean())
        np.testing.assert_allclose(got["kl"][r], want, atol=1e-5)
    assert (got["loss"] != got["loss_unhooked"]).all()  # the hook took part in the hooked pass
    # The KL's direction said in words, in the file and in the summary.
    with h5py.File(result.path) as f:
        meaning = f["metrics/kl"].attrs["meaning"]
    assert meaning.startswith("the unhooked model is the reference: the mean over the row's")
    assert "sum_v p_unhooked(v) * (log p_unhooked(v) - log p_hooked(v))" in meaning
    line = next(x for x in result.summary.splitlines() if x.startswith("metrics: kl "))
    assert "(KL(unhooked ‖ hooked): the unhooked model's next-token distribution is the ref" in line


DOCS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Hooks capture activations of every block.",
    "def add(a, b): return a + b",
]
CONTEXT = 8


def _corpus_rows(pack: bool) -> list[list[int]]:
    """The corpus's rows cut by hand: the documents tokenized alone and joined by the end
    token into rows of CONTEXT (the partial last row dropped), or one row per document cut
    to CONTEXT."""
    tok = tokenizer()
    docs = [tok(d, add_special_tokens=False)["input_ids"] for d in DOCS]
    if not pack:
        return [d[:CONTEXT] for d in docs]
    stream = [t for k, d in enumerate(docs) for t in d + [tok.eos_token_id] * (k < len(DOCS) - 1)]
    return [stream[i : i + CONTEXT] for i in range(0, len(stream) // CONTEXT * CONTEXT, CONTEXT)]


@pytest.mark.parametrize(("kind", "pack"), [("text", True), ("hf_disk", False)])
def test_metrics_on_a_text_corpus_equal_hugging_face_by_hand(tmp_path, kind, pack):
    """dataset=text (packed) and dataset=hf_disk (a row per document): the token cache's rows
    plan and score as prompts do; each row's loss and next-token log probability, with a
    zeroed MLP and without, equal the model's by hand on the rows cut by hand."""
    model, _ = save_lm(tmp_path / "lm", "gpt2")
    if kind == "hf_disk":
        import datasets

        path = tmp_path / "ds"
        datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(path))
    else:
        path = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in DOCS])
    args = [
        "model=hf",
        f"model.path={tmp_path / 'lm'}",
        f"dataset={kind}",
        f"dataset.path={path}",
        f"dataset.context={CONTEXT}",
        f"dataset.pack={str(pack).lower()}",
        "target.kind=next_token",
        "metrics=lm",
        "batch_size=2",
        "render=false",
        f"++hooks.z.select.name={MLP['gpt2']}",
        "++hooks.z.at=output",
        "++hooks.z.action=zero",
    ]
    got = _read(run_config(tmp_path / "run", args).path)
    rows = _corpus_rows(pack)
    assert len(got["loss"]) == len(rows) >= 2
    mlp = dict(model.named_modules())[MLP["gpt2"]]
    for suffix, hooked in (("_unhooked", False), ("", True)):
        handle = mlp.register_forward_hook(lambda m, a, o: torch.zeros_like(o)) if hooked else None
        try:
            for r, row in enumerate(rows):
                ids = torch.tensor([row])
                with torch.no_grad():
                    out = model(ids, labels=ids)
                np.testing.assert_allclose(got[f"loss{suffix}"][r], float(out.loss), atol=1e-5)
                # The read position is the second-to-last token; its label the last.
                want = float(out.logits[0, -2].log_softmax(-1)[row[-1]])
                np.testing.assert_allclose(got[f"answer_logprob{suffix}"][r], want, atol=1e-5)
        finally:
            if handle is not None:
                handle.remove()


def test_the_memory_check_counts_the_rows_a_batch_can_have(tmp_path):
    """3 rows with batch_size 10**9: a batch holds 3 rows, and the logits of 3 fit."""
    save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    huge = [a for a in _args(tmp_path, "metrics=lm", "target.kind=answer") if a != "batch_size=3"]
    result = run_config(tmp_path / "run", [*huge, f"batch_size={10**9}"])
    assert _read(result.path)["loss"].shape == (3,)


@pytest.mark.slow
def test_a_head_ablation_sweep_has_a_loss_change_column_per_job(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    head = [
        "++hooks.h.select.name=transformer.h.0.attn",
        "++hooks.h.at=pattern",
        "++hooks.h.action=zero",
        "target.kind=answer",
        "metrics=lm",
        "progress=false",
    ]
    proc = hookrun_cli(
        [
            "-m",
            *_args(tmp_path, *head),
            "++hooks.h.args.heads=[0],[1]",
            f"hydra.sweep.dir={tmp_path / 's'}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "s" / "sweep_summary.csv") as f:
        jobs = list(csv.DictReader(f))
    assert len(jobs) == 2
    for job in jobs:
        got = _read(job["file"])
        change = float(np.mean(got["loss"]) - np.mean(got["loss_unhooked"]))
        np.testing.assert_allclose(float(job["metrics:loss_change"]), change, rtol=1e-6)
        assert float(job["metrics:kl"]) > 0
    assert jobs[0]["metrics:loss_change"] != jobs[1]["metrics:loss_change"]
    # The heads ranked: the larger loss change (the head the model needs more) first.
    with open(tmp_path / "s" / "metrics_ranking.csv") as f:
        ranked = list(csv.DictReader(f))
    by_job = {job["job"]: float(job["metrics:loss_change"]) for job in jobs}
    want = sorted(by_job, key=by_job.get, reverse=True)
    assert [r["job"] for r in ranked] == want and [r["rank"] for r in ranked] == ["1", "2"]
    assert [float(r["change"]) for r in ranked] == [by_job[j] for j in want]
    assert "heads=[" in ranked[0]["overrides"]


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["++metrics.names=[loss,perplexity]"], "metrics.names[1]: 'perplexity'"),
        (["metrics=lm", "metrics.names=null"], "metrics.names: null; valid: a list of any of"),
        (["metrics=lm", "metrics.names=kl"], "metrics.names: 'kl'; valid: a list of any of"),
        (["++metrics.rank_by=kl"], "metrics.rank_by: 'kl'; valid: one of metrics.names with"),
        (["++metrics.names=[logit_diff]", "target.kind=answer"], "metrics.names: logit_diff with"),
        (
            ["++metrics.names=[answer_logprob]", "target.kind=none"],
            "answer_logprob with target.kind=none",
        ),
    ],
)
def test_refused_in_one_line_before_any_work(tmp_path, extra, said):
    save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", _args(tmp_path, *extra))
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run" / "captures.h5").exists()


@pytest.mark.slow
def test_a_null_metrics_group_is_refused_in_one_line(tmp_path):
    """`metrics=null` (Hydra's own refusal is a ValueError's traceback naming no group), on
    the command line, in a sweep and from Python: one line with the group's options."""
    said = "metrics=null: a config group takes one of its options; valid: lm, or no metrics="
    proc = hookrun_cli(["metrics=null", "render=false"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith(f"hookrun: error: {said}"), proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    import hookrun

    for overrides in (["metrics=null"], ["metrics=lm,null"], ["+metrics=null"]):
        with pytest.raises(HookrunError) as err:
            hookrun.compose(overrides)
        assert str(err.value).startswith(said) and "\n" not in str(err.value), overrides
    assert hookrun.compose(["metrics=lm"]).stage("metrics") is not None
