"""experiment=lm_patching: the batched layers × positions grid equals a hand-written loop of
`register_forward_hook` replacements on the same Hugging Face model (one forward per cell,
each row run alone without padding), cell by cell, for GPT-2, Llama and GPT-NeoX and every
site kind; the endpoints that hold exactly do; what cannot be patched is refused before any
work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import hookrun_cli, killed_after, read, run_config
from lm_models import FAMILIES, save_lm, tokenizer, write_jsonl

from hookrun.errors import HookrunError

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

# Clean prompt and answer, corrupted (counterfactual) prompt and answer: the same token length
# under lm_models' tokenizer (8, 10 and 14 tokens: the rows are padded to 14).
ROWS = [
    ("The cat sat on the", " mat", "The dog sat on the", " cat"),
    ("A quick brown fox", " jumps", "A lazy brown fox", " dog"),
    ("def add(a, b): return a +", " b", "def add(a, b): return b +", " a"),
]
# Each site kind's module per layer, written out here (not read from the code under test).
MODULES = {
    "gpt2": {
        "resid": "transformer.h.{}",
        "attn": "transformer.h.{}.attn",
        "mlp": "transformer.h.{}.mlp",
        "heads": "transformer.h.{}.attn.c_proj",
    },
    "llama": {
        "resid": "model.layers.{}",
        "attn": "model.layers.{}.self_attn",
        "mlp": "model.layers.{}.mlp",
        "heads": "model.layers.{}.self_attn.o_proj",
    },
    "gpt_neox": {
        "resid": "gpt_neox.layers.{}",
        "attn": "gpt_neox.layers.{}.attention",
        "mlp": "gpt_neox.layers.{}.mlp",
        "heads": "gpt_neox.layers.{}.attention.dense",
    },
}
HEADS = 2  # lm_models' configs: 2 attention heads


def _prompts(path, rows=ROWS):
    keys = ("prompt", "answer", "counterfactual", "counterfactual_answer")
    return write_jsonl(path, [dict(zip(keys, row, strict=False)) for row in rows])


def _args(folder, data, *extra: str) -> list[str]:
    return [
        "experiment=lm_patching",
        "model=hf",
        f"model.path={folder}",
        f"dataset.path={data}",
        "batch_size=2",
        "render=false",
        *extra,
    ]


def _first_tensor(output):
    return output[0] if isinstance(output, tuple) else output


def _hand_diff(model, ids, answers, patch=None) -> float:
    """logit(answer) − logit(counterfactual answer) at the last token of `ids` run alone;
    `patch` = (module, position, value[, head]): that module's output there replaced by
    `value`, or with a head, that head's slice of the module's input (the output projection)."""
    handle = None
    if patch is not None and len(patch) == 4:
        module, position, value, head = patch
        width = value.shape[-1] // HEADS
        part = slice(head * width, (head + 1) * width)

        def pre(m, args):
            tensor = args[0].clone()
            tensor[0, position, part] = value[part]
            return (tensor, *args[1:])

        handle = module.register_forward_pre_hook(pre)
    elif patch is not None:
        module, position, value = patch

        def hook(m, a, output):
            tensor = _first_tensor(output).clone()
            tensor[0, position] = value
            return (tensor, *output[1:]) if isinstance(output, tuple) else tensor

        handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    finally:
        if handle is not None:
            handle.remove()
    return float(logits[answers[0]] - logits[answers[1]])


def _hand_outputs(model, ids, modules, inputs=False) -> list[torch.Tensor]:
    """Each module's output (T, D) on `ids` run alone (its input with `inputs`)."""
    seen: list[torch.Tensor] = []
    handles = [
        m.register_forward_pre_hook(lambda m, a: seen.append(a[0][0].detach()))
        if inputs
        else m.register_forward_hook(lambda m, a, o: seen.append(_first_tensor(o)[0].detach()))
        for m in modules
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def _hand_grid(model, tok, row, kind_pattern) -> tuple[float, float, np.ndarray]:
    """Clean and corrupted logit differences and the (layers, length) patched ones of one row
    ((layers, heads, length) for the heads' output projections), one forward per cell."""
    prompt, answer, counterfactual, wrong = row
    clean_ids, corrupt_ids = tok(prompt)["input_ids"], tok(counterfactual)["input_ids"]
    answers = (tok(answer)["input_ids"][0], tok(wrong)["input_ids"][0])
    named = dict(model.named_modules())
    modules = [named[kind_pattern.format(i)] for i in range(2)]
    heads = kind_pattern.endswith(("c_proj", "o_proj", "dense"))
    clean_out = _hand_outputs(model, clean_ids, modules, inputs=heads)

    def cell(layer, p, *head):
        return _hand_diff(
            model, corrupt_ids, answers, (modules[layer], p, clean_out[layer][p], *head)
        )

    positions = range(len(clean_ids))
    if heads:
        patched = np.array(
            [[[cell(layer, p, h) for p in positions] for h in range(HEADS)] for layer in range(2)]
        )
    else:
        patched = np.array([[cell(layer, p) for p in positions] for layer in range(2)])
    clean = _hand_diff(model, clean_ids, answers)
    return clean, _hand_diff(model, corrupt_ids, answers), patched


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox"])
def test_the_grid_equals_a_hand_hook_loop_cell_by_cell(tmp_path, family):
    model, _ = save_lm(tmp_path / "lm", family)
    tok = tokenizer()
    data = _prompts(tmp_path / "prompts.jsonl")
    # 7 rows per patched forward with batches of 2: a position's cells of 4 kinds × 2 layers
    # (× 2 heads) × 2 rows split across passes.
    args = _args(
        tmp_path / "lm", data, "patching.batch_size=7", "patching.sites=[resid,attn,mlp,heads]"
    )
    with h5py.File(run_config(tmp_path / "run", args).path) as f:
        stored = {k: f[f"patching/{k}"][:] for k in f["patching"] if not k.startswith("layer")}
        layers = [str(x) for x in f["patching/resid"].attrs["layers"]]
        assert f["patching"].attrs["corrupted"] == "counterfactual"
        scales = f["patching/heads"].dims
        dims = [d[0].name.rsplit("/", 1)[1].split("_")[0] if len(d) else None for d in scales]
    assert layers == [MODULES[family]["resid"].format(i) for i in range(2)]
    assert stored["resid"].shape == (3, 2, 14) and stored["clean"].shape == (3,)
    assert stored["heads"].shape == (3, 2, HEADS, 14)
    assert dims == ["sample", "layer", "head", "position"]
    for kind, pattern in MODULES[family].items():
        for r, row in enumerate(ROWS):
            clean, corrupted, patched = _hand_grid(model, tok, row, pattern)
            length = patched.shape[-1]
            np.testing.assert_allclose(stored["clean"][r], clean, atol=1e-5)
            np.testing.assert_allclose(stored["corrupted"][r], corrupted, atol=1e-5)
            got = stored[f"{kind}_logit_diff"][r]
            np.testing.assert_allclose(got[..., :length], patched, atol=1e-5, rtol=0)
            # The score divides by clean − corrupted (1e-3 in a random model's rows): compared
            # times it, the logit differences' 1e-5.
            gap = clean - corrupted
            score = (patched - corrupted) / gap
            np.testing.assert_allclose(stored[kind][r][..., :length] * gap, score * gap, atol=2e-5)
            assert np.isnan(stored[kind][r][..., length:]).all()  # past the row's tokens
            assert np.isnan(got[..., length:]).all()


def test_a_sliding_window_model_runs_its_patched_passes_from_the_start(tmp_path, monkeypatch):
    """A cache that is not plain keys and values per layer (Mistral's sliding window, here 4
    tokens of 14) cannot be resumed from: each patched pass runs the row from position 0,
    and the grid still equals the hand loop."""
    import lm_models

    config = {**lm_models.FAMILIES["llama"][1], "model_type": "mistral", "sliding_window": 4}
    monkeypatch.setitem(lm_models.FAMILIES, "mistral", ("causal_lm", config, "model.layers.{}"))
    model, _ = save_lm(tmp_path / "lm", "mistral")
    tok = tokenizer()
    data = _prompts(tmp_path / "prompts.jsonl")
    args = _args(tmp_path / "lm", data, "patching.sites=[resid,attn,mlp,heads]")
    with h5py.File(run_config(tmp_path / "run", args).path) as f:
        stored = {k: f[f"patching/{k}_logit_diff"][:] for k in MODULES["llama"]}
    for kind, pattern in MODULES["llama"].items():
        for r, row in enumerate(ROWS):
            _, _, patched = _hand_grid(model, tok, row, pattern)
            got = stored[kind][r][..., : patched.shape[-1]]
            np.testing.assert_allclose(got, patched, atol=1e-5, rtol=0)


def test_the_endpoints_that_hold_exactly(tmp_path):
    """Patching the last block's output at the read position gives the clean run: exactly 1.
    Patching where clean and corrupted agree (every layer, before the first token that differs:
    the model is causal) or where nothing reads the patch (the last block's output at a position
    before the read) changes nothing: exactly 0."""
    save_lm(tmp_path / "lm", "gpt2")
    tok = tokenizer()
    data = _prompts(tmp_path / "prompts.jsonl")
    args = _args(tmp_path / "lm", data, "patching.sites=[resid,attn,mlp,heads]")
    with h5py.File(run_config(tmp_path / "run", args).path) as f:
        grids = {k: f[f"patching/{k}"][:] for k in ("resid", "attn", "mlp", "heads")}
    for r, (prompt, _, counterfactual, _) in enumerate(ROWS):
        clean, corrupt = tok(prompt)["input_ids"], tok(counterfactual)["input_ids"]
        first = next(i for i, (a, b) in enumerate(zip(clean, corrupt, strict=True)) if a != b)
        read = len(clean) - 1
        assert first > 0
        assert grids["resid"][r, -1, read] == 1.0
        for kind, grid in grids.items():
            assert (grid[r, -1, ..., :read] == 0).all(), kind  # nothing after the last block
            assert (grid[r, :, ..., :first] == 0).all(), kind


def test_listed_positions_are_those_columns_of_the_full_grid(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "prompts.jsonl")
    full = run_config(tmp_path / "full", _args(tmp_path / "lm", data)).path
    listed = _args(tmp_path / "lm", data, "patching.positions=[7,0,3]", "patching.sites=[mlp]")
    some = run_config(tmp_path / "some", [*listed, "render=true"]).path
    # The picture: the mlp grid alone (mean over rows and the first row).
    assert [p.name for p in (tmp_path / "some").rglob("patching_*.png")] == ["patching_mlp.png"]
    with h5py.File(full) as a, h5py.File(some) as b:
        assert "patching/resid" not in b and list(b["patching/mlp"].attrs["positions"]) == [7, 0, 3]
        np.testing.assert_allclose(
            b["patching/mlp"][:], a["patching/mlp"][:][:, :, [7, 0, 3]], atol=1e-6
        )


def test_read_aligned_lines_rows_up_at_their_read_positions_by_hand():
    """Three rows read at positions 2, 4 and 1 of 5 (NaN past each read, as padding is):
    column j holds each row's cell at read + (j − 4), NaN where the row has none; 3, 2 or 1
    rows hold a column."""
    from hookrun.stages.patching.draw import read_aligned

    nan = np.nan
    scores = np.array(
        [
            [[10, 11, 12, nan, nan]],
            [[20, 21, 22, 23, 24]],
            [[30, 31, nan, nan, nan]],
        ]
    )
    aligned, offsets, holding = read_aligned(scores, np.array([2, 4, 1]))
    assert offsets.tolist() == [-4, -3, -2, -1, 0]
    want = np.array(
        [
            [[nan, nan, 10, 11, 12]],
            [[20, 21, 22, 23, 24]],
            [[nan, nan, nan, 30, 31]],
        ]
    )
    np.testing.assert_array_equal(aligned, want)
    assert holding.tolist() == [1, 1, 2, 3, 3]


def test_the_mean_picture_lines_rows_up_at_their_read_positions(tmp_path):
    """Issue 40: rows of 8, 10 and 14 tokens, read at their last token. The mean panel's
    columns are positions counted back from each row's read — the read column is the mean of
    the three reads, the last block's 1 there — and a column the shorter rows do not reach
    says how many rows it holds (not row 0's padding labels over the longest row's read)."""
    from hookrun.stages.patching.draw import _mean_over_rows

    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "prompts.jsonl")
    args = [a for a in _args(tmp_path / "lm", data) if a != "render=false"]
    path = run_config(tmp_path / "run", args).path
    (drawn,) = (tmp_path / "run").rglob("patching_resid.png")
    assert drawn.stat().st_size > 1000
    tok = tokenizer()
    reads = [len(tok(prompt)["input_ids"]) - 1 for prompt, *_ in ROWS]
    assert reads == [7, 9, 13]
    with h5py.File(path) as f:
        grid = f["patching/resid"][()]  # (3, layers, 14)
        positions = np.asarray(f["patching/resid"].attrs["positions"])
        labels = [str(p) for p in positions]
        mean, shown, title = _mean_over_rows(f, grid, positions, labels, {})
    assert mean.shape == (grid.shape[1], 14) and len(shown) == 14
    for j, offset in enumerate(range(-13, 1)):
        rows = [r for r, read in enumerate(reads) if read + offset >= 0]
        want = np.mean([grid[r, :, reads[r] + offset] for r in rows], axis=0)
        np.testing.assert_allclose(mean[:, j], want, atol=1e-7, err_msg=str(offset))
        said = shown[j]
        assert said.startswith("read" if offset == 0 else f"{offset:+d}"), said
        assert said.endswith(f" [{len(rows)}]") == (len(rows) < 3), said
    assert mean[-1, -1] == 1.0  # the last block's output at every row's read: the clean run
    assert np.nanargmax(np.abs(mean[-1])) == 13  # the brightest cell: the read
    assert "lined up at its read position" in title


