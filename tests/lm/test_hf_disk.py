"""dataset=hf_disk (issue 19, part 3): a `datasets` folder written by save_to_disk gives the
rows the same documents give as a .jsonl (dataset=text, dataset=prompts), its sources are
the split's folder and each row's index, and every bad folder is refused in one line that
names the key, the value and the valid choices. The reference is the .jsonl kind, itself
tested against token streams cut by hand (test_token_data.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import h5py
import numpy as np
import pytest
import torch
from conftest import compose_config, hookrun_cli, run_config
from lm_models import save_lm
from test_token_data import word_tokenizer

from hookrun.config.build import build_spec
from hookrun.data.hf_disk import HfDiskDatasetConfig
from hookrun.data.kinds import DATASETS
from hookrun.data.tokens import Tokenizing
from hookrun.errors import HookrunError

DOCS = ["the cat sat on the mat", "", "a dog ran", "the dog sat", "a cat ran on a mat"]
PROMPTS = [
    {"prompt": "the cat sat on the", "answer": " mat", "counterfactual": "the dog sat on the"},
    {"prompt": "a dog ran", "answer": " on", "counterfactual_answer": " sat"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


def build(kind: str, tokenizer, **keys):
    schema = DATASETS.get(kind, "dataset.kind").schema
    cfg = schema(**keys)
    cfg.check()
    return DATASETS.get(kind, "dataset.kind").build(cfg, 0, Tokenizing(tokenizer))


def same_rows(got, want) -> None:
    """The same samples (ids, mask, read marker) and labels, row by row."""
    assert len(got) == len(want)
    for row in range(len(want)):
        (sample, label, _), (expected, expected_label, _) = got[row], want[row]
        assert torch.equal(sample, expected) and label == expected_label, row
    assert (got.padded, got.has_labels, got.kind) == (want.padded, want.has_labels, want.kind)


def save(tmp_path: Path, columns: dict, name: str = "ds") -> Path:
    folder = tmp_path / name
    datasets.Dataset.from_dict(columns).save_to_disk(str(folder))
    return folder


def jsonl(tmp_path: Path, rows: list[dict], name: str = "rows.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(
    "keys",
    [
        {"context": 4},
        {"context": 5, "prepend_bos": True, "read": 0},
        {"context": 4, "pack": False},
        {"context": 8, "pack": False, "prepend_bos": True, "read": -2},
    ],
)
def test_text_rows_equal_the_same_documents_as_jsonl(tmp_path, tokenizer, keys):
    folder = save(tmp_path, {"text": DOCS, "id": list(range(len(DOCS)))})
    path = jsonl(tmp_path, [{"text": doc} for doc in DOCS])
    got = build("hf_disk", tokenizer, path=str(folder), **keys)
    want = build("text", tokenizer, path=str(path), **keys)
    same_rows(got, want)
    # Sources: the folder and each row's 0-based index where the jsonl has its 1-based line.
    assert list(got.sources) == [(str(folder), line - 1) for _, line in want.sources]


def test_another_field_and_the_only_split_of_a_dataset_dict(tmp_path, tokenizer):
    folder = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"body": DOCS, "title": ["t"] * len(DOCS)})}
    ).save_to_disk(str(folder))
    got = build("hf_disk", tokenizer, path=str(folder), field="body", context=4)
    path = jsonl(tmp_path, [{"t": doc} for doc in DOCS])
    want = build("text", tokenizer, path=str(path), field="t", context=4)
    same_rows(got, want)
    assert {name for name, _ in got.sources} == {str(folder / "train")}


def test_prompt_rows_equal_the_same_prompts_as_jsonl(tmp_path, tokenizer):
    columns = {
        key: [row.get(key) for row in PROMPTS]
        for key in ("prompt", "answer", "counterfactual", "counterfactual_answer")
    }
    folder = save(tmp_path, columns)
    got = build("hf_disk", tokenizer, path=str(folder), rows="prompts", context=8)
    want = build("prompts", tokenizer, path=str(jsonl(tmp_path, PROMPTS)), context=8)
    same_rows(got, want)
    assert got.kind == "prompts"
    assert got.counterfactual_ids == want.counterfactual_ids
    assert got.counterfactual_answer == want.counterfactual_answer
    assert got.sources == [(str(folder), 0), (str(folder), 1)]


def refused(tokenizer, **keys) -> str:
    with pytest.raises(HookrunError) as err:
        build("hf_disk", tokenizer, **keys)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_bad_folders_are_refused_naming_key_value_and_choices(tmp_path, tokenizer):
    good = save(tmp_path, {"text": DOCS, "n": list(range(len(DOCS)))})
    says = refused(tokenizer, path=str(tmp_path / "nowhere"))
    assert "dataset.path" in says and "nowhere" in says and "save_to_disk" in says
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.txt").write_text("x\n")
    says = refused(tokenizer, path=str(tmp_path / "plain"))
    assert "dataset.path" in says and "cannot be read as a datasets folder" in says
    says = refused(tokenizer, path=str(good), field="body")
    assert "dataset.field: 'body'" in says and "valid" in says and "text" in says
    says = refused(tokenizer, path=str(good), field="n")
    assert "dataset.field" in says and "'n'" in says and "int64" in says and "valid" in says
    says = refused(tokenizer, path=str(good), split="train")
    assert "dataset.split: 'train'" in says and "valid: null" in says
    says = refused(tokenizer, path=str(good), rows="prompts")
    assert "no 'prompt' column" in says and "text" in says
    says = refused(tokenizer, path=str(save(tmp_path, {"text": ["", " "]}, "blank")))
    assert "is empty" in says
    says = refused(tokenizer, path=str(save(tmp_path, {"text": ["a cat", None]}, "null")))
    assert f"{tmp_path / 'null'}:1" in says and "dataset.field" in says
    # A partial copy: the Arrow data file is gone.
    for arrow in good.glob("*.arrow"):
        arrow.unlink()
    says = refused(tokenizer, path=str(good))
    assert "cannot be read as a datasets folder" in says and str(good) in says


def test_splits_are_chosen_by_name(tmp_path, tokenizer):
    folder = tmp_path / "dict"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": DOCS}),
            "test": datasets.Dataset.from_dict({"text": ["a dog sat on the mat"]}),
        }
    ).save_to_disk(str(folder))
    says = refused(tokenizer, path=str(folder))
    assert "dataset.split: null" in says and "valid: test, train" in says
    says = refused(tokenizer, path=str(folder), split="validation")
    assert "dataset.split: 'validation'" in says and "valid: test, train" in says
    test = build("hf_disk", tokenizer, path=str(folder), split="test", context=4)
    assert test[0][0][0].tolist() == [9, 10, 6, 7] and list(test.sources) == [
        (str(folder / "test"), 0)
    ]


def test_bad_keys_are_refused_before_the_folder_is_read(tokenizer):
    with pytest.raises(HookrunError, match=r"dataset.rows: 'words'; valid: text, prompts"):
        HfDiskDatasetConfig(path="x", rows="words").check()
    with pytest.raises(HookrunError, match="dataset.context"):
        HfDiskDatasetConfig(path="x", context=1).check()
    spec = build_spec(compose_config(["dataset=hf_disk", "dataset.path=x"]))
    assert (spec.dataset.kind, spec.dataset.rows, spec.dataset.split) == ("hf_disk", "text", None)


def test_without_the_datasets_package_it_says_how_to_install_it(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    says = refused(tokenizer, path=str(tmp_path))
    assert "dataset.kind: 'hf_disk' needs the hf extra: pip install 'hookrun[hf]'" in says


def test_a_run_on_a_folder_stores_its_rows_and_sources(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    docs = [f"{' '.join(['the cat sat on the mat'] * (k % 3 + 1))} {k}" for k in range(12)]
    folder = save(tmp_path, {"text": docs})
    corpus = jsonl(tmp_path, [{"text": doc} for doc in docs], "corpus.jsonl")
    common = ["experiment=lm_cache", "model=hf", f"model.path={tmp_path / 'lm'}", "progress=false"]
    common += ["dataset.context=8", "batch_size=3", "render=false"]
    on_folder = run_config(tmp_path / "a", [*common, "dataset=hf_disk", f"dataset.path={folder}"])
    on_file = run_config(tmp_path / "b", [*common, "dataset=text", f"dataset.path={corpus}"])
    with h5py.File(on_folder.path) as a, h5py.File(on_file.path) as b:
        for key in ("samples/tokens", "captures/transformer.h.1/output", "model/output"):
            np.testing.assert_array_equal(a[key][:], b[key][:], err_msg=key)
        assert {p.decode() for p in a["samples/path"][:]} == {str(folder)}
        np.testing.assert_array_equal(a["samples/line"][:], b["samples/line"][:] - 1)


def test_prompt_rows_from_a_folder_drive_logit_diff_as_the_jsonl_does(tmp_path):
    from test_lm_gradients import ROWS, _args

    save_lm(tmp_path / "lm", "gpt2")
    columns = {key: [row.get(key) for row in ROWS] for key in ("prompt", "answer")}
    columns["counterfactual_answer"] = [row["counterfactual_answer"] for row in ROWS]
    folder = save(tmp_path, columns)
    on_file = _args(tmp_path / "lm", jsonl(tmp_path, ROWS), "logit_diff", "gpt2")
    on_folder = [*on_file, "dataset=hf_disk", f"dataset.path={folder}", "dataset.rows=prompts"]
    a = run_config(tmp_path / "a", on_folder).path
    b = run_config(tmp_path / "b", on_file).path
    with h5py.File(a) as fa, h5py.File(b) as fb:
        for key in ("samples/target", "samples/counterfactual_target", "samples/tokens"):
            np.testing.assert_array_equal(fa[key][:], fb[key][:], err_msg=key)
        np.testing.assert_array_equal(
            fa["captures/transformer.wte/grad_output"][:],
            fb["captures/transformer.wte/grad_output"][:],
        )
    # Text rows name no answers: refused before any work, saying which rows it read.
    text = save(tmp_path, {"text": [row["prompt"] for row in ROWS]}, "text")
    with pytest.raises(HookrunError, match="dataset=hf_disk with text rows"):
        run_config(
            tmp_path / "c",
            [*on_file, "dataset=hf_disk", f"dataset.path={text}", "dataset.context=8"],
        )


def test_damaged_arrow_data_and_keys_of_the_other_rows_are_refused(tmp_path, tokenizer):
    folder = save(tmp_path, {"text": ["the cat sat on the mat", "a dog ran on the mat"]})
    (arrow,) = folder.glob("*.arrow")
    raw = arrow.read_bytes()
    at = raw.index(b"a dog ran")
    arrow.write_bytes(raw[:at] + b"\xff" + raw[at + 1 :])  # no longer UTF-8
    says = refused(tokenizer, path=str(folder))
    assert "dataset.path" in says and str(folder) in says and "valid" in says
    prompts = save(tmp_path, {"prompt": ["a cat"]}, "prompts")
    for key, value, said in (("read", 0, "0"), ("pack", False, "false"), ("field", "b", "b")):
        says = refused(tokenizer, path=str(prompts), rows="prompts", **{key: value})
        assert f"dataset.{key}: {said} applies to rows: text" in says
    says = refused(tokenizer, path=str(save(tmp_path, {"text": ["a cat", None]}, "n")))
    assert "'text' is null at" in says


@pytest.mark.slow
def test_damaged_offsets_are_refused_before_they_are_read(tmp_path):
    # Offsets pointing far past the text buffer would read out of bounds (a crash, or
    # wrong text): pyarrow's full check refuses the folder first. In a child process, so a
    # regression crashes it, not the test run.
    texts = [f"document number {k} about the cat" for k in range(8)]
    folder = save(tmp_path, {"text": texts})
    (arrow,) = folder.glob("*.arrow")
    ends = np.cumsum([0] + [len(t) for t in texts]).astype("<i4").tobytes()
    raw = arrow.read_bytes()
    at = raw.index(ends)
    bad = np.array([1 << 30], "<i4").tobytes()
    arrow.write_bytes(raw[: at + 12] + bad + raw[at + 16 :])  # the fourth offset
    save_lm(tmp_path / "lm", "gpt2")
    proc = hookrun_cli(
        [
            "experiment=lm_cache",
            "model=hf",
            f"model.path={tmp_path / 'lm'}",
            "dataset=hf_disk",
            f"dataset.path={folder}",
            "dataset.context=4",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-1500:]
    assert "holds damaged Arrow data" in proc.stderr and str(folder) in proc.stderr


def test_rows_pickle_by_value_outside_the_loader(tmp_path, tokenizer):
    import copy
    import pickle

    folder = save(tmp_path, {"text": DOCS})
    data = build("hf_disk", tokenizer, path=str(folder), context=4)
    dumped = pickle.dumps(data)
    for again in (pickle.loads(dumped), pickle.loads(dumped), copy.deepcopy(data)):
        same_rows(again, data)
