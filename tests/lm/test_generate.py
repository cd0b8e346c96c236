"""Generation with hooks (`generate:`, experiment=generate) against Hugging Face itself:
without hooks the tokens of `model.generate` row by row; with hooks the tokens and per-step
log probabilities of a hand-written loop of `register_forward_hook` and the key-value cache,
one row at a time (GPT-2, Llama, GPT-NeoX; float32, eager attention). Batched prompts of
different lengths give each row what it gives alone."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from conftest import hookrun_cli, killed_after, run_config
from lm_models import FAMILIES, save_lm, tokenizer, write_jsonl

from hookrun.errors import HookrunError

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

STEPS = 6
PROMPTS = [
    {"prompt": "The cat sat on the"},
    {"prompt": "A quick brown fox jumps over the lazy"},
    {"prompt": "Hooks"},
    {"prompt": "def add(a, b): return"},
]
BLOCK = {family: FAMILIES[family][2] for family in ("gpt2", "llama", "gpt_neox")}
MLP = {
    "gpt2": "transformer.h.1.mlp",
    "llama": "model.layers.1.mlp",
    "gpt_neox": "gpt_neox.layers.1.mlp",
}


def _args(tmp_path, *extra: str) -> list[str]:
    return [
        "experiment=generate",
        "model=hf",
        f"model.path={tmp_path / 'lm'}",
        "model.attention=eager",
        f"dataset.path={tmp_path / 'prompts.jsonl'}",
        "batch_size=4",
        f"generate.max_new_tokens={STEPS}",
        "generate.stop_at_eos=false",
        "render=false",
        *extra,
    ]


def _plain_logprobs(path) -> np.ndarray:
    with h5py.File(path) as f:
        return f["generation/logprobs_unhooked"][()]


def _generated(path) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    with h5py.File(path) as f:
        return (
            f["generation/tokens"][()],
            f["generation/mask"][()],
            f["generation/logprobs"][()],
            [t.decode("utf-8") for t in f["generation/text"][()]],
        )


def _prompt_ids(row: dict) -> list[int]:
    return tokenizer()(row["prompt"])["input_ids"]


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _hand_loop(model, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy decoding of one row by hand: the prompt's pass, then one token a step with the
    model's key-value cache; the chosen token's log probability each step."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(steps):
        logits = out.logits[0, -1].float()
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(logits.log_softmax(-1)[token]))
        out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return tokens, logprobs


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox"])
def test_without_hooks_each_row_is_what_model_generate_gives_it_alone(tmp_path, family):
    model, _ = save_lm(tmp_path / "lm", family)
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    result = run_config(tmp_path / "run", _args(tmp_path))
    tokens, mask, logprobs, texts = _generated(result.path)
    assert tokens.shape == (len(PROMPTS), STEPS) and mask.all()
    tok = tokenizer()
    for r, row in enumerate(PROMPTS):
        ids = torch.tensor([_prompt_ids(row)])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=STEPS,
                min_new_tokens=STEPS,  # no end token: the run does not stop either
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id,
            )
        want = out.sequences[0, ids.shape[1] :].tolist()
        assert tokens[r].tolist() == want, (family, r)
        scores = torch.stack(out.logits)[:, 0].float().log_softmax(-1)
        want_lp = scores[torch.arange(STEPS), torch.tensor(want)].numpy()
        np.testing.assert_allclose(logprobs[r], want_lp, atol=1e-5, rtol=0)
        assert texts[r] == tok.decode(want, skip_special_tokens=True)
    # Without hooks the plain model's one pass over prompt + text scores as the steps did.
    np.testing.assert_allclose(_plain_logprobs(result.path), logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox"])
def test_hooks_act_at_every_decoding_step_as_a_hand_written_loop(tmp_path, family):
    """An `add` at block 0's output and a `zero` at block 1's MLP, with the cache: each
    step's one new token goes through both, as in the hand loop's hooks."""
    model, _ = save_lm(tmp_path / "lm", family)
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    hooks = [
        f"++hooks.steer.select.name={BLOCK[family].format(0)}",
        "++hooks.steer.at=output",
        "++hooks.steer.action=add",
        "++hooks.steer.args.value=0.75",
        f"++hooks.off.select.name={MLP[family]}",
        "++hooks.off.at=output",
        "++hooks.off.action=zero",
    ]
    result = run_config(tmp_path / "run", _args(tmp_path, *hooks))
    tokens, mask, logprobs, _ = _generated(result.path)
    modules = dict(model.named_modules())

    def add(module, args, output):
        first = _first(output) + 0.75
        return (first, *output[1:]) if isinstance(output, tuple) else first

    handles = [
        modules[BLOCK[family].format(0)].register_forward_hook(add),
        modules[MLP[family]].register_forward_hook(lambda m, a, o: torch.zeros_like(o)),
    ]
    try:
        with torch.no_grad():
            hand = [_hand_loop(model, _prompt_ids(row), STEPS) for row in PROMPTS]
            plain = _hand_loop_unhooked(model, handles)
    finally:
        for handle in handles:
            handle.remove()
    for r, (want, want_lp) in enumerate(hand):
        assert tokens[r].tolist() == want, (family, r)
        np.testing.assert_allclose(logprobs[r], want_lp, atol=1e-5, rtol=0)
    assert plain != [t for t, _ in hand]  # the hooks changed what was generated
    # Fluency: the steered text's log probabilities under the model without the hooks.
    fluency = _plain_logprobs(result.path)
    for r, (want, _) in enumerate(hand):
        ids = _prompt_ids(PROMPTS[r])
        with torch.no_grad():
            logp = model(torch.tensor([ids + want])).logits[0].log_softmax(-1)
        at = torch.arange(len(ids) - 1, len(ids) - 1 + STEPS)
        np.testing.assert_allclose(fluency[r], logp[at, torch.tensor(want)].numpy(), atol=1e-5)


def _hand_loop_unhooked(model, handles) -> list[list[int]]:
    """The same rows with the hooks off (the steering must change something)."""
    for handle in handles:
        handle.remove()
    return [_hand_loop(model, _prompt_ids(row), STEPS)[0] for row in PROMPTS]


def test_a_row_stops_at_the_end_token_and_the_others_go_on(tmp_path):
    model, _ = save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    with torch.no_grad():
        greedy = _hand_loop(model, _prompt_ids(PROMPTS[0]), STEPS)[0]
    end = greedy[2]  # row 0's third token ends its text
    model.config.eos_token_id = model.generation_config.eos_token_id = end
    model.save_pretrained(tmp_path / "lm")
    args = [a for a in _args(tmp_path) if a != "generate.stop_at_eos=false"]
    tokens, mask, logprobs, _ = _generated(run_config(tmp_path / "run", args).path)
    stop = greedy.index(end)  # its first occurrence: kept, nothing after it
    assert tokens[0].tolist() == greedy[: stop + 1] + [-1] * (STEPS - stop - 1)
    assert mask[0].tolist() == [True] * (stop + 1) + [False] * (STEPS - stop - 1)
    assert np.isnan(logprobs[0, stop + 1 :]).all() and not np.isnan(logprobs[0, : stop + 1]).any()
    with h5py.File(tmp_path / "run" / "captures.h5") as f:
        assert list(f["generation"].attrs["end_tokens"]) == [end]


def test_sampling_is_seeded_and_top_k_1_is_greedy(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    sample = ["generate.temperature=1.5", "generate.top_p=0.95"]
    first = _generated(run_config(tmp_path / "a", _args(tmp_path, *sample)).path)[0]
    again = _generated(run_config(tmp_path / "b", _args(tmp_path, *sample)).path)[0]
    other = _generated(run_config(tmp_path / "c", _args(tmp_path, *sample, "seed=1")).path)[0]
    np.testing.assert_array_equal(first, again)
    assert (first != other).any()
    greedy = _generated(run_config(tmp_path / "d", _args(tmp_path)).path)[0]
    top1 = ["generate.temperature=0.7", "generate.top_k=1"]
    np.testing.assert_array_equal(
        _generated(run_config(tmp_path / "e", _args(tmp_path, *top1)).path)[0], greedy
    )


@pytest.mark.slow
def test_killed_and_resumed_gives_the_same_file(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS * 6)  # 24 rows, 12 batches of 2
    args = _args(tmp_path, "batch_size=2", "generate.temperature=1.0", "progress=false")
    whole = _generated(run_config(tmp_path / "whole", args).path)
    run_dir = tmp_path / "killed"
    killed_after(args, tmp_path, run_dir, rows=4)
    done = hookrun_cli([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = _generated(run_dir / "captures.h5")
    for got, want in zip(resumed, whole, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["generate.max_new_tokens=0"], "generate.max_new_tokens: 0 is out of range"),
        (["generate.fluency=maybe"], "generate.fluency: 'maybe'; valid: true, false"),
        (["generate.temperature=-1"], "generate.temperature: -1.0; valid: 0 (greedy)"),
        (["generate.top_k=5"], "generate.top_k: 5 with temperature 0 (greedy)"),
        (["generate.temperature=1", "generate.top_p=1.5"], "generate.top_p: 1.5; valid:"),
        (["generate.max_new_tokens=60"], "generate.max_new_tokens: 60 after a prompt of"),
        (
            [
                "++hooks.p.select.name=transformer.h.0.attn",
                "++hooks.p.at=pattern",
                "++hooks.p.action=zero",
            ],
            "hooks.p.at: pattern with generate; valid:",
        ),
    ],
)
def test_refused_in_one_line_before_any_work(tmp_path, extra, said):
    save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", _args(tmp_path, *extra))
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run" / "captures.h5").exists()


def test_a_huge_max_new_tokens_is_refused_by_the_memory_check(tmp_path):
    """Llama has no learned positions to stop it: the batch's outputs are sized first (an
    allocator's error once)."""
    save_lm(tmp_path / "lm", "llama")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", _args(tmp_path, f"generate.max_new_tokens={10**12}"))
    said = str(err.value)
    assert said.startswith(f"generate.max_new_tokens: {10**12} makes one batch's generated")
    assert "valid: a smaller value" in said and "\n" not in said
    assert not (tmp_path / "run" / "captures.h5").exists()