@pytest.mark.slow
def test_a_multirun_over_patching_layer_gives_the_full_grids_layers(tmp_path):
    """One cluster job per layer (`--multirun patching.layer=0,1`, the basic launcher here):
    each job's grid is that layer's slice of the one-run grid, named in `layers`: the clean and
    corrupted runs bit for bit, the patched logit differences to float32's rounding (a job's
    patched passes stack fewer cells than the one run's, and a matrix product of another row
    count may round its last bits otherwise), the scores to that rounding times 1 / gap."""
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "prompts.jsonl")
    full = run_config(tmp_path / "full", _args(tmp_path / "lm", data)).path
    args = _args(tmp_path / "lm", data, "patching.layer=0,1", "progress=false")
    proc = hookrun_cli(["-m", *args], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = sorted(tmp_path.glob("multirun/*/*/[0-9]*/captures.h5"), key=lambda p: p.parent.name)
    assert len(jobs) == 2
    with h5py.File(full) as a:
        gap = (a["patching/clean"][:] - a["patching/corrupted"][:])[:, None, None]
        for layer, path in enumerate(jobs):
            with h5py.File(path) as b:
                for kind in ("resid", "attn", "mlp"):
                    names = list(a[f"patching/{kind}"].attrs["layers"])
                    assert list(b[f"patching/{kind}"].attrs["layers"]) == [names[layer]]
                    key = f"patching/{kind}_logit_diff"
                    np.testing.assert_allclose(b[key][:], a[key][:, [layer]], atol=1e-6, rtol=0)
                    got, want = b[f"patching/{kind}"][:], a[f"patching/{kind}"][:, [layer]]
                    np.testing.assert_allclose(got * gap, want * gap, atol=2e-6, rtol=0)
                    assert (np.isnan(got) == np.isnan(want)).all()
                for key in ("clean", "corrupted"):
                    np.testing.assert_array_equal(b[f"patching/{key}"][:], a[f"patching/{key}"][:])


def _clean_run(
    folder, lm, data, regex=r"transformer\.h\.\d+(\.attn|\.mlp)?", dtype="float32"
) -> str:
    """A separate clean job: the prompts' module outputs at every position, as `dtype`."""
    args = [
        "experiment=lm_cache",
        "model=hf",
        f"model.path={lm}",
        "dataset=prompts",
        f"dataset.path={data}",
        f"sink.dtype={dtype}",
        f"hooks.resid.select.regex='{regex}'",
        # heads: the input of each attention's output projection
        r"++hooks.heads.select.regex='transformer\.h\.\d+\.attn\.c_proj'",
        "++hooks.heads.at=input",
        "++hooks.heads.action=capture",
        "render=false",
    ]
    return str(run_config(folder, args).path)


def test_a_stored_clean_run_gives_the_one_run_grid(tmp_path):
    """Clean and corrupted as two jobs (patching.clean=FILE): the same grid, every kind (heads
    read from the output projections' captured inputs)."""
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "prompts.jsonl")
    clean = _clean_run(tmp_path / "clean", tmp_path / "lm", data)
    every = "patching.sites=[resid,attn,mlp,heads]"
    one = run_config(tmp_path / "one", _args(tmp_path / "lm", data, every)).path
    two = run_config(
        tmp_path / "two", _args(tmp_path / "lm", data, every, f"patching.clean={clean}")
    ).path
    with h5py.File(one) as a, h5py.File(two) as b:
        gap = a["patching/clean"][:] - a["patching/corrupted"][:]
        for key in ("clean", "corrupted", *(f"{k}_logit_diff" for k in MODULES["gpt2"])):
            np.testing.assert_allclose(b[f"patching/{key}"][:], a[f"patching/{key}"][:], atol=1e-5)
        for key in MODULES["gpt2"]:  # scores times the gap: the logit differences' 1e-5
            got, want = b[f"patching/{key}"][:], a[f"patching/{key}"][:]
            per_row = gap.reshape(-1, *(1,) * (got.ndim - 1))
            np.testing.assert_allclose(got * per_row, want * per_row, atol=2e-5)
        assert b["patching"].attrs["clean_file"] == str(Path(clean).resolve())
        assert len(b["patching"].attrs["clean_sha256"]) == 64


