"""`sae_scores` against SAELens 6.54's own evals (`sae_lens.evals.run_evals`, every metric
on) of the same SAE on the same tokens: hookrun runs experiment=sae on the tiny GPT-2 and
the tokens it stored go to saelens_evals_script.py, which evaluates the same SAE folder
through a TransformerLens HookedTransformer of the same weights (its block-1 residual and
logits checked against HF's first) in the SAELens venv (tests/reference_venvs.py).

How SAELens defines each metric (sae_lens/evals.py) and how hookrun's compare:
- l0, mse (‖x − x̂‖² summed over the width, per token), cossim, kl_div_with_sae /
  kl_div_with_ablation (KL(clean ‖ changed) per position, every position) and the CE
  losses (TransformerLens's per-token loss, positions 0..T−2): per token, concatenated over
  the batches, then one mean — the batching does not enter, as in hookrun's sums.
- explained_variance: 1 − E‖x − x̂‖² / (E‖x‖² − ‖E x‖²) over all the tokens, the
  per-dimension mean (SAELens's ExplainedVarianceCalculator, after #665) = hookrun's.
  SAELens's `explained_variance_legacy` (a per-token ratio against the batch's mean,
  averaged) is the old formula hookrun does not give.
- ce_loss_score = (CE ablated − CE with SAE) / (CE ablated − CE clean), kl_div_score =
  (KL ablated − KL with SAE) / KL ablated: of the whole-run means, as hookrun's.
- dead / dense: from SAELens's feature_density (fired tokens / tokens) = 0 / > 0.1.
- Which tokens: by default SAELens drops the tokenizer's special tokens (BOS, EOS, PAD) from
  every metric, splices the SAE only at the other positions (the ablation zeroes all), and
  masks the CE by its input token (`mask[:, :-1]`); so does hookrun's default,
  `sae_scores.special=exclude` — the padded case compares the two defaults. With
  `sae_scores.special=keep` hookrun counts every real token and a CE term only where the
  next token is real too: the packed case (rows holding EOS separators, id 0, also the tiny
  tokenizer's BOS and PAD) compares it with SAELens's exclude_special_tokens=False.

float32 in SAELens and TransformerLens (HF's GPT-2 in hookrun, float64 sums): the two
models' residuals differ by ~1e-5 at most, the scores by ~1e-7 relative: rel 1e-6 here,
not the ulps of test_against_saelens.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_config
from sae_folders import encode, write_sae
from safetensors.torch import save_file

import hookrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_venvs import saelens_python  # noqa: E402

SCRIPT = Path(__file__).with_name("saelens_evals_script.py")
TINY_LM = Path(__file__).resolve().parents[2] / "hookrun" / "models" / "checkpoints" / "tiny_lm"
BLOCK = "transformer.h.1"
ROWS, BATCH, CONTEXT = 6, 3, 64
LATENTS, DEAD = 96, 4

# hookrun's score -> SAELens's metric of the same definition
SAME = {
    "l0": "l0",
    "mse": "mse",
    "explained_variance": "explained_variance",
    "cosine": "cossim",
    "ce_clean": "ce_loss_without_sae",
    "ce_spliced": "ce_loss_with_sae",
    "ce_zero": "ce_loss_with_ablation",
    "ce_loss_score": "ce_loss_score",
    "kl_spliced": "kl_div_with_sae",
    "kl_zero": "kl_div_with_ablation",
    "kl_div_score": "kl_div_score",
    "dead": "dead",
    "dense": "dense",
}


def _fitted_sae(folder: Path) -> None:
    """A standard SAE that reconstructs the site fairly (a random one makes every ratio
    score negative, a weak check of CE loss recovered and the KL score): sae_folders's
    seeded encoder with b_dec the activations' mean, the decoder fitted by least squares on
    held-out text (rows the run does not read), and a few latents that cannot fire."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tensors = write_sae(folder, 128, LATENTS, seed=7, hook_name="blocks.1.hook_resid_post")
    tokenizer = AutoTokenizer.from_pretrained(TINY_LM)
    model = AutoModelForCausalLM.from_pretrained(TINY_LM).eval()
    lines = (TINY_LM / "heldout.jsonl").read_text().splitlines()[-40:]
    ids = [i for line in lines for i in tokenizer(json.loads(line)["text"])["input_ids"]]
    rows = torch.tensor(ids[: 4 * 128]).reshape(4, 128)
    seen = {}

    def keep(module, args, output) -> None:
        seen["x"] = output[0] if isinstance(output, tuple) else output

    handle = model.transformer.h[1].register_forward_hook(keep)
    with torch.no_grad():
        model(input_ids=rows)
    handle.remove()
    x = seen["x"].reshape(-1, 128)
    tensors["b_dec"] = x.mean(0)
    tensors["b_enc"][:DEAD] = -1e3
    z = encode(tensors, x)
    tensors["W_dec"] = torch.linalg.lstsq(z, x - tensors["b_dec"]).solution.contiguous()
    save_file(tensors, str(folder / "sae_weights.safetensors"))


