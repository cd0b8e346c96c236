"""`hookrun.run` from Python with a language model's data as plain values (issue 30): a list
of prompt dicts or of strings gives the file of the same rows given as a .jsonl (every
dataset byte for byte but /samples/path, which names the file the rows were read from), and
a Hugging Face model with its tokenizer runs as model=hf on its save_pretrained folder."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import transformers
from conftest import read

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lm"))
from lm_models import save_lm, tokenizer, write_jsonl  # noqa: E402

import hookrun  # noqa: E402
from hookrun.errors import HookrunError  # noqa: E402

PROMPTS = [
    {"prompt": "The cat sat on the", "answer": " mat"},
    {"prompt": "A quick brown fox jumps over the lazy", "answer": " dog"},
    {"prompt": "Hooks capture", "answer": " every"},
]
DOCUMENTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.", "Hooks"]
CAPTURE = [
    "++hooks.b.select.name=transformer.h.1",
    "++hooks.b.at=output",
    "++hooks.b.action=capture",
    "render=false",
    "progress=false",
]


def _same_but_paths(a: Path, b: Path, inline: Path) -> None:
    got, want = read(a), read(b)
    assert got.keys() == want.keys()
    for key in want:
        if key == "samples/path":
            assert {bytes(p).decode() for p in got[key]} == {str(inline)}
            continue
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.fixture
def lm(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    return tmp_path / "lm"


def test_prompt_dicts_give_the_file_of_the_same_jsonl(lm, tmp_path):
    write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    base = ["model=hf", f"model.path={lm}", "dataset=prompts", "target.kind=answer", *CAPTURE]
    want = hookrun.run([*base, f"dataset.path={tmp_path / 'p.jsonl'}"], run_dir=tmp_path / "file")
    got = hookrun.run(base, dataset=PROMPTS, run_dir=tmp_path / "inline")
    _same_but_paths(got.path, want.path, tmp_path / "inline" / "dataset.jsonl")
    assert (tmp_path / "inline" / "dataset.jsonl").read_text() == (tmp_path / "p.jsonl").read_text()


def test_strings_are_documents_as_dataset_text_reads_them(lm, tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in DOCUMENTS])
    base = ["model=hf", f"model.path={lm}", "target.kind=next_token", *CAPTURE]
    text = ["dataset=text", "dataset.context=8"]
    want = hookrun.run(
        [*base, *text, f"dataset.path={tmp_path / 'd.jsonl'}"], run_dir=tmp_path / "file"
    )
    got = hookrun.run([*base, *text], dataset=DOCUMENTS, run_dir=tmp_path / "inline")
    _same_but_paths(got.path, want.path, tmp_path / "inline" / "dataset.jsonl")


def test_a_hugging_face_model_with_its_tokenizer_runs_as_model_hf(lm, tmp_path):
    write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    data = ["dataset=prompts", f"dataset.path={tmp_path / 'p.jsonl'}", "target.kind=answer"]
    want = hookrun.run(["model=hf", f"model.path={lm}", *data, *CAPTURE], run_dir=tmp_path / "a")
    model = transformers.AutoModelForCausalLM.from_pretrained(lm)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = hookrun.run([*data, *CAPTURE], model=model, tokenizer=tokenizer(), run_dir=tmp_path / "b")
    a, b = read(got.path), read(want.path)
    for key in ("captures/transformer.h.1/output", "model/output", "samples/tokens"):
        np.testing.assert_allclose(a[key], b[key], atol=1e-6, err_msg=key)
    assert all(model.state_dict()[k].equal(v) for k, v in before.items())  # left as it came
    assert not any(m._forward_hooks for m in model.modules())


@pytest.mark.parametrize(
    ("dataset", "said"),
    [
        (["a text", {"prompt": "p"}], "dataset: a list mixing strings, dicts and other items"),
        ([{"prompt": "p", "answr": " x"}], "dataset[0]: has the key 'answr'; valid keys: prompt"),
        ([{"answer": " x"}], "dataset[0]: has no 'prompt'"),
        ([{"prompt": 3}], "dataset[0].prompt: 3; valid: a string"),
    ],
)
def test_bad_rows_are_refused_in_one_line(lm, tmp_path, dataset, said):
    with pytest.raises(HookrunError) as err:
        hookrun.run(["model=hf", f"model.path={lm}", *CAPTURE], dataset=dataset, run_dir=tmp_path)
    assert str(err.value).startswith(said), str(err.value)
    assert not (tmp_path / "captures.h5").exists()


def test_rows_never_replace_an_earlier_runs_file(lm, tmp_path):
    (tmp_path / "dataset.jsonl").write_text('{"text": "earlier"}\n')
    with pytest.raises(HookrunError, match="holds other rows than the ones given"):
        hookrun.run(["model=hf", f"model.path={lm}", *CAPTURE], dataset=DOCUMENTS, run_dir=tmp_path)
    assert (tmp_path / "dataset.jsonl").read_text() == '{"text": "earlier"}\n'


@pytest.mark.parametrize("side", ["right", "left"])
def test_token_ids_made_already_give_the_file_of_the_same_prompts(lm, tmp_path, side):
    """A tokenizer's output, padded on either side, runs as the same prompts from a .jsonl:
    every dataset equal but the rows' source names."""
    rows = [{"prompt": p["prompt"]} for p in PROMPTS]
    write_jsonl(tmp_path / "p.jsonl", rows)
    base = ["model=hf", f"model.path={lm}", "target.kind=predicted", *CAPTURE]
    want = hookrun.run(
        [*base, "dataset=prompts", f"dataset.path={tmp_path / 'p.jsonl'}"], run_dir=tmp_path / "f"
    )
    tok = tokenizer()
    tok.padding_side = side
    given = dict(tok([r["prompt"] for r in rows], padding=True, return_tensors="pt"))
    given["attention_mask"] = given["attention_mask"].bool()  # a bool mask is a mask too
    got = hookrun.run(base, dataset=given, run_dir=tmp_path / side)
    a, b = read(got.path), read(want.path)
    assert a.keys() == b.keys()
    for key in b:
        if key in ("samples/path", "samples/line"):
            continue
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert {bytes(p).decode() for p in a["samples/path"]} == {"input_ids"}


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"input_ids": [[1, 2], [3, 4]], "labels": [[1, 2], [3, 4]]}, "dataset.labels: not a key"),
        ({"input_ids": [1.5, 2.0]}, "dataset.input_ids: float64 of shape [2]; valid: integers"),
        (
            {"input_ids": [[1, 2, 3]], "attention_mask": [[1, 0, 1]]},
            "dataset.attention_mask: row 0 is not one run of real tokens",
        ),
        (
            {"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1]]},
            "dataset.attention_mask: shape [1, 2] of values [1]; valid: 0s and 1s",
        ),
        ({"input_ids": [[1, 2, 3], [4, 5]]}, "dataset.input_ids: rows of different lengths; "),
        ({"input_ids": [[1, 2], [-1, 4]]}, "dataset.input_ids: -1 at row 1, token 0; valid:"),
    ],
)
def test_bad_token_ids_are_refused_before_any_work(lm, tmp_path, given, said):
    base = ["model=hf", f"model.path={lm}", "target.kind=predicted", *CAPTURE]
    with pytest.raises(HookrunError) as err:
        hookrun.run(base, dataset=given, run_dir=tmp_path / "r")
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "r" / "captures.h5").exists()