def test_a_stored_clean_run_that_does_not_fit_is_refused_before_any_work(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "prompts.jsonl")
    blocks = _clean_run(tmp_path / "blocks", tmp_path / "lm", data, r"transformer\.h\.\d+")
    other = _prompts(tmp_path / "other.jsonl", [ROWS[1], ROWS[0], ROWS[2]])
    swapped = _clean_run(tmp_path / "swapped", tmp_path / "lm", other)
    cases = {
        blocks: "has no /captures/transformer.h.0.attn/output for the attn grid",
        swapped: "holds other tokens than",
        str(tmp_path / "none.h5"): "is not a file",
    }
    for path, said in cases.items():
        with pytest.raises(HookrunError) as err:
            run_config(tmp_path / "run", _args(tmp_path / "lm", data, f"patching.clean={path}"))
        assert str(err.value).startswith("patching.clean: ") and said in str(err.value)
        assert "\n" not in str(err.value)
        assert not (tmp_path / "run" / "captures.h5").exists()


@pytest.mark.parametrize(
    ("extra", "rows", "said"),
    [
        (
            [],
            [ROWS[0], ("A quick brown fox", " jumps", "A fox", " dog")],
            "prompts.jsonl:2: the counterfactual has",
        ),
        ([], [ROWS[0], ROWS[1][:2]], "prompts.jsonl:2 has no 'counterfactual'"),
        (
            [],
            [ROWS[0], ("A quick brown fox", " jumps", "A lazy brown fox", " jumps")],
            "prompts.jsonl:2: the answer and the counterfactual_answer are one token",
        ),
        (
            [],
            [ROWS[0], ("A quick brown fox", " jumps", "A quick brown fox", " dog")],
            "prompts.jsonl:2: the counterfactual is the prompt itself (the same",
        ),
        (["patching.sites=[resid,blocks]"], ROWS, "patching.sites[1]: 'blocks'"),
        (["patching.positions=[2,8]"], ROWS, "patching.positions: 8 is past the row at"),
        (["patching.positions=[-1]"], ROWS, "patching.positions: [-1]"),
        (["patching.layer=2"], ROWS, "patching.layer: 2 is past the model's 2 layers"),
        (["patching.layer=[0,0]"], ROWS, "patching.layer: [0, 0]; valid: all, a layer index"),
        (["patching.layer=first"], ROWS, "patching.layer: 'first'; valid: all, a layer index"),
    ],
)
def test_refused_in_one_line_before_any_work(tmp_path, extra, rows, said):
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", _args(tmp_path / "lm", data, *extra))
    assert said in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run" / "captures.h5").exists()


