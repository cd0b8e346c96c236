"""dataset=repeated_tokens and experiment=induction: the rows are a seeded random sequence of
distinct non-special tokens repeated; the induction score per head equals a hand computation
from the model's own `output_attentions=True` probabilities; on the shipped tiny_lm
a head scores >= 0.4 and the same config with random weights < 0.1 everywhere."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import run_config
from lm_models import save_lm, tokenizer

import hookrun
from hookrun.data.kinds import DATASETS
from hookrun.data.tokens import Tokenizing
from hookrun.errors import HookrunError
from hookrun.verify import verify


def test_rows_are_a_seeded_sequence_of_distinct_ordinary_tokens_repeated():
    tok = tokenizer()
    kind = DATASETS.get("repeated_tokens", "dataset")
    cfg = kind.schema(length=7, repeats=3, size=5, prepend_bos=True)
    data = kind.build(cfg, 3, Tokenizing(tok))
    assert len(data) == 5 and data.tokens and not data.padded
    specials = set(tok.all_special_ids)
    rows = []
    for i in range(5):
        sample, label, index = data[i]
        assert sample.shape == (3, 22) and index == i
        ids = sample[0].tolist()
        assert ids[0] == tok.bos_token_id
        seq = ids[1:8]
        assert ids[1:] == seq * 3 and len(set(seq)) == 7
        assert not specials & set(seq) and max(seq) < len(tok)
        assert sample[1].tolist() == [1] * 22 and sample[2].tolist() == [0] * 20 + [1, 0]
        assert label == ids[-1]
        rows.append(ids)
    assert len({tuple(r) for r in rows}) == 5
    again = kind.build(cfg, 3, Tokenizing(tok))
    other = kind.build(cfg, 4, Tokenizing(tok))
    assert all(torch.equal(again[i][0], data[i][0]) for i in range(5))
    assert not all(torch.equal(other[i][0], data[i][0]) for i in range(5))
    plain = kind.build(kind.schema(length=7, repeats=2, size=2), 3, Tokenizing(tok))
    assert plain[0][0].shape == (3, 14)


def test_refusals():
    tok = tokenizer()
    kind = DATASETS.get("repeated_tokens", "dataset")
    with pytest.raises(HookrunError, match=r"^dataset\.length: 5000 distinct tokens, but the"):
        kind.build(kind.schema(length=5000, repeats=2, size=2), 0, Tokenizing(tok))
    with pytest.raises(HookrunError, match=r"^dataset\.repeats: 0"):
        kind.schema(length=5, repeats=0, size=2).check()


def _hand_scores(model, tokens: np.ndarray, length: int, start: int) -> np.ndarray:
    """(layers, heads): by loops over rows and positions of output_attentions=True."""
    total = None
    for ids in tokens:
        with torch.no_grad():
            att = model(input_ids=torch.tensor([ids.tolist()]), output_attentions=True).attentions
        per = np.zeros((len(att), att[0].shape[1]))
        for layer, a in enumerate(att):
            for head in range(a.shape[1]):
                values = [
                    float(a[0, head, p, p - length + 1]) for p in range(start + length, len(ids))
                ]
                per[layer, head] = sum(values) / len(values)
        total = per if total is None else total + per
    return total / len(tokens)


def _induction(tmp_path: Path, folder: Path, extra: list[str]) -> Path:
    overrides = [
        "experiment=induction",
        "model=hf",
        f"model.path={folder}",
        "batch_size=4",
        *extra,
    ]
    return run_config(tmp_path, overrides, "induction").path


def test_scores_equal_a_hand_computation_from_output_attentions(tmp_path):
    model, _ = save_lm(tmp_path / "lm", "gpt2")
    args = ["dataset.length=5", "dataset.repeats=3", "dataset.size=6", "dataset.prepend_bos=true"]
    path = _induction(tmp_path / "run", tmp_path / "lm", args)
    with h5py.File(path) as f:
        score, rows = f["induction/score"][()], f["induction/rows"][()]
        layers = [str(x) for x in f["induction/score"].attrs["layers"]]
        tokens = f["samples/tokens"][()]
    assert layers == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert score.shape == (2, 2) and rows.shape == (6, 2, 2)
    np.testing.assert_allclose(score, _hand_scores(model, tokens, 5, 1), atol=1e-6, rtol=0)
    np.testing.assert_allclose(rows[2], _hand_scores(model, tokens[2:3], 5, 1), atol=1e-6)
    images = path.parent / "images/induction"
    assert (images / "induction_scores.png").stat().st_size > 0
    for layer in layers:
        assert (images / f"attention_{layer}.png").stat().st_size > 0
    assert verify(path)[0]


def test_the_shipped_tiny_lm_has_an_induction_head_and_its_random_init_has_none(tmp_path):
    """experiment=induction with nothing named runs the shipped tiny_lm: one head scores at
    least 0.4 (scripts/train_tiny_lm.py trains it, training.json says how far); the same
    config and tokenizer with random weights score below 0.1 everywhere."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny = Path(hookrun.__file__).parent / "models" / "checkpoints" / "tiny_lm"
    trained = run_config(tmp_path / "trained", ["experiment=induction", "render=false"]).path
    shipped = AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
    torch.manual_seed(0)
    type(shipped)(shipped.config).save_pretrained(tmp_path / "random")
    AutoTokenizer.from_pretrained(tiny, local_files_only=True).save_pretrained(tmp_path / "random")
    random = _induction(tmp_path / "run", tmp_path / "random", ["render=false"])
    with h5py.File(trained) as f, h5py.File(random) as g:
        ours, theirs = f["induction/score"][()], g["induction/score"][()]
        assert f["samples/tokens"].shape == g["samples/tokens"].shape == (64, 50)
    assert ours.max() >= 0.4, ours
    assert theirs.max() < 0.1, theirs


def test_generated_rows_name_their_kind_from_any_folder(tmp_path, monkeypatch):
    """/samples/path of generated rows says `repeated_tokens` whatever folder the run starts
    from (it was made absolute: another folder's resume was refused as other rows)."""
    args = ["experiment=induction", "dataset.size=4", "batch_size=2", "render=false"]
    paths = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        with h5py.File(run_config(tmp_path / folder / "run", args).path) as f:
            paths.append([p.decode() for p in f["samples/path"][()]])
    assert paths[0] == paths[1] == ["repeated_tokens"] * 4
    monkeypatch.chdir(tmp_path)  # a resume from a third folder continues the file
    resumed = run_config(tmp_path / "a" / "run", [*args, "resume=true"])
    assert resumed.rows == 4
