"""hookrun's splice (`action: sae`, `action: transcoder`) against SAELens 6.54's own splice,
end to end: SAELens builds and saves (save_model) a standard, topk, jumprelu and gated SAE
at blocks.1.hook_resid_post and a transcoder and a skip transcoder in place of block 0's MLP
(blocks.0.ln2.hook_normalized → blocks.0.hook_mlp_out), saelens_splice_script.py in the
SAELens venv (tests/reference_venvs.py). hookrun runs each folder on packed rows of the
tiny_lm heldout corpus, with and without the error term, with and without an edit (two
latents zeroed); SAELens's HookedSAETransformer.run_with_cache_with_saes runs the same
folders on the tokens hookrun stored (/samples/tokens), the edit a hook on the attached
SAE's hook_sae_acts_post. Compared: the latents (hookrun's record, dense, against the
cached hook_sae_acts_post, every position), the logits at every position (hookrun's
capture of lm_head) and /model/output (the logits at the read position, T − 2 for packed
rows with read: last).

The skip transcoder without the error term: SAELens's wrapper calls sae.decode, which has
no skip term (SkipTranscoder adds x @ W_skip.T in forward), so its recon numbers drop the
skip path; with the error term the skip cancels and the wrapper's numbers are the
transcoder's. There hookrun is compared with SAELens's own SkipTranscoder.forward spliced
by plain TransformerLens hooks (recon_forward), and the wrapper's numbers are checked to
differ from it by more than float noise (so the test notices if SAELens changes).

The two models are HF's GPT-2 (hookrun) and TransformerLens's of the same weights (float32
both): their activations differ by ~1e-5, so the tolerance is 1e-4 absolute, not the ulps
of test_against_saelens.py. A latent just at its cut may be on in one model and off in the
other; none does here (the test would show it as a difference of the latent's size).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_config
from safetensors.torch import load_file, save_file

import hookrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_venvs import saelens_python  # noqa: E402

SCRIPT = Path(__file__).with_name("saelens_splice_script.py")
TINY_LM = Path(__file__).resolve().parents[2] / "hookrun" / "models" / "checkpoints" / "tiny_lm"
ROWS, CONTEXT = 4, 32
ATOL = 1e-4
SAES = ("standard", "topk", "jumprelu", "gated")
TRANSCODERS = ("transcoder", "skip_transcoder")
MODES = ("error", "recon", "error_edit", "recon_edit")


def _saelens(*args) -> str:
    done = subprocess.run(
        [str(saelens_python()), str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "saelens 6.54.0" in done.stdout
    return done.stdout


def _hookrun(run_dir: Path, case: str, folder: Path, mode: str, edit: list[int]) -> Path:
    transcoder = case in TRANSCODERS
    args = {
        "path": str(folder),
        "error_term": str(mode.startswith("error")).lower(),
        "record": "[latents]",
    }
    if mode.endswith("edit"):
        args["edit"] = "{latents:[" + ",".join(map(str, edit)) + "],op:zero}"
    hook = {
        "select": "{name:" + ("transformer.h.0.mlp" if transcoder else "transformer.h.1") + "}",
        "at": "output",
        "action": "transcoder" if transcoder else "sae",
        "args": "{" + ",".join(f"{k}:{v}" for k, v in args.items()) + "}",
    }
    overrides = [
        "experiment=sae",
        "~sae_scores",  # the scores are test_scores_vs_saelens.py's
        f"dataset.context={CONTEXT}",
        "dataset.pack=true",
        f"limit={ROWS}",
        "batch_size=2",
        "render=false",
        f"hydra.run.dir={run_dir}",
        *(f"++hooks.sae.{k}={v}" for k, v in hook.items()),
        # every position's logits (the run's /model/output is the read position's only)
        "++hooks.logits={select:{name:lm_head},at:output,action:capture}",
    ]
    run_config(run_dir, overrides)
    return run_dir / "captures.h5"


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> dict:
    """Per (case, mode): hookrun's run file and SAELens's numbers on its tokens."""
    tmp = tmp_path_factory.mktemp("splice_vs_saelens")
    saes = tmp / "saes"
    _saelens("build", TINY_LM, saes)
    edits = json.loads((saes / "edits.json").read_text())
    runs, tokens = {}, None
    for case in (*SAES, *TRANSCODERS):
        for mode in MODES:
            path = _hookrun(tmp / f"{case}.{mode}", case, saes / case, mode, edits[case])
            with hookrun.open(path) as f:
                assert f.status == "complete"
                assert "samples/mask" not in f  # packed: every token real
                these = torch.as_tensor(f["samples/tokens"][:]).long()
            # every run reads the same rows: SAELens gets them once
            assert tokens is None or torch.equal(these, tokens)
            tokens = these
            runs[case, mode] = path
    assert tokens.shape == (ROWS, CONTEXT) and (tokens == 0).any()  # EOS separators inside
    save_file({"tokens": tokens}, str(tmp / "tokens.safetensors"))
    _saelens("splice", TINY_LM, saes, tmp / "tokens.safetensors")
    theirs = {p.name.removesuffix(".safetensors"): load_file(str(p)) for p in saes.glob("*.*.*")}
    theirs = {tuple(name.split(".")): v for name, v in theirs.items()}
    plain = load_file(str(saes / "plain.safetensors"))["logits"]
    return {"runs": runs, "theirs": theirs, "plain": plain, "edits": edits, "tokens": tokens}


def _site(case: str) -> str:
    return "transformer.h.0.mlp" if case in TRANSCODERS else "transformer.h.1"


def _ours(path: Path, case: str) -> dict[str, np.ndarray]:
    with hookrun.open(path) as f:
        return {
            "latents": f[f"sae/{_site(case)}/output/latents"][:],
            "logits": f["captures/lm_head/output"][:],
            "output": f["model/output"][:],
        }


def _reference(compared: dict, case: str, mode: str) -> dict[str, torch.Tensor]:
    """SAELens's numbers for (case, mode): for a skip transcoder without the error term,
    its own forward spliced by hooks (its wrapper drops the skip term: module docstring)."""
    theirs = dict(compared["theirs"][case, mode])
    if case == "skip_transcoder" and mode.startswith("recon"):
        theirs["logits"] = compared["theirs"][case, f"{mode}_forward"]["logits"]
    return theirs


CASES = [(case, mode) for case in (*SAES, *TRANSCODERS) for mode in MODES]


@pytest.mark.parametrize(("case", "mode"), CASES)
def test_logits_equal_saelens(compared, case, mode):
    ours = _ours(compared["runs"][case, mode], case)
    theirs = _reference(compared, case, mode)["logits"].numpy()
    assert ours["logits"].shape == theirs.shape == (ROWS, CONTEXT, 2048)
    diff = np.abs(ours["logits"] - theirs).max()
    print(f"{case} {mode}: logits max diff {diff:.2e}")
    np.testing.assert_allclose(ours["logits"], theirs, atol=ATOL, rtol=0)
    # /model/output holds the logits at the read position: T − 2 (read: last)
    np.testing.assert_allclose(ours["output"], theirs[:, CONTEXT - 2], atol=ATOL, rtol=0)
    moved = np.abs(theirs - compared["plain"].numpy()).max()
    if mode == "error":  # the error term keeps the model's outputs
        assert moved < ATOL
    else:  # the reconstruction or the edit changed the model: the comparison is not moot
        assert moved > 1e-2, moved


@pytest.mark.parametrize(("case", "mode"), CASES)
def test_latents_equal_saelens(compared, case, mode):
    """hookrun records the dictionary's own latents (before an edit): SAELens's cache of an
    unedited run at the same site (the edit's own cache holds the edited ones)."""
    ours = _ours(compared["runs"][case, mode], case)["latents"]
    theirs = compared["theirs"][case, mode.removesuffix("_edit")]["latents"].numpy()
    assert ours.shape == theirs.shape == (ROWS, CONTEXT, 256)
    fired = (theirs > 0).mean()
    assert 0.05 < fired < 0.6, fired  # latents fire: the comparison is not of zeros
    diff = np.abs(ours - theirs).max()
    print(f"{case} {mode}: latents max diff {diff:.2e}, fired {fired:.2f}")
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)
    assert ((ours > 0) == (theirs > 0)).all()  # the same latents on


