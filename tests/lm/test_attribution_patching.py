"""Attribution patching (patching.method: atp, atp_ig; issue 31): each cell equals the
first-order formula computed by hand with autograd on the same Hugging Face model, each
row run alone — (a_clean − a_corrupted) · ∂ logit_diff / ∂a, the gradient averaged over runs
whose input embeddings (`inputs_embeds`) lie k/steps of the way from the corrupted prompt to
the clean one — divided by clean − corrupted; atp_ig with one step is atp; beside exact, the
error and the correlations are stored."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from conftest import run_config
from lm_models import save_lm, tokenizer
from test_lm_patching import HEADS, MODULES, ROWS, _args, _first_tensor, _prompts

from hookrun.errors import HookrunError

SITES = ("resid", "attn", "mlp", "heads")


def _hand_attribution(model, family: str, row: tuple, steps: int) -> dict[str, np.ndarray]:
    """Each site kind's (layers, [heads,] T) cells of one row, by hand."""
    tok = tokenizer()
    prompt, answer, counterfactual, wrong = row
    clean_ids = torch.tensor([tok(prompt)["input_ids"]])
    corrupt_ids = torch.tensor([tok(counterfactual)["input_ids"]])
    right_id, wrong_id = tok(answer)["input_ids"][0], tok(wrong)["input_ids"][0]
    named = dict(model.named_modules())
    layers = model.config.num_hidden_layers

    def run(ids=None, embeds=None, grad=False):
        seen = {kind: [] for kind in SITES}
        handles = []
        for kind in SITES:
            for layer in range(layers):
                module = named[MODULES[family][kind].format(layer)]
                if kind == "heads":
                    handles.append(
                        module.register_forward_pre_hook(lambda m, a, k=kind: seen[k].append(a[0]))
                    )
                else:
                    handles.append(
                        module.register_forward_hook(
                            lambda m, a, o, k=kind: seen[k].append(_first_tensor(o))
                        )
                    )
        try:
            with torch.set_grad_enabled(grad):
                if embeds is not None:
                    logits = model(inputs_embeds=embeds).logits[0, -1]
                else:
                    logits = model(ids).logits[0, -1]
        finally:
            for h in handles:
                h.remove()
        return seen, logits[right_id] - logits[wrong_id]

    clean, clean_diff = run(clean_ids)
    corrupted, corrupt_diff = run(corrupt_ids)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        e_corrupt, e_clean = embed(corrupt_ids), embed(clean_ids)
    grads = {kind: [0.0] * layers for kind in SITES}
    for k in range(steps):
        embeds = (e_corrupt + (k / steps) * (e_clean - e_corrupt)).requires_grad_(True)
        seen, metric = run(embeds=embeds, grad=True)
        flat = [t for kind in SITES for t in seen[kind]]
        found = torch.autograd.grad(metric, flat)
        for i, kind in enumerate(SITES):
            for layer in range(layers):
                grads[kind][layer] = grads[kind][layer] + found[i * layers + layer] / steps
    gap = float(clean_diff - corrupt_diff)
    out = {}
    for kind in SITES:
        cells = []
        for layer in range(layers):
            product = (clean[kind][layer] - corrupted[kind][layer]).detach() * grads[kind][layer]
            product = product[0]  # (T, D)
            if kind == "heads":
                t, width = product.shape
                cells.append(product.view(t, HEADS, width // HEADS).sum(-1).T)  # (heads, T)
            else:
                cells.append(product.sum(-1))
        out[kind] = (torch.stack(cells) / gap).double().numpy()
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_atp_and_atp_ig_equal_the_first_order_formula_by_hand(tmp_path, family):
    model, _ = save_lm(tmp_path / "lm", family)
    data = _prompts(tmp_path / "p.jsonl")
    args = _args(
        tmp_path / "lm",
        data,
        "patching.sites=[resid,attn,mlp,heads]",
        "patching.method=[atp,atp_ig]",
        "patching.ig_steps=3",
    )
    path = run_config(tmp_path / "run", args).path
    with h5py.File(path) as f:
        got = {k: f[f"patching/{k}"][()] for k in f["patching"]}
    assert "resid" not in got and "resid_atp_error" not in got  # no exact grid asked
    for r, row in enumerate(ROWS):
        length = len(tokenizer()(row[0])["input_ids"])
        for method, steps in (("atp", 1), ("atp_ig", 3)):
            hand = _hand_attribution(model, family, row, steps)
            for kind in SITES:
                cells = got[f"{kind}_{method}"][r][..., :length]
                np.testing.assert_allclose(
                    cells,
                    hand[kind],
                    atol=1e-4,
                    rtol=1e-4,
                    err_msg=f"{family} row {r} {kind} {method}",
                )
                assert np.isnan(got[f"{kind}_{method}"][r][..., length:]).all()


def test_beside_exact_the_error_and_the_correlations_are_stored(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "p.jsonl")
    args = _args(tmp_path / "lm", data, "patching.method=[exact,atp,atp_ig]", "patching.ig_steps=1")
    args = [a for a in args if a != "render=false"]
    result = run_config(tmp_path / "run", args, experiment="lm_patching")
    drawn = tmp_path / "run" / "images" / "lm_patching"
    for name in ("patching_resid_agreement.png", "patching_resid_atp.png", "patching_resid.png"):
        assert (drawn / name).stat().st_size > 1000, name
    with h5py.File(result.path) as f:
        exact, atp, ig = (f[f"patching/resid{s}"][()] for s in ("", "_atp", "_atp_ig"))
        error = f["patching/resid_atp_error"][()]
        said = dict(f["patching/resid_atp"].attrs)
    np.testing.assert_array_equal(ig, atp)  # one step of atp_ig: the corrupted run, as atp
    both = np.isfinite(exact) & np.isfinite(atp)
    np.testing.assert_allclose(error[both], (atp - exact)[both], atol=1e-6)
    assert said["cells"] == both.sum()
    from scipy.stats import spearmanr

    assert abs(said["pearson"] - np.corrcoef(exact[both], atp[both])[0, 1]) < 1e-6
    assert abs(said["spearman"] - spearmanr(exact[both], atp[both]).statistic) < 1e-6
    assert "patching: resid atp against exact: Pearson" in result.summary


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (
            ["patching.method=fast"],
            "patching.method: 'fast' (did you mean 'atp'?); valid: exact, atp",
        ),
        (["patching.method=[atp,atp]"], "patching.method: ['atp', 'atp'] names a method twice"),
        (["patching.method=[exact,fast]"], "patching.method[1]: 'fast'"),
        (["patching.ig_steps=0"], "patching.ig_steps: 0 is out of range; valid: an integer >= 1"),
    ],
)
def test_bad_methods_are_refused_before_any_work(tmp_path, extra, said):
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "p.jsonl")
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", _args(tmp_path / "lm", data, *extra))
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_where_the_model_is_linear_after_the_patched_site_atp_is_exact(tmp_path):
    """A GPT-2 whose norms are linear (an epsilon so large that the variance does not count:
    (x − mean) / 1e4) and whose MLPs are (activation `linear`): from the last block's
    attention, heads, MLP or output to the logits every step is linear, so the first-order
    estimate is the patched run itself — atp equals the exact grid there, to float rounding."""
    import transformers

    tok = tokenizer()
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=HEADS,
        n_positions=64,
        vocab_size=len(tok) + 4,
        layer_norm_epsilon=1e6,
        activation_function="linear",
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # each sublayer's write as large as the stream it is added to
        for block in model.transformer.h:
            block.attn.c_proj.weight *= 1e3
            block.mlp.c_proj.weight *= 1e3
    model.save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    # Prompts whose last token is the one changed: the read position's own stream differs,
    # so clean − corrupted is large against float32's rounding of a near-linear model.
    rows = [
        ("A quick brown fox", " and", "A quick brown rat", " but"),
        ("The cat sat on the hat", " but", "The cat sat on the bed", " and"),
    ]
    data = _prompts(tmp_path / "p.jsonl", rows)
    args = _args(
        tmp_path / "lm",
        data,
        "patching.sites=[resid,attn,mlp,heads]",
        "patching.layer=1",
        "patching.method=[exact,atp]",
    )
    with h5py.File(run_config(tmp_path / "run", args).path) as f:
        for kind in SITES:
            exact, atp = f[f"patching/{kind}"][()], f[f"patching/{kind}_atp"][()]
            both = np.isfinite(exact)
            assert (np.isfinite(atp) == both).all()
            np.testing.assert_allclose(atp[both], exact[both], rtol=1e-4, atol=1e-6, err_msg=kind)
            assert np.abs(exact[both]).max() > 1e-4, kind  # the cells move the logits
