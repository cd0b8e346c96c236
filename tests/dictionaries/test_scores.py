"""`sae_scores=default`: each spliced dictionary's scores over the run's tokens equal the
definitions computed by hand here (plain transformers passes on the tokens the run stored:
clean, the site replaced by the reconstruction, the site zeroed) — L0, explained variance
against the per-dimension mean, MSE per token, cosine, CE loss recovered, the KL score, dead
and dense latents; they are a whole-run result (the summary, sweep columns, a picture)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import hookrun_cli, run_config
from sae_folders import decode, encode, write_sae

import hookrun
from hookrun.errors import HookrunError

CHECKPOINTS = Path(__file__).resolve().parents[2] / "hookrun" / "models" / "checkpoints"
BLOCK = "transformer.h.1"
LATENTS = 96


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "tiny_lm").eval()


def _overrides(run_dir: Path, sae: Path, *extra: str) -> list[str]:
    return [
        "model=tiny_lm",
        "dataset=prompts",
        f"dataset.path={CHECKPOINTS / 'patching_prompts.jsonl'}",
        "limit=7",
        "batch_size=3",
        "target.kind=none",
        "sae_scores=default",
        "sae_scores.special=keep",  # every real token: the definitions below
        f"++hooks.sae.select.name={BLOCK}",
        "++hooks.sae.at=output",
        "++hooks.sae.action=sae",
        f"++hooks.sae.args.path={sae}",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def _logits(model, tokens, mask, change=None):
    seen = {}

    def hook(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        seen["x"] = first
        if change is not None:
            first = change(first)
        return (first, *output[1:]) if isinstance(output, tuple) else first

    handle = dict(model.named_modules())[BLOCK].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(input_ids=tokens, attention_mask=mask.long()).logits
    finally:
        handle.remove()
    return logits.double(), seen["x"]


def _hand_scores(model, sae, tokens, mask) -> dict[str, float]:
    clean, x = _logits(model, tokens, mask)
    z = encode(sae, x)
    rebuilt = decode(sae, z)
    spliced, _ = _logits(model, tokens, mask, lambda out: rebuilt)
    zeroed, _ = _logits(model, tokens, mask, torch.zeros_like)
    real = mask.bool()
    xs, rs, zs = x[real].double(), rebuilt[real].double(), z[real]
    mean = xs.mean(0)
    predicted = real[:, :-1] & real[:, 1:]
    following = tokens[:, 1:]

    def ce(logits):
        logp = torch.log_softmax(logits, -1)[:, :-1]
        return float(-logp.gather(-1, following[..., None])[..., 0][predicted].mean())

    def kl(logits):
        p = torch.log_softmax(clean, -1)
        q = torch.log_softmax(logits, -1)
        return float((p.exp() * (p - q)).sum(-1)[real].mean())

    fired = (zs != 0).sum(0)
    out = {
        "tokens": float(real.sum()),
        "l0": float((zs != 0).sum(-1).double().mean()),
        "explained_variance": float(1 - ((xs - rs) ** 2).sum() / ((xs - mean) ** 2).sum()),
        "mse": float(((xs - rs) ** 2).sum(-1).mean()),
        "cosine": float(torch.nn.functional.cosine_similarity(xs, rs, dim=-1).mean()),
        "ce_clean": ce(clean),
        "ce_spliced": ce(spliced),
        "ce_zero": ce(zeroed),
        "kl_spliced": kl(spliced),
        "kl_zero": kl(zeroed),
        "dead": float((fired == 0).sum()),
        "dense": float((fired > 0.1 * real.sum()).sum()),
    }
    out["ce_loss_score"] = (out["ce_zero"] - out["ce_spliced"]) / (out["ce_zero"] - out["ce_clean"])
    out["kl_div_score"] = (out["kl_zero"] - out["kl_spliced"]) / out["kl_zero"]
    return out


def test_the_scores_are_the_definitions(tiny, tmp_path):
    sae = write_sae(tmp_path / "sae", 128, LATENTS, seed=7)
    overrides = _overrides(tmp_path / "run", tmp_path / "sae", "sink.dtype=float16")
    result = run_config(tmp_path / "run", overrides)
    path = tmp_path / "run" / "captures.h5"
    with hookrun.open(path) as f:
        tokens = torch.as_tensor(f["samples/tokens"][:]).long()
        mask = torch.as_tensor(f["samples/mask"][:]).bool()
        ds = f[f"sae/{BLOCK}/output/scores"]
        stored = dict(zip([str(n) for n in ds.attrs["fields"]], ds[:], strict=True))
        assert f.status == "complete"
        # The sums the scores are made of keep float64 whatever sink.dtype (Stored.dtype).
        assert f[f"sae/{BLOCK}/output/score_rows"].dtype == "float64"
        assert f[f"sae/{BLOCK}/output/activation_sums"].dtype == "float64"
    want = _hand_scores(tiny, sae, tokens, mask)
    for name, value in want.items():
        assert stored[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert 0 < want["dead"] < LATENTS or want["dense"] > 0  # both counts mean something
    assert f"sae_scores: {BLOCK}/output:" in result.summary
    assert "ce_loss_score" in result.summary
    assert result.images is not None and (result.images / "sae_scores.png").is_file()


def test_scores_need_a_splice(tmp_path):
    overrides = [
        "model=tiny_lm",
        "dataset=prompts",
        f"dataset.path={CHECKPOINTS / 'patching_prompts.jsonl'}",
        "sae_scores=default",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    with pytest.raises(HookrunError, match="sae_scores: no hook splices a dictionary"):
        run_config(tmp_path / "run", overrides)
    assert not (tmp_path / "run" / "captures.h5").exists()


def test_dense_out_of_range_is_refused(tmp_path):
    write_sae(tmp_path / "sae", 128, LATENTS)
    overrides = _overrides(tmp_path / "run", tmp_path / "sae", "sae_scores.dense=1.5")
    with pytest.raises(HookrunError, match=r"sae_scores.dense: 1.5; valid: .*0 < dense <= 1"):
        run_config(tmp_path / "run", overrides)


def test_a_sweep_over_sae_folders_ranks_them(tmp_path):
    """A multirun over three SAE folders: sae_ranking.csv lists each job's dictionary by CE
    loss recovered, largest first, each figure its file's score."""
    folders = []
    for seed in (1, 2, 3):
        write_sae(tmp_path / f"sae{seed}", 128, LATENTS, seed=seed)
        folders.append(str(tmp_path / f"sae{seed}"))
    proc = hookrun_cli(
        [
            "-m",
            "experiment=sae",
            f"hooks.sae.args.path={','.join(folders)}",
            "limit=4",
            "render=false",
            "progress=false",
            f"hydra.sweep.dir={tmp_path / 's'}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "s" / "sae_ranking.csv") as f:
        ranked = list(csv.DictReader(f))
    with open(tmp_path / "s" / "sweep_summary.csv") as f:
        jobs = {row["job"]: row for row in csv.DictReader(f)}
    assert [int(r["rank"]) for r in ranked] == [1, 2, 3]
    values = [float(r["ce_loss_score"]) for r in ranked]
    assert values == sorted(values, reverse=True)
    for row in ranked:
        with hookrun.open(jobs[row["job"]]["file"]) as f:
            ds = f[f"sae/{BLOCK}/output/scores"]
            score = dict(zip([str(n) for n in ds.attrs["fields"]], ds[:], strict=True))
        assert float(row["ce_loss_score"]) == pytest.approx(score["ce_loss_score"], rel=1e-6)
        assert float(row["l0"]) == pytest.approx(score["l0"], rel=1e-6)
        assert row["site"] == f"{BLOCK}/output"
    assert (tmp_path / "s" / "sae_ranking.png").is_file()