@pytest.mark.parametrize("case", (*SAES, *TRANSCODERS))
def test_the_edit_zeroes_the_latents_saelens_zeroes(compared, case):
    """The edited run's cached latents are zero at the edit's latents and the same
    elsewhere: SAELens's hook did what hookrun's edit says."""
    edit = compared["edits"][case]
    edited = compared["theirs"][case, "error_edit"]["latents"]
    clean = compared["theirs"][case, "error"]["latents"]
    assert (edited[..., edit] == 0).all() and (clean[..., edit] > 0).any()
    keep = [j for j in range(clean.shape[-1]) if j not in edit]
    assert torch.equal(edited[..., keep], clean[..., keep])


def test_saelens_wrapper_drops_the_skip_term_without_the_error_term(compared):
    """Why the recon modes of the skip transcoder are compared with SAELens's forward: its
    HookedSAETransformer wrapper's numbers there are not the skip transcoder's."""
    for mode in ("recon", "recon_edit"):
        wrapper = compared["theirs"]["skip_transcoder", mode]["logits"]
        forward = compared["theirs"]["skip_transcoder", f"{mode}_forward"]["logits"]
        assert (wrapper - forward).abs().max() > 1e-2
    # with the error term the wrapper is the transcoder's own (hookrun's, above)
    for case in TRANSCODERS:
        wrapper = compared["theirs"][case, "error"]["logits"]
        torch.testing.assert_close(wrapper, compared["plain"], atol=ATOL, rtol=0)
