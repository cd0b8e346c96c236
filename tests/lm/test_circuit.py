"""experiment=circuit (issue 31): each edge's EAP score equals the formula computed by hand
on the same Hugging Face model, each row run alone — (the sender's clean write − its
corrupted write) · the gradient of the logit difference at the receiver's norm input, that
gradient taken through the receiver alone (a copy of the input handed to its norm) —
with each head's write its slice of the output projection's input times that slice of the
weight; EAP-IG averages the gradient over runs with `inputs_embeds` interpolated."""

from __future__ import annotations

import warnings

import h5py
import numpy as np
import pytest
import torch
from conftest import run_config
from lm_models import save_lm, tokenizer
from test_lm_patching import HEADS, ROWS, _prompts

from hookrun.errors import HookrunError

NAMES = {
    "gpt2": {
        "proj": "transformer.h.{}.attn.c_proj",
        "mlp": "transformer.h.{}.mlp",
        "norms": ("transformer.h.{}.ln_1", "transformer.h.{}.ln_2"),
        "final": "transformer.ln_f",
    },
    "llama": {
        "proj": "model.layers.{}.self_attn.o_proj",
        "mlp": "model.layers.{}.mlp",
        "norms": ("model.layers.{}.input_layernorm", "model.layers.{}.post_attention_layernorm"),
        "final": "model.norm",
    },
}


def _args(folder, data, *extra):
    return [
        "experiment=circuit",
        "model=hf",
        f"model.path={folder}",
        f"dataset.path={data}",
        "batch_size=2",
        "render=false",
        *extra,
    ]


def _hand_writes(model, family, ids):
    """embed (T, D), then per layer each head's write (T, D) and the MLP's (T, D)."""
    names, named = NAMES[family], dict(model.named_modules())
    layers = model.config.num_hidden_layers
    seen = {}
    hooks = [
        named[names["norms"][0].format(0)].register_forward_pre_hook(
            lambda m, a: seen.__setitem__("embed", a[0][0].clone())
        )
    ]
    for layer in range(layers):
        hooks.append(
            named[names["proj"].format(layer)].register_forward_pre_hook(
                lambda m, a, k=f"z{layer}": seen.__setitem__(k, a[0][0].clone())
            )
        )
        hooks.append(
            named[names["mlp"].format(layer)].register_forward_hook(
                lambda m, a, o, k=f"m{layer}": seen.__setitem__(k, o[0].clone())
            )
        )
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    writes = [seen["embed"]]
    for layer in range(layers):
        z = seen[f"z{layer}"]
        weight = named[names["proj"].format(layer)].weight
        dh = z.shape[-1] // HEADS
        for h in range(HEADS):
            part = slice(h * dh, (h + 1) * dh)
            if family == "gpt2":  # Conv1D: x @ W, W (in, out)
                writes.append(z[:, part] @ weight[part, :])
            else:  # Linear: x @ W.T, W (out, in)
                writes.append(z[:, part] @ weight[:, part].T)
        writes.append(seen[f"m{layer}"])
    return writes


def _hand_gradients(model, family, corrupt, clean, answers, steps):
    """Each receiver's gradient (T, D): a0, m0, a1, m1, ..., logits."""
    names, named = NAMES[family], dict(model.named_modules())
    layers = model.config.num_hidden_layers
    norms = [names["norms"][i].format(layer) for layer in range(layers) for i in (0, 1)]
    norms.append(names["final"])
    embed = model.get_input_embeddings()
    with torch.no_grad():
        e_corrupt, e_clean = embed(torch.tensor([corrupt])), embed(torch.tensor([clean]))
    total = None
    for k in range(steps):
        copies = {}

        def copy(module, args, key, copies=copies):
            mine = args[0].clone()
            mine.retain_grad()
            copies[key] = mine
            return (mine, *args[1:])

        hooks = [
            named[n].register_forward_pre_hook(lambda m, a, key=n: copy(m, a, key)) for n in norms
        ]
        try:
            embeds = (e_corrupt + (k / steps) * (e_clean - e_corrupt)).requires_grad_(True)
            logits = model(inputs_embeds=embeds).logits[0, -1]
            (logits[answers[0]] - logits[answers[1]]).backward()
        finally:
            for h in hooks:
                h.remove()
        grads = [copies[n].grad[0].detach() / steps for n in norms]
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    return total