def test_a_masked_language_model_is_refused(tmp_path):
    save_lm(tmp_path / "lm", "bert")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", _args(tmp_path, "model.class=masked_lm"))
    assert str(err.value).startswith("generate: the model is masked_lm on token data; valid:")


def test_an_end_token_past_the_vocabulary_stops_nothing(tmp_path):
    """The tests' GPT-2 keeps GPT-2's eos id (50256) with a vocabulary of a few hundred: no
    row can give it, and the rows that finish early are fed a token that exists."""
    save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    stop = [a for a in _args(tmp_path) if a != "generate.stop_at_eos=false"]
    got = _generated(run_config(tmp_path / "a", stop).path)
    want = _generated(run_config(tmp_path / "b", _args(tmp_path)).path)
    np.testing.assert_array_equal(got[0], want[0])


def test_text_rows_and_extreme_sampling(tmp_path):
    """dataset=text rows generate too; a temperature near 0 and a top_p that rounds to 0
    are greedy, not NaN."""
    save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The cat sat on the mat.\nHooks capture activations.\n", encoding="utf-8")
    text = ["dataset=text", f"dataset.path={corpus}", "dataset.context=6", "target.kind=next_token"]
    tokens, mask, _, _ = _generated(run_config(tmp_path / "text", _args(tmp_path, *text)).path)
    assert tokens.shape[1] == STEPS and mask.all()
    greedy = _generated(run_config(tmp_path / "g", _args(tmp_path)).path)[0]
    for i, extreme in enumerate(
        (["generate.temperature=1e-30"], ["generate.temperature=1.0", "generate.top_p=1e-300"])
    ):
        got = _generated(run_config(tmp_path / f"x{i}", _args(tmp_path, *extreme)).path)[0]
        np.testing.assert_array_equal(got, greedy)


