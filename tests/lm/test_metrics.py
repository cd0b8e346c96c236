"""The numbers an intervention needs (`metrics:`), against Hugging Face computed by hand row by
row: the loss equals `model(ids, labels=ids).loss` of the row alone, with the run's hooks
(a zeroed MLP, registered here by hand) and without; the per-token loss, the target's log
probability, the logit difference and the KL from the same logits. A head-ablation multirun
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
    got = _read(
        run_config(tmp_path / "run", _args(tmp_path, "target.kind=logit_diff", names, *zero)).path
    )
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