@pytest.mark.parametrize(
    ("family", "method", "steps"), [("gpt2", "eap", 1), ("llama", "eap", 1), ("gpt2", "eap_ig", 3)]
)
def test_every_edge_score_equals_the_formula_by_hand(tmp_path, family, method, steps):
    model, _ = save_lm(tmp_path / "lm", family)
    model.requires_grad_(False)
    data = _prompts(tmp_path / "p.jsonl")
    args = _args(tmp_path / "lm", data, f"circuit.method={method}", f"circuit.ig_steps={steps}")
    result = run_config(tmp_path / "run", args)
    with h5py.File(result.path) as f:
        edges = f["circuit/edges"][()]
        senders = [str(s) for s in f["circuit/edges"].attrs["senders"]]
        receivers = [str(s) for s in f["circuit/edges"].attrs["receivers"]]
    layers = model.config.num_hidden_layers
    assert len(senders) == 1 + layers * (HEADS + 1) and receivers[-1] == "logits"
    tok = tokenizer()
    for r, (prompt, answer, counterfactual, wrong) in enumerate(ROWS):
        clean, corrupt = tok(prompt)["input_ids"], tok(counterfactual)["input_ids"]
        answers = (tok(answer)["input_ids"][0], tok(wrong)["input_ids"][0])
        deltas = [
            a - b
            for a, b in zip(
                _hand_writes(model, family, clean),
                _hand_writes(model, family, corrupt),
                strict=True,
            )
        ]
        grads = _hand_gradients(model, family, corrupt, clean, answers, steps)
        for s, delta in enumerate(deltas):
            for v, grad in enumerate(grads):
                got = edges[r, s, v]
                if np.isnan(got):
                    continue
                want = float((delta.double() * grad.double()).sum())
                assert abs(got - want) <= 1e-4 + 1e-4 * abs(want), (
                    family,
                    r,
                    senders[s],
                    receivers[v],
                    got,
                    want,
                )
    # Only the edges whose sender writes before the receiver reads are scored.
    assert np.isnan(edges[:, senders.index("m0"), receivers.index("m0")]).all()
    assert np.isfinite(edges[:, senders.index("a0.h0"), receivers.index("m0")]).all()
    assert np.isnan(edges[:, senders.index("a1.h0"), receivers.index("a1")]).all()
    assert "circuit: the edges with the largest mean" in result.summary


@pytest.mark.parametrize(
    ("family", "extra", "said"),
    [
        ("gpt2", ["circuit.method=fast"], "circuit.method: 'fast'"),
        ("gpt2", ["circuit.ig_steps=0"], "circuit.ig_steps: 0 is out of range"),
        ("gpt_neox", [], "circuit: a gpt_neox model with a parallel residual"),
    ],
)
def test_refused_in_one_line_before_any_work(tmp_path, family, extra, said):
    save_lm(tmp_path / "lm", family)
    data = _prompts(tmp_path / "p.jsonl")
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", _args(tmp_path / "lm", data, *extra))
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run" / "captures.h5").exists()


def _hand_ablated(model, family, clean, corrupt, answers, cut):
    """The clean row run alone, each receiver's norm reading, along every cut edge, the
    sender's corrupted write instead of its write in this run (`cut`: receiver → senders)."""
    names, named = NAMES[family], dict(model.named_modules())
    layers = model.config.num_hidden_layers
    corrupted = _hand_writes(model, family, corrupt)
    now = {}
    order = ["embed"] + [
        x
        for layer in range(layers)
        for x in [*(f"a{layer}.h{h}" for h in range(HEADS)), f"m{layer}"]
    ]

    def write(sender):
        return now[sender]

    def head_hook(layer):
        def hook(m, a):
            z, weight = a[0][0], m.weight
            dh = z.shape[-1] // HEADS
            for h in range(HEADS):
                part = slice(h * dh, (h + 1) * dh)
                w = weight[part, :] if family == "gpt2" else weight[:, part].T
                now[f"a{layer}.h{h}"] = z[:, part] @ w

        return hook

    def receiver_hook(receiver):
        def hook(m, a):
            senders = cut.get(receiver, [])
            if not senders:
                return None
            taken = sum(write(s) - corrupted[order.index(s)] for s in senders)
            return (a[0] - taken[None], *a[1:])

        return hook

    norms = {f"a{i}": names["norms"][0].format(i) for i in range(layers)}
    norms |= {f"m{i}": names["norms"][1].format(i) for i in range(layers)}
    norms["logits"] = names["final"]
    hooks = [
        named[norms["a0"]].register_forward_pre_hook(
            lambda m, a: now.__setitem__("embed", a[0][0].clone())
        )
    ]
    for layer in range(layers):
        hooks.append(named[names["proj"].format(layer)].register_forward_pre_hook(head_hook(layer)))
        hooks.append(
            named[names["mlp"].format(layer)].register_forward_hook(
                lambda m, a, o, k=f"m{layer}": now.__setitem__(k, o[0])
            )
        )
    hooks += [named[n].register_forward_pre_hook(receiver_hook(r)) for r, n in norms.items()]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([clean])).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()
    return float(logits[answers[0]] - logits[answers[1]])