def test_a_hook_at_a_block_input_leaves_its_attention_mask_alone(tmp_path):
    """GPT-2's eager block takes the hidden states and an additive attention mask (−3.4e38
    where masked): `clamp` there clamps the hidden states; the mask is as without the hook,
    in the run's pass and in every decoding step (the hand loop clamps the hidden states)."""
    model, _ = save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    clamp = [
        "++hooks.c.select.name=transformer.h.1",
        "++hooks.c.at=input",
        "++hooks.c.action=clamp",
        "++hooks.c.args.min=-1.0",
        "++hooks.c.args.max=1.0",
    ]
    capture = [
        "++hooks.k.select.name=transformer.h.1",
        "++hooks.k.at=input",
        "++hooks.k.action=capture",
    ]
    hooked = run_config(tmp_path / "hooked", _args(tmp_path, *clamp, *capture)).path
    plain = run_config(tmp_path / "plain", _args(tmp_path, *capture)).path
    with h5py.File(hooked) as f, h5py.File(plain) as g:
        leaves = sorted(k for k in f["captures/transformer.h.1"] if k.startswith("input"))
        assert len(leaves) >= 2, leaves  # the mask is an input here
        first, *rest = leaves
        assert np.abs(f[f"captures/transformer.h.1/{first}"][()]).max() <= 1.0
        for key in rest:
            np.testing.assert_array_equal(
                f[f"captures/transformer.h.1/{key}"][()], g[f"captures/transformer.h.1/{key}"][()]
            )
    tokens, _, logprobs, _ = _generated(hooked)

    def clamp_hidden(module, args):
        return (args[0].clamp(-1.0, 1.0), *args[1:])

    handle = model.transformer.h[1].register_forward_pre_hook(clamp_hidden)
    try:
        with torch.no_grad():
            hand = [_hand_loop(model, _prompt_ids(row), STEPS) for row in PROMPTS]
    finally:
        handle.remove()
    for r, (want, want_lp) in enumerate(hand):
        assert tokens[r].tolist() == want, r
        np.testing.assert_allclose(logprobs[r], want_lp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_patch_and_positions_act_at_the_prompts_pass_as_a_hand_written_loop(tmp_path, family):
    """A `patch` of block 0's output from a stored run and an `add` at block 1's output at
    position 0 act at the prompt's pass (the run's own pass: the stored rows fit it), and
    every later token sees them through the cache: as a hand loop whose hooks act while
    the prompt goes through and not after."""
    model, _ = save_lm(tmp_path / "lm", family)
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    block0, block1 = BLOCK[family].format(0), BLOCK[family].format(1)
    source = [
        "generate={}",  # a plain run: block 0's output, shifted by 0.5, captured
        f"++hooks.s.select.name={block0}",
        "++hooks.s.at=output",
        "++hooks.s.action=add",
        "++hooks.s.args.value=0.5",
        f"++hooks.c.select.name={block0}",
        "++hooks.c.at=output",
        "++hooks.c.action=capture",
    ]
    clean = run_config(tmp_path / "clean", _args(tmp_path, *source)).path
    hooks = [
        f"++hooks.p.select.name={block0}",
        "++hooks.p.at=output",
        "++hooks.p.action=patch",
        f"++hooks.p.args.file={clean}",
        f"++hooks.a.select.name={block1}",
        "++hooks.a.at=output",
        "++hooks.a.action=add",
        "++hooks.a.args.value=3.0",
        "++hooks.a.args.positions=[0]",
    ]
    result = run_config(tmp_path / "run", _args(tmp_path, *hooks))
    tokens, _, logprobs, _ = _generated(result.path)
    with h5py.File(clean) as f:
        stored = torch.from_numpy(f[f"captures/{block0}/output"][()])
    modules = dict(model.named_modules())
    state = {"row": 0, "prompt": True}

    def patch(module, args, output):
        if not state["prompt"]:
            return None
        first = _first(output)
        first = stored[state["row"], : first.shape[1]][None].to(first.dtype)
        return (first, *output[1:]) if isinstance(output, tuple) else first

    def add_first(module, args, output):
        if not state["prompt"]:
            return None
        first = _first(output).clone()
        first[:, 0] += 3.0
        return (first, *output[1:]) if isinstance(output, tuple) else first

    handles = [
        modules[block0].register_forward_hook(patch),
        modules[block1].register_forward_hook(add_first),
    ]
    try:
        for r, row in enumerate(PROMPTS):
            state.update(row=r, prompt=True)
            ids = _prompt_ids(row)
            with torch.no_grad():
                out = model(torch.tensor([ids]), use_cache=True)
                state["prompt"] = False
                want, want_lp = [], []
                for _ in range(STEPS):
                    logits = out.logits[0, -1].float()
                    token = int(logits.argmax())
                    want.append(token)
                    want_lp.append(float(logits.log_softmax(-1)[token]))
                    out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
            assert tokens[r].tolist() == want, (family, r)
            np.testing.assert_allclose(logprobs[r], want_lp, atol=1e-5, rtol=0)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_captures_at_every_step_are_what_a_hand_loop_sees(tmp_path, family):
    """generate.captures: block 1's output at each step, at the position whose output chose
    the step's token (the prompt's last token, then each new one), with block 0's MLP
    zeroed at every step: as a hand loop's forward hook records it, row by row."""
    model, _ = save_lm(tmp_path / "lm", family)
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    block1 = BLOCK[family].format(1)
    hooks = [
        "generate.captures=true",
        f"++hooks.off.select.name={MLP[family]}",
        "++hooks.off.at=output",
        "++hooks.off.action=zero",
        f"++hooks.c.select.name={block1}",
        "++hooks.c.at=output",
        "++hooks.c.action=capture",
    ]
    result = run_config(tmp_path / "run", _args(tmp_path, *hooks))
    with h5py.File(result.path) as f:
        stepped = f[f"generation/captures/{block1}/output"][()]
        tokens = f["generation/tokens"][()]
        prompt_pass = f[f"captures/{block1}/output"][()]
    assert stepped.shape == (len(PROMPTS), STEPS, prompt_pass.shape[-1])
    modules = dict(model.named_modules())
    seen: list[torch.Tensor] = []

    def capture(module, args, output):
        seen.append(_first(output)[0, -1].clone())

    handles = [
        modules[MLP[family]].register_forward_hook(lambda m, a, o: torch.zeros_like(o)),
        modules[block1].register_forward_hook(capture),
    ]
    try:
        for r, row in enumerate(PROMPTS):
            seen.clear()
            with torch.no_grad():
                want, _ = _hand_loop(model, _prompt_ids(row), STEPS)
            assert tokens[r].tolist() == want, (family, r)
            hand = torch.stack(seen[:STEPS]).numpy()  # the last step's pass is never run
            np.testing.assert_allclose(stepped[r], hand, atol=1e-5, rtol=0)
            # Step 0 is the prompt's pass: its last token's row of the run's own capture.
            n = len(_prompt_ids(row))
            np.testing.assert_allclose(stepped[r, 0], prompt_pass[r, n - 1], atol=1e-6)
    finally:
        for handle in handles:
            handle.remove()


def test_step_captures_need_a_capture_with_a_row_per_token(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    pooled = [
        "generate.captures=true",
        "++hooks.c.select.name=transformer.h.1",
        "++hooks.c.at=output",
        "++hooks.c.action=capture",
        "++hooks.c.args.positions=last",
    ]
    for extra in ([], pooled):
        with pytest.raises(HookrunError) as err:
            run_config(tmp_path / "run", _args(tmp_path, "generate.captures=true", *extra))
        said = str(err.value)
        assert said.startswith("generate.captures: true, but the run captures no module") and (
            "\n" not in said
        )
        assert not (tmp_path / "run" / "captures.h5").exists()


@pytest.mark.parametrize(("rows", "fluency"), [(1, "true"), (2, "false"), (4, "true")])
def test_the_generation_is_drawn_whole(tmp_path, rows, fluency):
    """images/generate/generation.png: a row per prompt, a cell per generated token, and
    nothing cut at the picture's edges (the colour bar's label was, on one or two rows)."""
    from PIL import Image

    save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:rows])
    args = [a for a in _args(tmp_path) if a != "render=false"]
    run_config(tmp_path / "run", [*args, f"generate.fluency={fluency}"], experiment="generate")
    picture = tmp_path / "run" / "images" / "generate" / "generation.png"
    with Image.open(picture) as image:
        grey = np.asarray(image.convert("L"))
    assert grey.shape[1] > 400 and len(np.unique(grey)) > 10
    edges = np.concatenate([grey[:3].ravel(), grey[-3:].ravel(), grey[:, :3].ravel()])
    assert (np.concatenate([edges, grey[:, -3:].ravel()]) > 250).all()  # white all round


