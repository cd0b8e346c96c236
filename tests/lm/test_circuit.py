"""experiment=circuit (issue 31): each edge's EAP score equals the formula computed by hand
on the same Hugging Face model, each row run alone — (the sender's clean write − its
corrupted write) · the gradient of the logit difference at the receiver's input, that
gradient taken through the receiver alone — with each head's write its slice of the output
projection's input times that slice of the weight. A receiver is a head's query, key or
value (by hand: a copy of the residual stream before the attention norm, normed and
projected by the model's own modules, whose output's slice for that head replaces the
projection's), an MLP or the logits (a copy handed to its norm). EAP-IG averages the
gradient over runs with `inputs_embeds` interpolated."""

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

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

NAMES = {
    "gpt2": {
        "proj": "transformer.h.{}.attn.c_proj",
        "mlp": "transformer.h.{}.mlp",
        "norms": ("transformer.h.{}.ln_1", "transformer.h.{}.ln_2"),
        "final": "transformer.ln_f",
        "qkv": ("transformer.h.{}.attn.c_attn",),
    },
    "llama": {
        "proj": "model.layers.{}.self_attn.o_proj",
        "mlp": "model.layers.{}.mlp",
        "norms": ("model.layers.{}.input_layernorm", "model.layers.{}.post_attention_layernorm"),
        "final": "model.norm",
        "qkv": tuple(f"model.layers.{{}}.self_attn.{x}_proj" for x in "qkv"),
    },
    "gpt_neox": {  # with use_parallel_residual=false: the MLP reads after the attention
        "proj": "gpt_neox.layers.{}.attention.dense",
        "mlp": "gpt_neox.layers.{}.mlp",
        "norms": (
            "gpt_neox.layers.{}.input_layernorm",
            "gpt_neox.layers.{}.post_attention_layernorm",
        ),
        "final": "gpt_neox.final_layer_norm",
        "qkv": ("gpt_neox.layers.{}.attention.query_key_value",),
    },
}


def _reads(model, family):
    """Per layer, each read's name → (its projection, the slice of that projection's output
    that is its query, key or value), laid out by hand from the config: GPT-2's c_attn puts
    out [queries | keys | values], Llama's q_proj, k_proj and v_proj one each; key/value
    heads are shared by heads / key_value_heads query heads (named kv<j> then); GPT-NeoX's
    query_key_value puts out [q | k | v] for each head in turn."""
    config = model.config
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    width = config.hidden_size
    dh = width // heads
    group = "h" if kv == heads else "kv"
    out = []
    for layer in range(config.num_hidden_layers):
        qkv = [name.format(layer) for name in NAMES[family]["qkv"]]
        reads = {}
        for h in range(heads):
            first = 3 * h * dh if family == "gpt_neox" else h * dh
            reads[f"a{layer}.h{h}.q"] = (qkv[0], slice(first, first + dh))
        for part, letter in ((1, "k"), (2, "v")):
            for j in range(kv):
                if family == "gpt2":
                    at = (qkv[0], slice(part * width + j * dh, part * width + (j + 1) * dh))
                elif family == "gpt_neox":
                    at = (qkv[0], slice((3 * j + part) * dh, (3 * j + part + 1) * dh))
                else:
                    at = (qkv[part], slice(j * dh, (j + 1) * dh))
                reads[f"a{layer}.{group}{j}.{letter}"] = at
        out.append(reads)
    return out


def _receivers(model, family):
    """Every receiver's name in the order /circuit/edges lists them."""
    out = []
    for layer, reads in enumerate(_reads(model, family)):
        out += [*reads, f"m{layer}"]
    return [*out, "logits"]


def _read_hooks(model, family, take_in):
    """Hooks under which each read takes in `take_in(name, x)` instead of the residual
    stream x before its layer's attention norm (None: x itself): the norm and the
    projection run again, as modules, on what it takes in, and the read's slice of that
    output replaces the projection's."""
    names, named = NAMES[family], dict(model.named_modules())
    hooks = []
    for layer, reads in enumerate(_reads(model, family)):
        norm = named[names["norms"][0].format(layer)]
        seen = {}
        hooks.append(norm.register_forward_pre_hook(lambda m, a, seen=seen: seen.update(x=a[0])))
        for projection in {module for module, _ in reads.values()}:

            def replace(m, a, o, projection=projection, reads=reads, seen=seen, norm=norm):
                out = o.clone()
                for name, (module, part) in reads.items():
                    if module != projection:
                        continue
                    taken = take_in(name, seen["x"])
                    if taken is not None:
                        out[..., part] = m.forward(norm.forward(taken))[..., part]
                return out

            hooks.append(named[projection].register_forward_hook(replace))
    return hooks