def test_faithfulness_equals_a_hand_edge_ablation_and_holds_at_its_ends(tmp_path):
    model, _ = save_lm(tmp_path / "lm", "gpt2")
    model.requires_grad_(False)
    data = _prompts(tmp_path / "p.jsonl")
    # 2 layers of 2 heads: embed -> 5 receivers, 2 heads of layer 0 -> 4, m0 -> 3, 2 heads of
    # layer 1 -> 2, m1 -> 1: 21 edges.
    drawn = [a for a in _args(tmp_path / "lm", data, "circuit.k=[0,4,7,21]") if a != "render=false"]
    result = run_config(tmp_path / "run", drawn, experiment="circuit")
    for name in ("circuit.png", "circuit_faithfulness.png"):
        assert (tmp_path / "run" / "images" / "circuit" / name).stat().st_size > 1000, name
    with h5py.File(result.path) as f:
        edges = f["circuit/edges"][()]
        senders = [str(s) for s in f["circuit/edges"].attrs["senders"]]
        receivers = [str(s) for s in f["circuit/edges"].attrs["receivers"]]
        shares = f["circuit/faithfulness"][()]
        sizes = list(f["circuit/faithfulness"].attrs["k"])
    assert sizes == [0, 4, 7, 21] and int(np.isfinite(edges[0]).sum()) == 21
    assert abs(shares[0]) < 1e-4  # nothing kept: the corrupted run
    assert shares[3] == pytest.approx(1.0, abs=1e-6)  # everything kept: the clean run
    with warnings.catch_warnings():  # edges no sender reaches: NaN in every row
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(edges, axis=0)
    ranked = np.argsort(-np.nan_to_num(np.abs(mean), nan=-1.0), axis=None)
    tok = tokenizer()
    for k, share in ((4, shares[1]), (7, shares[2])):
        kept = {np.unravel_index(i, mean.shape) for i in ranked[:k]}
        cut: dict[str, list[str]] = {}
        for s, r in zip(*np.nonzero(np.isfinite(mean)), strict=True):
            if (s, r) not in kept:
                cut.setdefault(receivers[r], []).append(senders[s])
        ablated, clean_d, corrupt_d = [], [], []
        for prompt, answer, counterfactual, wrong in ROWS:
            clean, corrupt = tok(prompt)["input_ids"], tok(counterfactual)["input_ids"]
            answers = (tok(answer)["input_ids"][0], tok(wrong)["input_ids"][0])
            ablated.append(_hand_ablated(model, "gpt2", clean, corrupt, answers, cut))
            clean_d.append(_hand_ablated(model, "gpt2", clean, corrupt, answers, {}))
            corrupt_d.append(_hand_ablated(model, "gpt2", corrupt, corrupt, answers, {}))
        want = (np.mean(ablated) - np.mean(corrupt_d)) / (np.mean(clean_d) - np.mean(corrupt_d))
        assert share == pytest.approx(want, abs=1e-4), (k, share, want)
    assert "circuit: faithfulness (share of clean - corrupted kept): 0 edges" in result.summary
    # A resume of the complete file changes nothing (the sizes are measured once).
    again = run_config(
        tmp_path / "run", [*_args(tmp_path / "lm", data, "circuit.k=[0,4,7,21]"), "resume=true"]
    )
    with h5py.File(again.path) as f:
        np.testing.assert_array_equal(f["circuit/faithfulness"][()], shares)
    with pytest.raises(HookrunError, match=r"circuit.k: 22 is more than the model's 21 edges"):
        run_config(tmp_path / "refused", _args(tmp_path / "lm", data, "circuit.k=[22]"))