def _blind_model_and_rows(tmp_path):
    """A GPT-2 with every attention output zeroed (the read position sees only its own
    token) in tmp_path/lm, and three rows: the first and last change an earlier token only
    (clean = corrupted), the second its last token. The prompts file."""
    model, _ = save_lm(tmp_path / "lm", "gpt2")
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_proj.weight.zero_()
            block.attn.c_proj.bias.zero_()
    model.save_pretrained(tmp_path / "lm")
    rows = [
        ("The cat sat on the", " mat", "The dog sat on the", " cat"),  # same last token
        ("The cat sat on the", " mat", "The cat sat on a", " cat"),  # the last token differs
        ("A quick brown fox", " jumps", "A lazy brown fox", " dog"),  # same last token
    ]
    return _prompts(tmp_path / "prompts.jsonl", rows)


def test_rows_found_unscorable_by_their_passes_are_named_in_log_summary_and_file(tmp_path, caplog):
    """With every attention output zeroed, the read position sees only its own token: a row
    whose counterfactual changes an earlier token has clean = corrupted (every cell NaN)."""
    data = _blind_model_and_rows(tmp_path)
    result = run_config(tmp_path / "run", _args(tmp_path / "lm", data))
    got = read(result.path)
    gap = got["patching/clean"] - got["patching/corrupted"]
    assert (gap == 0).tolist() == [True, False, True]
    assert np.isnan(got["patching/resid"][[0, 2]]).all()
    assert not np.isnan(got["patching/resid"][1]).all()
    with h5py.File(result.path) as f:
        assert f["patching"].attrs["unscorable"].tolist() == [0, 2]
    assert "could not score 2 of 3 rows" in result.summary and "samples 0, 2" in result.summary
    said = [r.getMessage() for r in caplog.records if "logit difference is 0" in r.getMessage()]
    assert said and "dataset rows 0" in said[0]