def test_strings_with_keys_of_dataset_text_and_a_model_object(lm, tmp_path):
    """Strings are read as dataset=text: its keys (`dataset.pack`, `dataset.context`) can be
    set beside them from Python, with no experiment naming the kind (issue 40)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(lm)
    keys = ["dataset.pack=false", "dataset.context=32", "render=false", "progress=false"]
    got = hookrun.run(keys, model=model, tokenizer=tokenizer(), dataset=DOCUMENTS, run_dir=tmp_path)
    with hookrun.open(got.path) as res:
        assert res.config.dataset.pack is False and res.config.dataset.context == 32
        assert res.completed == len(DOCUMENTS)  # one row per document: not packed
        lengths = res["samples/mask"][()].sum(axis=1)
    want = [min(len(tokenizer()(d)["input_ids"]), 32) for d in DOCUMENTS]
    assert lengths.tolist() == want


def test_token_ids_for_a_model_that_is_no_language_model_are_refused(tmp_path):
    import torchvision

    ids = {"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]]}
    with pytest.raises(HookrunError) as err:
        hookrun.run(
            ["render=false"], model=torchvision.models.resnet18(), dataset=ids, run_dir=tmp_path
        )
    said = "dataset: token rows are a language model's input, and this run's model (a ResNet)"
    assert str(err.value).startswith(said) and "valid: " in str(err.value)


def test_strings_for_a_transformers_model_without_its_tokenizer_name_the_tokenizer(lm, tmp_path):
    """The model is a language model: what is missing is its tokenizer, not another model
    (it was refused as "this run's model is not one")."""
    model = transformers.AutoModelForCausalLM.from_pretrained(lm)
    with pytest.raises(HookrunError) as err:
        hookrun.run(["render=false"], model=model, dataset=DOCUMENTS, run_dir=tmp_path)
    said = str(err.value)
    assert said.startswith("dataset: a list of strings is read with a tokenizer, and the GPT2")
    assert "valid: hookrun.run(..., model=model, tokenizer=" in said and "\n" not in said
    assert not list(tmp_path.rglob("*.h5"))