@pytest.fixture(autouse=True)
def _reads_split_in_chunks(monkeypatch):
    """A layer's reads are worked on CHUNK at a time; at 4, these models' 6 (GPT-2,
    GPT-NeoX) or 4 (Llama) reads a layer take two chunks, or one whole. (The
    TransformerLens comparison runs them as they come.)"""
    from hookrun.stages.circuit import edges, reads

    monkeypatch.setattr(reads, "CHUNK", 4)
    monkeypatch.setattr(edges, "CHUNK", 4)


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
    """Each receiver's gradient (T, D), by name."""
    names, named = NAMES[family], dict(model.named_modules())
    layers = model.config.num_hidden_layers
    norms = {f"m{layer}": names["norms"][1].format(layer) for layer in range(layers)}
    norms["logits"] = names["final"]
    embed = model.get_input_embeddings()
    with torch.no_grad():
        e_corrupt, e_clean = embed(torch.tensor([corrupt])), embed(torch.tensor([clean]))
    total = {}
    for k in range(steps):
        copies = {}

        def copy(name, x, copies=copies):
            mine = x.clone()
            mine.retain_grad()
            copies[name] = mine
            return mine

        hooks = [
            named[n].register_forward_pre_hook(lambda m, a, key=key: (copy(key, a[0]), *a[1:]))
            for key, n in norms.items()
        ]
        hooks += _read_hooks(model, family, copy)
        try:
            embeds = (e_corrupt + (k / steps) * (e_clean - e_corrupt)).requires_grad_(True)
            logits = model(inputs_embeds=embeds).logits[0, -1]
            (logits[answers[0]] - logits[answers[1]]).backward()
        finally:
            for h in hooks:
                h.remove()
        for name, mine in copies.items():
            total[name] = total.get(name, 0) + mine.grad[0].detach() / steps
    return total


@pytest.mark.parametrize(
    ("family", "method", "steps"),
    [("gpt2", "eap", 1), ("llama", "eap", 1), ("gpt_neox", "eap", 1), ("gpt2", "eap_ig", 3)],
)
def test_every_edge_score_equals_the_formula_by_hand(tmp_path, family, method, steps):
    sequential = {"use_parallel_residual": False} if family == "gpt_neox" else {}
    model, _ = save_lm(tmp_path / "lm", family, **sequential)
    model.requires_grad_(False)
    data = _prompts(tmp_path / "p.jsonl")
    args = _args(tmp_path / "lm", data, f"circuit.method={method}", f"circuit.ig_steps={steps}")
    result = run_config(tmp_path / "run", args)
    with h5py.File(result.path) as f:
        edges = f["circuit/edges"][()]
        senders = [str(s) for s in f["circuit/edges"].attrs["senders"]]
        receivers = [str(s) for s in f["circuit/edges"].attrs["receivers"]]
        score, at = (str(f["circuit/edges"].attrs[k]) for k in ("score", "gradient_at"))
    # What the file says a score is: the hand formula below (its sign, its points k / steps
    # for k = 0 ... steps - 1, as _hand_gradients takes them).
    assert score.startswith("(sender's clean write - its corrupted write) . d(logit(answer)")
    assert ("k = 0 ... 2: the corrupted end in" in at) == (method == "eap_ig"), at
    assert at.startswith("the corrupted run") == (method == "eap"), at
    layers = model.config.num_hidden_layers
    assert len(senders) == 1 + layers * (HEADS + 1) and receivers == _receivers(model, family)
    assert edges.shape[1:] == (len(senders), len(receivers))
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
            for v, receiver in enumerate(receivers):
                got, grad = edges[r, s, v], grads[receiver]
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
    assert np.isnan(edges[:, senders.index("a1.h0"), receivers.index("a1.h1.q")]).all()
    assert np.isfinite(edges[:, senders.index("a0.h1"), receivers.index(receivers[-3])]).all()
    assert "circuit: the edges with the largest mean" in result.summary