def _counting_rescores(monkeypatch) -> list[int]:
    """Each call of the fluency pass counted (stages/generate/stage.py's rescore)."""
    import hookrun.stages.generate.stage as stage

    calls: list[int] = []
    real = stage.rescore

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(stage, "rescore", counted)
    return calls


def test_fluency_takes_a_pass_only_under_hooks_that_change_values(tmp_path, monkeypatch):
    """Without value-changing hooks (a capture only) the plain model is the hooked one: its
    log probabilities are stored as fluency, no pass made; generate.fluency=false under a
    hook stores no fluency and makes no pass, and its tokens are the scored run's."""
    save_lm(tmp_path / "lm", "gpt2")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    calls = _counting_rescores(monkeypatch)
    capture = ["++hooks.c.select.name=transformer.h.1", "++hooks.c.at=output"]
    capture += ["++hooks.c.action=capture"]
    plain = run_config(tmp_path / "plain", _args(tmp_path, *capture))
    assert calls == []
    with h5py.File(plain.path) as f:
        np.testing.assert_array_equal(
            f["generation/logprobs_unhooked"][()], f["generation/logprobs"][()]
        )
        assert "generation/unchanged" not in f
    steer = ["++hooks.s.select.name=transformer.h.0.mlp", "++hooks.s.at=output"]
    steer += ["++hooks.s.action=zero"]
    scored = run_config(tmp_path / "scored", _args(tmp_path, *steer))
    assert len(calls) == 1  # one batch of 4
    off = run_config(tmp_path / "off", _args(tmp_path, *steer, "generate.fluency=false"))
    assert len(calls) == 1
    with h5py.File(scored.path) as f, h5py.File(off.path) as g:
        assert "generation/logprobs_unhooked" not in g and "generation/unchanged" not in g
        np.testing.assert_array_equal(g["generation/tokens"][()], f["generation/tokens"][()])
        np.testing.assert_array_equal(g["generation/logprobs"][()], f["generation/logprobs"][()])
        assert not f["generation/unchanged"][()].any()
    assert "(generate.fluency=false: not scored without the hooks)" in off.summary