def test_auto_sizes_run_up_to_every_edge():
    from hookrun.stages.circuit.stage import _sizes

    assert _sizes(21) == [0, 1, 2, 5, 10, 20, 21]
    assert _sizes(100) == [0, 1, 2, 5, 10, 20, 50, 100]
    assert _sizes(1) == [0, 1]


def test_path_patching_equals_a_hand_loop(tmp_path):
    """circuit.paths=[m1,logits]: the corrupted row alone, the named receivers' norms reading
    each sender's clean write instead of its corrupted one (the others untouched)."""
    model, _ = save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "p.jsonl")
    result = run_config(tmp_path / "run", _args(tmp_path / "lm", data, "circuit.paths=[m1,logits]"))
    with h5py.File(result.path) as f:
        shares = f["circuit/paths"][()]
        senders = [str(s) for s in f["circuit/paths"].attrs["senders"]]
        assert [str(r) for r in f["circuit/paths"].attrs["receivers"]] == ["m1", "logits"]
    names, named = NAMES["gpt2"], dict(model.named_modules())
    targets = {"m1": names["norms"][1].format(1), "logits": names["final"]}
    reaches = {"m1": {"embed", "a0.h0", "a0.h1", "m0", "a1.h0", "a1.h1"}}  # before m1 reads
    tok = tokenizer()
    for r, (prompt, answer, counterfactual, wrong) in enumerate(ROWS):
        clean, corrupt = tok(prompt)["input_ids"], tok(counterfactual)["input_ids"]
        answers = (tok(answer)["input_ids"][0], tok(wrong)["input_ids"][0])
        writes = zip(
            _hand_writes(model, "gpt2", clean), _hand_writes(model, "gpt2", corrupt), strict=True
        )
        deltas = [mine - theirs for mine, theirs in writes]

        def run(added, corrupt=corrupt, answers=answers):
            hooks = [
                named[targets[v]].register_forward_pre_hook(
                    lambda m, args, d=d: (args[0] + d[None], *args[1:])
                )
                for v, d in added.items()
            ]
            try:
                with torch.no_grad():
                    logits = model(torch.tensor([corrupt])).logits[0, -1]
            finally:
                for h in hooks:
                    h.remove()
            return float(logits[answers[0]] - logits[answers[1]])

        with torch.no_grad():
            out = model(torch.tensor([clean])).logits[0, -1]
        clean_diff = float(out[answers[0]] - out[answers[1]])
        corrupt_diff = run({})
        for s, sender in enumerate(senders):
            added = {"logits": deltas[s]}
            if sender in reaches["m1"]:
                added["m1"] = deltas[s]
            want = (run(added) - corrupt_diff) / (clean_diff - corrupt_diff)
            assert shares[r, s] == pytest.approx(want, abs=1e-4), (r, sender)
    with pytest.raises(HookrunError, match=r"circuit.paths: 'm9' is not a receiver of this model"):
        run_config(tmp_path / "refused", _args(tmp_path / "lm", data, "circuit.paths=[m9]"))


def test_one_size_or_receiver_alone_is_a_list_and_a_repeated_receiver_is_refused(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "p.jsonl")
    args = _args(tmp_path / "lm", data, "circuit.k=3", "circuit.paths=logits", "sink.dtype=float16")
    result = run_config(tmp_path / "run", args)
    with h5py.File(result.path) as f:
        assert list(f["circuit/faithfulness"].attrs["k"]) == [3]
        assert [str(r) for r in f["circuit/paths"].attrs["receivers"]] == ["logits"]
    from hookrun.verify import verify

    intact, said = verify(result.path)
    assert intact and said[-1].strip() == "intact", said
    every = run_config(
        tmp_path / "all", _args(tmp_path / "lm", data, "circuit.k=[0,21]", "sink.dtype=float16")
    )
    with h5py.File(every.path) as f:  # the ends measured in float32, not read from float16
        shares = f["circuit/faithfulness"][()]
    assert shares[1] == pytest.approx(1.0, abs=1e-6) and abs(shares[0]) < 1e-5, shares
    with pytest.raises(HookrunError, match=r"circuit.paths: \['m1', 'm1'\] names a receiver twice"):
        run_config(tmp_path / "r", _args(tmp_path / "lm", data, "circuit.paths=[m1,m1]"))
    with pytest.raises(HookrunError, match=r"circuit.k: 22 is more than the model's 21 edges"):
        run_config(tmp_path / "r", _args(tmp_path / "lm", data, "circuit.k=22"))