@pytest.fixture(scope="module")
def sae(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sae") / "sae"
    _fitted_sae(folder)
    return folder


@pytest.fixture(scope="module", params=["packed", "padded"])
def compared(request, sae, tmp_path_factory) -> tuple[str, dict[str, float], dict]:
    """hookrun's scores and SAELens's evals of one SAE on the same rows: packed (no
    padding, SAELens counting every token) or one document a row, right-padded (SAELens's
    default: its special tokens, here only the pads, left out)."""
    rows = request.param
    tmp = tmp_path_factory.mktemp(f"scores_vs_saelens_{rows}")
    run_dir = tmp / "run"
    overrides = [
        "experiment=sae",
        f"hooks.sae.args.path={sae}",
        f"dataset.context={CONTEXT}",
        f"dataset.pack={rows == 'packed'}",
        f"sae_scores.special={'keep' if rows == 'packed' else 'exclude'}",
        f"limit={ROWS}",
        f"batch_size={BATCH}",  # = SAELens's batch_size_prompts, though neither averages by batch
        "render=false",
        f"hydra.run.dir={run_dir}",
    ]
    run_config(run_dir, overrides)
    with hookrun.open(run_dir / "captures.h5") as f:
        assert f.status == "complete"
        tokens = torch.as_tensor(f["samples/tokens"][:]).long()
        # packed rows store no mask: every token is real
        mask = torch.as_tensor(f["samples/mask"][:]).bool() if "samples/mask" in f else None
        ds = f[f"sae/{BLOCK}/output/scores"]
        ours = dict(zip([str(n) for n in ds.attrs["fields"]], map(float, ds[:]), strict=True))
    assert tokens.shape == (ROWS, CONTEXT)
    ignore = []
    if rows == "packed":
        assert mask is None and (tokens == 0).any()  # EOS separators inside
    else:
        # right padding with id 0, and id 0 nowhere else: SAELens's special tokens
        # (BOS = EOS = PAD = 0) are then exactly hookrun's padding
        assert mask is not None and not mask.all() and ((tokens == 0) == ~mask).all()
        ignore = ["0"]
    save_file({"tokens": tokens}, str(tmp / "tokens.safetensors"))
    out = tmp / "saelens.json"
    args = [TINY_LM, sae, tmp / "tokens.safetensors", out, BATCH, *ignore]
    done = subprocess.run(
        [str(saelens_python()), str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return rows, ours, json.loads(out.read_text())


def test_transformer_lens_model_is_hf_model(compared):
    _, _, theirs = compared
    assert theirs["saelens"] == "6.54.0"
    # the same residual stream the SAE reads, and the same logits, to float32 noise
    assert theirs["resid_max_diff"] < 1e-4
    assert theirs["logits_max_diff"] < 1e-3


@pytest.mark.parametrize("score", sorted(SAME))
def test_score_equals_saelens(compared, score):
    _, ours, theirs = compared
    assert ours[score] == pytest.approx(theirs[SAME[score]], rel=1e-6, abs=1e-6), score


def test_the_token_counts(compared):
    rows, ours, theirs = compared
    # SAELens reports rows x context whatever it leaves out; hookrun the tokens it counted
    assert theirs["total_tokens_eval_sparsity_variance"] == ROWS * CONTEXT
    assert (ours["tokens"] == ROWS * CONTEXT) == (rows == "packed")


def test_the_counts_mean_something(compared):
    _, ours, _ = compared
    assert ours["dead"] >= DEAD and 0 < ours["dense"] < LATENTS
    assert 0 < ours["explained_variance"] < 1
    assert 0 < ours["ce_loss_score"] < 1 and 0 < ours["kl_div_score"] < 1