def test_a_hook_that_changes_nothing_is_warned_of(tmp_path, caplog):
    """The README's old example: a constant added at a GPT-2 block's output is taken out by
    every LayerNorm after it (their mean subtraction), so the text and its log probabilities
    are the plain run's: a warning in the log and the summary. A vector is not warned of."""
    args = ["experiment=generate", "limit=3", "generate.max_new_tokens=6", "render=false"]
    steer = "+hooks.steer={select: {name: transformer.h.1}, at: output, action: add, args: "
    plain = run_config(tmp_path / "plain", args)
    with caplog.at_level("WARNING", logger="hookrun"):
        constant = run_config(tmp_path / "constant", [*args, steer + "{value: 4.0}}"])
    with h5py.File(plain.path) as f, h5py.File(constant.path) as g:
        np.testing.assert_array_equal(g["generation/tokens"][()], f["generation/tokens"][()])
        np.testing.assert_allclose(
            g["generation/logprobs"][()], f["generation/logprobs"][()], atol=1e-4
        )
        assert g["generation/unchanged"][()].all() and list(
            g["generation/unchanged"].attrs["hooks"]
        ) == ["steer"]
    said = "hooks.steer changed nothing: on all 3 rows the model without it gives each generated"
    assert f"generate: warning: {said}" in constant.summary
    logged = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith(f"generate: {said}") for m in logged), logged
    np.save(
        tmp_path / "v.npy", np.random.default_rng(0).standard_normal(128).astype(np.float32) * 8
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="hookrun"):
        vector = run_config(
            tmp_path / "vector", [*args, steer + f"{{vector: {tmp_path / 'v.npy'}}}}}"]
        )
    with h5py.File(plain.path) as f, h5py.File(vector.path) as g:
        assert (g["generation/tokens"][()] != f["generation/tokens"][()]).any()
        assert not g["generation/unchanged"][()].any()
    assert "changed nothing" not in vector.summary
    assert not [r for r in caplog.records if "changed nothing" in r.getMessage()]


def test_a_prompt_and_its_tokens_may_fill_the_models_positions(tmp_path):
    """The last token chosen is never fed back: a prompt of T tokens may have 64 − T + 1 new
    ones on a model of 64 positions, and the plain model scores them all (rescore feeds
    every token but the last, as decoding did)."""
    save_lm(tmp_path / "lm", "gpt2")  # n_positions 64
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    longest = max(len(_prompt_ids(row)) for row in PROMPTS)
    steps = 64 - longest + 1
    args = [a for a in _args(tmp_path) if not a.startswith("generate.max_new_tokens")]
    result = run_config(tmp_path / "run", [*args, f"generate.max_new_tokens={steps}"])
    tokens, mask, logprobs, _ = _generated(result.path)
    assert tokens.shape[1] == steps and mask.all()
    np.testing.assert_allclose(_plain_logprobs(result.path), logprobs, atol=1e-5, rtol=0)
    with pytest.raises(HookrunError, match="generate.max_new_tokens: .* passes the model's 64"):
        run_config(tmp_path / "over", [*args, f"generate.max_new_tokens={steps + 1}"])