@pytest.mark.parametrize(
    ("family", "extra", "said"),
    [
        ("gpt2", ["circuit.method=fast"], "circuit.method: 'fast'"),
        ("gpt2", ["circuit.ig_steps=0"], "circuit.ig_steps: 0 is out of range"),
        ("gpt2", ["circuit.ablation=zero"], "circuit.ablation: 'zero'; valid: corrupted, mean"),
        ("gpt2", ["circuit.paths=[a1.h0]"], "circuit.paths: 'a1.h0' is not a receiver"),
        ("gpt2", ["circuit.paths=[a2]"], "circuit.paths: 'a2' is not a receiver"),
        ("gpt2", ["circuit.paths=[a01]"], "circuit.paths: 'a01' is not a receiver"),
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


def _hand_ablated(model, family, clean, corrupt, answers, cut, carried=None):
    """The clean row run alone, each receiver reading, along every cut edge, the sender's
    corrupted write instead of its write in this run (`cut`: receiver → senders), or the
    writes `carried` (per sender (T, D)) where given."""
    names, named = NAMES[family], dict(model.named_modules())
    layers = model.config.num_hidden_layers
    corrupted = _hand_writes(model, family, corrupt) if carried is None else carried
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

    def take_in(receiver, x):
        senders = cut.get(receiver, [])
        if not senders:
            return None
        return x - sum(write(s) - corrupted[order.index(s)] for s in senders)[None]

    def receiver_hook(receiver):
        def hook(m, a):
            taken = take_in(receiver, a[0])
            return None if taken is None else (taken, *a[1:])

        return hook

    norms = {f"m{i}": names["norms"][1].format(i) for i in range(layers)}
    norms["logits"] = names["final"]
    hooks = [
        named[names["norms"][0].format(0)].register_forward_pre_hook(
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
    hooks += _read_hooks(model, family, take_in)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([clean])).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()
    return float(logits[answers[0]] - logits[answers[1]])


def _read_by(receiver: str, heads: int, kv_heads: int) -> list[str]:
    """The nodes that read a receiver, by its name: a head its query, key and value; the
    query heads h // (heads / key_value_heads) == j a shared a<l>.kv<j>.k or .v; an MLP its
    input; nobody the logits."""
    parts = receiver.split(".")
    if receiver == "logits":
        return []
    if len(parts) == 1:
        return [receiver]
    if parts[1].startswith("kv"):
        group = heads // kv_heads
        return [f"{parts[0]}.h{h}" for h in range(heads) if h // group == int(parts[1][2:])]
    return [f"{parts[0]}.{parts[1]}"]


def hand_pruned(chosen, senders, receivers, heads=HEADS, kv_heads=HEADS) -> set:
    """EAP-IG's Graph.prune (hannamw/EAP-IG) by hand, on names: until nothing changes, a node
    stays if a chosen edge leaves it and one enters it (the embeddings need none entering,
    the logits always stay), and an edge stays if its sender and a node reading its
    receiver (or the logits) stay. `chosen`: (sender, receiver) indices."""
    edges = set(chosen)
    while True:
        leaving = {senders[s] for s, _ in edges}
        entered = {"embed"} | {n for _, r in edges for n in _read_by(receivers[r], heads, kv_heads)}
        staying = (leaving & entered) | {"logits"}
        kept = {
            (s, r)
            for s, r in edges
            if senders[s] in staying
            and (
                receivers[r] == "logits"
                or any(n in staying for n in _read_by(receivers[r], heads, kv_heads))
            )
        }
        if kept == edges:
            return edges
        edges = kept


def top_edges(mean, k) -> set:
    """The k edges of largest mean |score| (NaN: no edge), as (sender, receiver) indices."""
    ranked = np.argsort(-np.nan_to_num(np.abs(mean), nan=-1.0), axis=None, kind="stable")
    return {tuple(int(i) for i in np.unravel_index(i, mean.shape)) for i in ranked[:k]}


# A 2-layer model of 2 heads, as /circuit/edges names its nodes.
SENDERS = ["embed", "a0.h0", "a0.h1", "m0", "a1.h0", "a1.h1", "m1"]
RECEIVERS = [
    *(f"a0.h{h}.{x}" for x in "qkv" for h in range(2)),
    "m0",
    *(f"a1.h{h}.{x}" for x in "qkv" for h in range(2)),
    "m1",
    "logits",
]
# The same with grouped-query attention: 2 query heads sharing one key/value head.
GQA = ["a0.h0.q", "a0.h1.q", "a0.kv0.k", "a0.kv0.v", "m0"]
GQA += ["a1.h0.q", "a1.h1.q", "a1.kv0.k", "a1.kv0.v", "m1", "logits"]


@pytest.mark.parametrize(
    ("receivers", "chosen", "kept"),
    [
        # The largest edge alone, from a head nothing chosen reaches: no path, nothing kept.
        (RECEIVERS, ["a1.h1 -> logits"], []),
        (
            RECEIVERS,
            ["a1.h1 -> logits", "m0 -> a1.h1.v", "embed -> m0"],
            ["a1.h1 -> logits", "m0 -> a1.h1.v", "embed -> m0"],
        ),
        (
            RECEIVERS,
            [
                "a1.h1 -> logits",
                "m0 -> a1.h1.v",
                "embed -> m0",
                "a0.h0 -> m0",  # a0.h0: no chosen edge into its query, key or value
                "embed -> a0.h1.k",  # a0.h1 -> a1.h0.q: a1.h0 reaches the logits by none
                "a0.h1 -> a1.h0.q",
                "embed -> m1",  # m1: no chosen edge out
            ],
            ["a1.h1 -> logits", "m0 -> a1.h1.v", "embed -> m0"],
        ),
        # A head reached through its query alone, an MLP through a head: a path each.
        (
            RECEIVERS,
            ["embed -> a0.h1.q", "a0.h1 -> m1", "m1 -> logits", "embed -> logits"],
            ["embed -> a0.h1.q", "a0.h1 -> m1", "m1 -> logits", "embed -> logits"],
        ),
        # A shared key/value head: read by both query heads; a1.h1 leads on to the logits.
        (GQA, ["embed -> a1.kv0.v", "a1.h1 -> logits"], ["embed -> a1.kv0.v", "a1.h1 -> logits"]),
        (GQA, ["embed -> a1.kv0.v", "a1.h0 -> m1"], []),
    ],
)
def test_a_circuit_keeps_the_chosen_edges_on_a_path_from_embed_to_logits(receivers, chosen, kept):
    """Which of a chosen edge set a circuit keeps, written out by hand, and the same by a
    hand transcription of EAP-IG's pruning."""
    from hookrun.stages.circuit.paths import on_paths, readers

    def indices(names):
        return {(SENDERS.index(a), receivers.index(b)) for a, b in (n.split(" -> ") for n in names)}

    picked = np.zeros((len(SENDERS), len(receivers)), dtype=bool)
    for s, r in indices(chosen):
        picked[s, r] = True
    got = on_paths(picked, readers(SENDERS, receivers))
    want = indices(kept)
    assert {(int(s), int(r)) for s, r in zip(*np.nonzero(got), strict=True)} == want
    kv_heads = 1 if receivers is GQA else 2
    assert hand_pruned(indices(chosen), SENDERS, receivers, 2, kv_heads) == want


def test_the_circuits_of_tiny_lm_keep_their_edges_on_a_path_and_say_so(tmp_path):
    """experiment=circuit as shipped (tiny_lm, the patching prompts): each size's circuit is
    the k largest edges, those on a path embed -> logits (EAP-IG's prune by hand on the
    stored scores), the file says how many it kept and by what rule, the summary too; k = 1
    and 2 choose edges no path joins (a1.h3 -> logits, whose head nothing chosen reaches)
    and keep none: the empty circuit's number, exactly."""
    args = ["experiment=circuit", "circuit.k=[0,1,2,5,10]", "circuit.paths=logits", "render=false"]
    result = run_config(tmp_path / "run", args)
    with h5py.File(result.path) as f:
        edges = f["circuit/edges"][()].astype(np.float64)
        senders = [str(s) for s in f["circuit/edges"].attrs["senders"]]
        receivers = [str(s) for s in f["circuit/edges"].attrs["receivers"]]
        shares = f["circuit/faithfulness"][()]
        kept = list(f["circuit/faithfulness_kept"][()])
        rule = str(f["circuit/faithfulness"].attrs["selection"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(edges, axis=0)
    want = [
        len(hand_pruned(top_edges(mean, k), senders, receivers, 4, 4)) for k in (0, 1, 2, 5, 10)
    ]
    assert kept == want
    assert kept[:3] == [0, 0, 0] and 0 < kept[3] < 5 and kept[4] < 10, kept
    assert top_edges(mean, 1) == {(senders.index("a1.h3"), receivers.index("logits"))}
    assert shares[1] == shares[0] and shares[2] == shares[0]  # the same, empty circuit
    assert "on a path from embed to logits" in rule and "apply_topn" in rule
    assert "1 edges (0 kept) " in result.summary and f"5 edges ({kept[3]} kept) " in result.summary
    # Path patching's line shows 8 of its 11 senders and says how many more there are.
    (line,) = [x for x in result.summary.splitlines() if x.startswith("circuit: path patching")]
    assert line.startswith("circuit: path patching into logits (") and line.endswith("(3 more)")


def test_faithfulness_equals_a_hand_edge_ablation_and_holds_at_its_ends(tmp_path):
    model, _ = save_lm(tmp_path / "lm", "gpt2")
    model.requires_grad_(False)
    data = _prompts(tmp_path / "p.jsonl")
    # 2 layers of 2 heads, each head reading a query, a key and a value: embed -> 15
    # receivers (6 reads and an MLP per layer, the logits), 2 heads of layer 0 -> 9 each,
    # m0 -> 8, 2 heads of layer 1 -> 2 each, m1 -> 1: 46 edges.
    drawn = [a for a in _args(tmp_path / "lm", data, "circuit.k=[0,4,7,46]") if a != "render=false"]
    result = run_config(tmp_path / "run", drawn, experiment="circuit")
    for name in ("circuit.png", "circuit_faithfulness.png"):
        assert (tmp_path / "run" / "images" / "circuit" / name).stat().st_size > 1000, name
    with h5py.File(result.path) as f:
        edges = f["circuit/edges"][()]
        senders = [str(s) for s in f["circuit/edges"].attrs["senders"]]
        receivers = [str(s) for s in f["circuit/edges"].attrs["receivers"]]
        shares = f["circuit/faithfulness"][()]
        sizes = list(f["circuit/faithfulness"].attrs["k"])
    assert sizes == [0, 4, 7, 46] and int(np.isfinite(edges[0]).sum()) == 46
    assert abs(shares[0]) < 1e-4  # nothing kept: the corrupted run
    assert shares[3] == pytest.approx(1.0, abs=1e-6)  # everything kept: the clean run
    with warnings.catch_warnings():  # edges no sender reaches: NaN in every row
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(edges, axis=0)
    tok = tokenizer()
    pruned = []
    for k, share in ((4, shares[1]), (7, shares[2])):
        top = top_edges(mean, k)
        kept = hand_pruned(top, senders, receivers)
        pruned.append(len(top - kept))
        wants = []
        for circuit in (kept, top):  # the circuit, and the k edges before the path rule
            cut: dict[str, list[str]] = {}
            for s, r in zip(*np.nonzero(np.isfinite(mean)), strict=True):
                if (s, r) not in circuit:
                    cut.setdefault(receivers[r], []).append(senders[s])
            ablated, clean_d, corrupt_d = [], [], []
            for prompt, answer, counterfactual, wrong in ROWS:
                clean, corrupt = tok(prompt)["input_ids"], tok(counterfactual)["input_ids"]
                answers = (tok(answer)["input_ids"][0], tok(wrong)["input_ids"][0])
                ablated.append(_hand_ablated(model, "gpt2", clean, corrupt, answers, cut))
                clean_d.append(_hand_ablated(model, "gpt2", clean, corrupt, answers, {}))
                corrupt_d.append(_hand_ablated(model, "gpt2", corrupt, corrupt, answers, {}))
            gap = np.mean(clean_d) - np.mean(corrupt_d)
            wants.append((np.mean(ablated) - np.mean(corrupt_d)) / gap)
        assert share == pytest.approx(wants[0], abs=1e-4), (k, share, wants)
        # Under corrupted ablation the edges the path rule drops carry nothing the logits
        # read: the k edges before it give the same number.
        assert wants[1] == pytest.approx(wants[0], abs=1e-4), (k, wants)
    assert sum(pruned) > 0  # the rule dropped an edge of one of these circuits
    assert (
        "circuit: faithfulness (share of clean - corrupted kept by the k largest edges, only "
        "those on a path embed -> logits): 0 edges"
    ) in result.summary
    # A resume of the complete file changes nothing (the sizes are measured once).
    again = run_config(
        tmp_path / "run", [*_args(tmp_path / "lm", data, "circuit.k=[0,4,7,46]"), "resume=true"]
    )
    with h5py.File(again.path) as f:
        np.testing.assert_array_equal(f["circuit/faithfulness"][()], shares)
    with pytest.raises(HookrunError, match=r"circuit.k: 47 is more than the model's 46 edges"):
        run_config(tmp_path / "refused", _args(tmp_path / "lm", data, "circuit.k=[47]"))


def test_mean_ablation_equals_a_hand_edge_ablation_with_the_mean_writes(tmp_path):
    """circuit.ablation=mean: a cut edge carries its sender's write averaged over every
    row's corrupted run at that position (the rows long enough to have it). Of the 4 largest
    edges, a1.h0 -> logits and a1.h1 -> logits start at heads no chosen edge reaches: the
    circuit is the other 2, and here those 2 would have changed the number (each head would
    write what its mean-ablated inputs make, not its mean write)."""
    model, _ = save_lm(tmp_path / "lm", "llama")
    model.requires_grad_(False)
    data = _prompts(tmp_path / "p.jsonl")
    args = _args(tmp_path / "lm", data, "circuit.k=[0,4,36]", "circuit.ablation=mean")
    result = run_config(tmp_path / "run", args)
    with h5py.File(result.path) as f:
        edges = f["circuit/edges"][()]
        senders = [str(s) for s in f["circuit/edges"].attrs["senders"]]
        receivers = [str(s) for s in f["circuit/edges"].attrs["receivers"]]
        shares = f["circuit/faithfulness"][()]
        assert f["circuit/faithfulness"].attrs["ablation"] == "mean"
        assert f["circuit/edges"].attrs["key_value_heads"] == 1
    assert int(np.isfinite(edges[0]).sum()) == 36  # Llama, 2 query heads sharing 1 key/value
    tok = tokenizer()
    pairs = []
    for prompt, answer, counterfactual, wrong in ROWS:
        clean, corrupt = tok(prompt)["input_ids"], tok(counterfactual)["input_ids"]
        pairs.append((clean, corrupt, (tok(answer)["input_ids"][0], tok(wrong)["input_ids"][0])))
    each = [_hand_writes(model, "llama", corrupt) for _, corrupt, _ in pairs]
    width = max(len(corrupt) for _, corrupt, _ in pairs)
    mean = []
    for sender in range(len(senders)):
        total, count = torch.zeros(width, model.config.hidden_size), torch.zeros(width, 1)
        for row in each:
            total[: len(row[sender])] += row[sender]
            count[: len(row[sender])] += 1
        mean.append(total / count)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean_scores = np.nanmean(edges, 0)
    scored = np.isfinite(edges[0])
    clean_d = [_hand_ablated(model, "llama", c, x, a, {}) for c, x, a in pairs]
    corrupt_d = [_hand_ablated(model, "llama", x, x, a, {}) for c, x, a in pairs]

    def hand_share(circuit):
        cut: dict[str, list[str]] = {}
        for s, r in zip(*np.nonzero(scored), strict=True):
            if (s, r) not in circuit:
                cut.setdefault(receivers[r], []).append(senders[s])
        ablated = [
            _hand_ablated(model, "llama", c, x, a, cut, [m[: len(c)] for m in mean])
            for c, x, a in pairs
        ]
        return (np.mean(ablated) - np.mean(corrupt_d)) / (np.mean(clean_d) - np.mean(corrupt_d))

    for k, share in zip((0, 4, 36), shares, strict=True):
        top = top_edges(mean_scores, k)
        kept = hand_pruned(top, senders, receivers, HEADS, 1)
        want = hand_share(kept)
        assert share == pytest.approx(want, abs=1e-4), (k, share, want)
        if k == 4:
            heads_out = {(senders.index(f"a1.h{h}"), receivers.index("logits")) for h in (0, 1)}
            assert top - kept == heads_out and abs(hand_share(top) - want) > 1e-3
    assert shares[2] == pytest.approx(1.0, abs=1e-6)  # every edge kept: the clean run
    assert abs(shares[0]) > 1e-3  # nothing kept: the mean, not the corrupted run


def test_a_layout_the_projections_do_not_have_is_refused_naming_them(tmp_path):
    """The architecture table's qkv layout is checked against the projections' widths."""
    from hookrun.stages.circuit.reads import attention_reads

    model, _ = save_lm(tmp_path / "lm", "gpt2")
    c_attn = dict(model.named_modules())["transformer.h.0.attn.c_attn"]
    reads = attention_reads(0, [("c_attn", c_attn)], "stacked", 2, 2)
    assert [(r.name, r.start, r.stop) for r in reads][::3] == [
        ("a0.h0.q", 0, 16),
        ("a0.h1.k", 48, 64),
    ]
    with pytest.raises(HookrunError) as err:
        attention_reads(0, [("c_attn", c_attn)], "separate", 2, 2)
    said = str(err.value)
    assert said.startswith("circuit: the projections c_attn put out [96] features, not a separate")
    assert "\n" not in said
    lm_head = dict(model.named_modules())["lm_head"]
    with pytest.raises(HookrunError, match=r"circuit: lm_head is a Linear, whose weight"):
        lm_head.weight = torch.nn.Parameter(torch.zeros(3))  # not (out, in): a packed weight
        attention_reads(0, [("lm_head", lm_head)], "per_head", 2, 2)
    with pytest.raises(HookrunError, match=r"circuit: lm_head is a Linear, whose weight"):
        # 8-bit weights in their (out, in) shape, the scales elsewhere
        lm_head.weight = torch.nn.Parameter(
            torch.zeros(lm_head.out_features, lm_head.in_features, dtype=torch.int8),
            requires_grad=False,
        )
        attention_reads(0, [("lm_head", lm_head)], "per_head", 2, 2)


def test_a_file_from_before_per_head_receivers_is_still_drawn():
    """Files written before receivers were per head name a layer's attention a<layer>."""
    from hookrun.stages.circuit.draw import _place

    assert _place("a1", 4, 4) == (-1.0, 2.5)
    assert _place("a1.h2", 4, 4) == (2.0, 3.0)
    assert _place("a1.kv0.k", 4, 2) == (0.35, 2.4)  # below query heads 0 and 1
    assert _place("a1.h1.q", 4, 2) == (1.0, 2.7)  # a shared key/value: the query alone


def _nodes(heads: int, kv_heads: int, layers: int = 2) -> tuple[list[str], list[str]]:
    """Senders and receivers as /circuit/edges names them."""
    senders, receivers = ["embed"], []
    kv = "h" if kv_heads == heads else "kv"
    for layer in range(layers):
        senders += [f"a{layer}.h{h}" for h in range(heads)] + [f"m{layer}"]
        receivers += [f"a{layer}.h{h}.q" for h in range(heads)]
        receivers += [f"a{layer}.{kv}{j}.{x}" for x in "kv" for j in range(kv_heads)]
        receivers.append(f"m{layer}")
    return senders, [*receivers, "logits"]


def _writes_before(sender: str, receiver: str) -> bool:
    """Whether the sender writes before the receiver reads: the embeddings first, a layer's
    heads before its MLP, its MLP before the next layer's heads, the logits last."""

    def at(name: str, reading: bool) -> float:
        if name in ("embed", "logits"):
            return -1.0 if name == "embed" else 99.0
        layer = int(name.split(".")[0][1:])
        if name.startswith("m"):
            return layer + 0.5
        return layer - 0.25 if reading else float(layer)

    return at(sender, False) < at(receiver, True)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_every_edge_of_the_circuit_picture_passes_clear_of_the_other_nodes(kv_heads):
    """Issue 40: tiny_lm's nodes (2 layers of 4 heads; 2 key/value heads: grouped-query
    attention), every head's input drawn: each edge the picture could draw runs between its
    own two nodes and keeps CLEAR pixels from every other one (a dot's or a square's) —
    m0 -> logits no longer through m1, whose dot a straight line crosses."""
    import matplotlib.pyplot as plt

    from hookrun.stages.circuit.draw import CLEAR, canvas

    senders, receivers = _nodes(4, kv_heads)
    squares = [r for r in receivers if r.count(".") == 2]
    drawing = canvas(senders, receivers, kv_heads, squares)
    pixels = drawing.ax.transData.transform
    where = {n: pixels(np.array([drawing.spot[n]]))[0] for n in drawing.nodes}
    try:
        for sender in senders:
            for receiver in receivers:
                if not _writes_before(sender, receiver):
                    continue
                line = pixels(drawing.line(sender, receiver))
                np.testing.assert_allclose(line[[0, -1]], [where[sender], where[receiver]])
                # Every 1/20 of each segment: no closer than CLEAR to another node's centre.
                t = np.linspace(0, 1, 21)[None, :, None]
                dense = (line[:-1, None] + t * (line[1:, None] - line[:-1, None])).reshape(-1, 2)
                for name, at in where.items():
                    if name not in (sender, receiver):
                        gap = np.sqrt(((dense - at) ** 2).sum(1)).min()
                        least = CLEAR["square" if name.count(".") == 2 else "dot"]
                        assert gap >= least - 0.5, (sender, receiver, name, gap)
        m0, m1, logits = where["m0"], where["m1"], where["logits"]
        # m1 sits on the straight line between them: one column, m1 between in height.
        assert abs(m1[0] - m0[0]) < 1e-6 and abs(logits[0] - m0[0]) < 1e-6
        assert m0[1] < m1[1] < logits[1]
    finally:
        plt.close(drawing.fig)


def test_the_faithfulness_curve_is_drawn_at_the_edges_kept_on_a_log_like_axis(
    tmp_path, monkeypatch
):
    """Issue 40: sizes k = 0, 1, 2, 5, 10 that kept 0, 0, 0, 4 and 8 edges are drawn at 0, 0,
    0, 4, 8 on a symmetric-log axis (0 to 1 linear, then logarithmic: 0, 1, 2, 5 apart, not
    squashed against 10), each point whose circuit kept fewer than k named by its k."""
    from hookrun.stages.circuit import draw

    seen = {}

    def keep(fig, target):
        ax = fig.axes[0]
        seen["scale"] = ax.get_xscale()
        seen["x"], seen["y"] = (list(v) for v in ax.lines[0].get_data())
        seen["said"] = sorted(t.get_text() for t in ax.texts)
        seen["to_pixels"] = ax.transData.transform
        return target

    monkeypatch.setattr(draw, "save_figure", keep)
    with h5py.File(tmp_path / "f.h5", "w") as f:
        ds = f.create_dataset("circuit/faithfulness", data=[0.0, 0.0, 0.0, 0.47, 0.8])
        ds.attrs["k"] = [0, 1, 2, 5, 10]
        f.create_dataset("circuit/faithfulness_kept", data=[0, 0, 0, 4, 8])
        draw._faithfulness_picture(ds, tmp_path)
    assert seen["scale"] == "symlog"
    assert seen["x"] == [0, 0, 0, 4, 8] and seen["y"] == [0.0, 0.0, 0.0, 0.47, 0.8]
    assert seen["said"] == ["k=0, 1, 2", "k=10", "k=5"]
    xs = [seen["to_pixels"]((x, 0))[0] for x in (0, 1, 2, 5, 10)]
    steps = np.diff(xs)
    assert steps.min() > 0.5 * steps.max(), steps  # each size as far apart as the next


def test_auto_sizes_run_up_to_every_edge():
    from hookrun.stages.circuit.stage import _sizes

    assert _sizes(21) == [0, 1, 2, 5, 10, 20, 21]
    assert _sizes(100) == [0, 1, 2, 5, 10, 20, 50, 100]
    assert _sizes(1) == [0, 1]


# circuit.paths as given, the receivers it names (a1: every read of layer 1), and the layer
# before whose attention each read is made (the MLP m1 reads after layer 1's heads wrote).
PATHS = {
    "gpt2": ("[a1.h1.k,m1,logits]", ["a1.h1.k", "m1", "logits"]),
    "llama": ("[a1,logits]", ["a1.h0.q", "a1.h1.q", "a1.kv0.k", "a1.kv0.v", "logits"]),
}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_path_patching_equals_a_hand_loop(tmp_path, family):
    """circuit.paths: the corrupted row alone, the named receivers (a head's query, key or
    value; an MLP's or the final norm's input) reading each sender's clean write instead of
    its corrupted one, the others untouched; the summary names the senders that bring most
    back."""
    model, _ = save_lm(tmp_path / "lm", family)
    data = _prompts(tmp_path / "p.jsonl")
    given, receivers = PATHS[family]
    result = run_config(tmp_path / "run", _args(tmp_path / "lm", data, f"circuit.paths={given}"))
    with h5py.File(result.path) as f:
        shares = f["circuit/paths"][()]
        senders = [str(s) for s in f["circuit/paths"].attrs["senders"]]
        assert [str(r) for r in f["circuit/paths"].attrs["receivers"]] == receivers
    names, named = NAMES[family], dict(model.named_modules())
    norms = {"m1": names["norms"][1].format(1), "logits": names["final"]}
    # Which senders write before each receiver reads: layer 1's reads see the embeddings
    # and layer 0; m1 sees layer 1's heads too; the logits everything.
    before = {"embed", "a0.h0", "a0.h1", "m0"}
    reaches = {r: before for r in receivers if r.startswith("a1")}
    reaches |= {"m1": before | {"a1.h0", "a1.h1"}, "logits": set(senders)}
    tok = tokenizer()
    hand = np.zeros((len(ROWS), len(senders)))
    for r, (prompt, answer, counterfactual, wrong) in enumerate(ROWS):
        clean, corrupt = tok(prompt)["input_ids"], tok(counterfactual)["input_ids"]
        answers = (tok(answer)["input_ids"][0], tok(wrong)["input_ids"][0])
        writes = zip(
            _hand_writes(model, family, clean), _hand_writes(model, family, corrupt), strict=True
        )
        deltas = [mine - theirs for mine, theirs in writes]

        def run(added, corrupt=corrupt, answers=answers):
            hooks = [
                named[norms[v]].register_forward_pre_hook(
                    lambda m, args, d=d: (args[0] + d[None], *args[1:])
                )
                for v, d in added.items()
                if v in norms
            ]
            hooks += _read_hooks(
                model, family, lambda name, x: x + added[name][None] if name in added else None
            )
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
            added = {v: deltas[s] for v in receivers if sender in reaches[v]}
            want = (run(added) - corrupt_diff) / (clean_diff - corrupt_diff)
            assert shares[r, s] == pytest.approx(want, abs=1e-4), (r, sender)
            hand[r, s] = want
    # The summary (issue 40): the senders by the largest mean |share| over the rows, the
    # hand loop's, with their means.
    (line,) = [x for x in result.summary.splitlines() if x.startswith("circuit: path patching")]
    assert line.startswith(f"circuit: path patching into {', '.join(receivers)} (mean share")
    mean = hand.mean(axis=0)
    order = np.argsort(-np.abs(mean), kind="stable")
    said = [item.rsplit(" ", 1) for item in line.split("): ", 1)[1].split(" (")[0].split(", ")]
    assert [name for name, _ in said] == [senders[s] for s in order], line
    for (_, value), s in zip(said, order, strict=True):
        assert float(value) == pytest.approx(mean[s], abs=1.5e-3), line
    assert len(senders) == 7 and not line.endswith("more)"), line  # every sender shown
    with pytest.raises(HookrunError, match=r"circuit.paths: 'm9' is not a receiver of this model"):
        run_config(tmp_path / "refused", _args(tmp_path / "lm", data, "circuit.paths=[m9]"))
    with pytest.raises(HookrunError, match=r"names the receiver a1.h0.q twice; valid: each once"):
        run_config(tmp_path / "twice", _args(tmp_path / "lm", data, "circuit.paths=[a1,a1.h0.q]"))


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
        tmp_path / "all", _args(tmp_path / "lm", data, "circuit.k=[0,46]", "sink.dtype=float16")
    )
    with h5py.File(every.path) as f:  # the ends measured in float32, not read from float16
        shares = f["circuit/faithfulness"][()]
    assert shares[1] == pytest.approx(1.0, abs=1e-6) and abs(shares[0]) < 1e-5, shares
    with pytest.raises(HookrunError, match=r"circuit.paths: \['m1', 'm1'\] names a receiver twice"):
        run_config(tmp_path / "r", _args(tmp_path / "lm", data, "circuit.paths=[m1,m1]"))
    with pytest.raises(HookrunError, match=r"circuit.k: 47 is more than the model's 46 edges"):
        run_config(tmp_path / "r", _args(tmp_path / "lm", data, "circuit.k=47"))