def test_an_architecture_without_known_module_names_is_refused(tmp_path):
    save_lm(tmp_path / "lm", "bert")
    data = _prompts(tmp_path / "prompts.jsonl")
    args = _args(tmp_path / "lm", data, "model.class=masked_lm")
    with pytest.raises(HookrunError, match=r"^patching.sites: resid, attn, mlp on a bert model"):
        run_config(tmp_path / "run", args)
    assert FAMILIES["bert"][0] == "masked_lm"


@pytest.mark.slow
def test_kill_9_mid_stream_then_resume_gives_the_uninterrupted_bytes(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "prompts.jsonl", ROWS * 14)
    args = [*_args(tmp_path / "lm", data), "progress=false"]
    reference = run_config(tmp_path / "reference", args).path
    run_dir = tmp_path / "killed"
    seen = killed_after(args, tmp_path, run_dir, 6)
    assert seen < len(ROWS) * 14, "the run must be killed mid-stream"
    proc = hookrun_cli([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed, expected = read(run_dir / "captures.h5"), read(reference)
    assert resumed.keys() == expected.keys() and "patching/resid" in expected
    for key in expected:
        assert resumed[key].tobytes() == expected[key].tobytes(), key


@pytest.mark.slow
def test_the_dry_run_says_the_grid_its_chunks_and_datasets(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "prompts.jsonl")
    sites = "patching.sites=[resid,heads]"
    args = [*_args(tmp_path / "lm", data, "patching.batch_size=5", sites), "dry_run=true"]
    proc = hookrun_cli([*args, f"hydra.run.dir={tmp_path / 'dry'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr
    assert "per row: 2 layers × 14 positions (× 2 heads for heads) = 28 resid, 56 heads" in said
    assert "batched 5 rows per patched forward (patching.batch_size)" in said
    assert "[2, 14]" in said and "/patching/resid_logit_diff" in said
    assert "[2, 2, 14]" in said and "/patching/heads_logit_diff" in said
    assert not (tmp_path / "dry" / "captures.h5").exists()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rows_a_stored_clean_run_cannot_score_are_named_too(tmp_path, dtype):
    """The same rows as above with the clean run read from a float16 or bfloat16 file: its
    logits are rounded, so clean − corrupted is a rounding error, not 0; scored, it would be
    a grid of rounding errors divided by a rounding error. Within the stored logits' rounding
    the rows count as unscorable, named and NaN like the one-run ones."""
    data = _blind_model_and_rows(tmp_path)
    clean = _clean_run(tmp_path / "clean", tmp_path / "lm", data, dtype=dtype)
    result = run_config(tmp_path / "run", _args(tmp_path / "lm", data, f"patching.clean={clean}"))
    got = read(result.path)
    gap = got["patching/clean"] - got["patching/corrupted"]
    assert gap[1] != 0 and abs(gap[[0, 2]]).max() < abs(gap[1])  # rounding, not a signal
    assert np.isnan(got["patching/resid"][[0, 2]]).all()
    assert not np.isnan(got["patching/resid"][1]).all()
    with h5py.File(result.path) as f:
        assert f["patching"].attrs["unscorable"].tolist() == [0, 2]
        eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
        assert f["patching"].attrs["clean_tolerance"] == 2 * eps
    assert "could not score 2 of 3 rows" in result.summary


def test_resume_refuses_a_changed_stored_clean_run(tmp_path):
    """The clean file's rows feed every score: a resumed run whose patching.clean file now
    holds other numbers (another run written to the same path) is refused, file untouched."""
    save_lm(tmp_path / "lm", "gpt2")
    data = _prompts(tmp_path / "prompts.jsonl")
    first = _clean_run(tmp_path / "clean", tmp_path / "lm", data)
    other = _clean_run(tmp_path / "other", tmp_path / "lm", data, dtype="float16")
    clean = tmp_path / "clean.h5"
    shutil.copy(first, clean)
    args = _args(tmp_path / "lm", data, f"patching.clean={clean}")
    path = run_config(tmp_path / "run", args).path
    with h5py.File(path, "r+") as f:  # as a stopped run leaves it
        f.attrs["status"] = "interrupted"
        assert json.loads(f.attrs["patch_sources"])["patching.clean"]["file"] == str(clean)
    before = path.read_bytes()
    shutil.copy(other, clean)
    with pytest.raises(HookrunError, match="resume refused: the file patching.clean reads"):
        run_config(tmp_path / "run", [*args, "resume=true"])
    assert path.read_bytes() == before
