"""Token data (issue 19, part 3): `dataset=text` and `dataset=prompts` rows against the
token stream cut by hand, and every refusal naming its key, file and line.

The tokenizer is a word-level one with a fixed vocabulary, so that the expected ids are
written down by hand: [PAD]=0 [UNK]=1 [BOS]=2 [EOS]=3 the=4 cat=5 sat=6 on=7 mat=8 a=9
dog=10 ran=11.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hookrun.config.build import build_spec
from hookrun.data.kinds import DATASETS, NO_LABEL
from hookrun.data.prompts import PromptsDatasetConfig
from hookrun.data.text import TextDatasetConfig
from hookrun.data.tokens import Tokenizing, check_vocab, token_rows
from hookrun.errors import HookrunError

WORDS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
ID = {w: i for i, w in enumerate(WORDS)}
PAD, BOS, EOS = 0, 2, 3


def word_tokenizer(**special: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(ID, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if not special:
        special = {"pad_token": "[PAD]", "bos_token": "[BOS]", "eos_token": "[EOS]"}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", **special)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer()


def ids(text: str) -> list[int]:
    return [ID[w] for w in text.split()]


def text_data(path: Path, tokenizer, **keys):
    cfg = TextDatasetConfig(path=str(path), **keys)
    cfg.check()
    return DATASETS.get("text", "dataset.kind").build(cfg, 0, Tokenizing(tokenizer))


def prompt_data(path: Path, tokenizer, **keys):
    cfg = PromptsDatasetConfig(path=str(path), **keys)
    cfg.check()
    return DATASETS.get("prompts", "dataset.kind").build(cfg, 0, Tokenizing(tokenizer))


def items(data) -> tuple[torch.Tensor, list[int]]:
    rows = [data[i] for i in range(len(data))]
    assert [i for _, _, i in rows] == list(range(len(data)))
    return torch.stack([t for t, _, _ in rows]), [label for _, label, _ in rows]


DOCS = ["the cat sat on the mat", "", "a dog ran", "the dog sat"]


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(DOCS) + "\n")  # line 2 is blank: skipped, still counted
    return path


def test_kinds_are_token_kinds_with_presets():
    for kind in ("text", "prompts"):
        assert DATASETS.get(kind, "dataset.kind").tokens
    assert not DATASETS.get("fake", "dataset.kind").tokens
    spec = build_spec(compose_config(["dataset=text", "dataset.path=x.txt", "dataset.read=-2"]))
    assert (spec.dataset.kind, spec.dataset.context, spec.dataset.pack) == ("text", 128, True)
    assert spec.dataset.read == -2 and spec.dataset.prepend_bos is False
    spec = build_spec(compose_config(["dataset=prompts", "dataset.context=16"]))
    assert (spec.dataset.kind, spec.dataset.path, spec.dataset.context) == ("prompts", None, 16)


def test_pack_rows_are_the_joined_stream_cut_into_rows(corpus, tokenizer):
    data = text_data(corpus, tokenizer, context=4)
    # Independently: each document tokenized alone, joined by eos, cut into rows of 4.
    docs = [d for d in DOCS if d]
    stream: list[int] = []
    for k, doc in enumerate(docs):
        stream += tokenizer(doc, add_special_tokens=False)["input_ids"] + [EOS] * (k < 2)
    expected = torch.tensor(stream[: len(stream) // 4 * 4]).reshape(-1, 4)
    # By hand: the cat sat on | the mat EOS a | dog ran EOS the | (dog sat dropped)
    assert expected.tolist() == [[4, 5, 6, 7], [4, 8, 3, 9], [10, 11, 3, 4]]
    tensors, labels = items(data)
    assert tensors.dtype == torch.int64 and tensors.shape == (3, 3, 4)
    assert torch.equal(tensors[:, 0], expected)
    assert (tensors[:, 1] == 1).all()
    assert tensors[:, 2].tolist() == [[0, 0, 1, 0]] * 3  # read: the second-to-last token
    assert labels == [7, 9, 4]  # the actual next token: the last of each row
    path = str(corpus)
    assert data.sources == [(path, 1), (path, 1), (path, 3)]  # the row's first token's line
    assert data.has_labels and data.tokens and not data.padded


def test_pack_with_bos_starts_every_row_with_it(corpus, tokenizer):
    data = text_data(corpus, tokenizer, context=4, prepend_bos=True, read=0)
    tensors, labels = items(data)
    # stream: the cat sat | on the mat | EOS a dog | ran EOS the | (dog sat dropped)
    assert tensors[:, 0].tolist() == [
        [BOS, 4, 5, 6],
        [BOS, 7, 4, 8],
        [BOS, 3, 9, 10],
        [BOS, 11, 3, 4],
    ]
    assert (tensors[:, 2, 0] == 1).all() and tensors[:, 2].sum() == 4
    assert labels == [4, 7, 3, 11]
    path = str(corpus)
    # Row 2 starts at the separator after document 1: its document's line.
    assert data.sources == [(path, 1), (path, 1), (path, 1), (path, 3)]


def test_one_row_per_document_pads_right_with_the_mask(corpus, tokenizer):
    data = text_data(corpus, tokenizer, context=5, pack=False)
    tensors, labels = items(data)
    assert tensors[:, 0].tolist() == [[4, 5, 6, 7, 4], [9, 10, 11, PAD, PAD], [4, 10, 6, 0, 0]]
    assert tensors[:, 1].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    assert tensors[:, 2].tolist() == [[0, 0, 0, 1, 0], [0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]
    assert labels == [4, 11, 6]
    assert data.padded
    path = str(corpus)
    assert data.sources == [(path, 1), (path, 3), (path, 4)]
    # Negative read positions count from the end of the real tokens.
    tensors, labels = items(text_data(corpus, tokenizer, context=5, pack=False, read=-3))
    assert tensors[:, 2].argmax(1).tolist() == [2, 0, 0] and labels == [7, 10, 10]
    tensors, labels = items(text_data(corpus, tokenizer, context=5, pack=False, prepend_bos=True))
    assert tensors[:, 0].tolist()[1] == [BOS, 9, 10, 11, PAD] and labels == [7, 11, 6]


def test_pad_falls_back_to_eos(corpus):
    tokenizer = word_tokenizer(eos_token="[EOS]")
    data = text_data(corpus, tokenizer, context=4, pack=False)
    assert data[1][0][0].tolist() == [9, 10, 11, EOS] and data[1][0][1].tolist() == [1, 1, 1, 0]


def test_jsonl_and_folders_sorted_by_name(tmp_path, tokenizer):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "b.jsonl").write_text('{"body": "a dog ran", "n": 1}\n\n{"body": "the cat"}\n')
    (folder / "a.txt").write_text("the mat\n")
    (folder / "notes.md").write_text("not data\n")
    data = text_data(folder, tokenizer, context=3, pack=False, field="body")
    tensors, _ = items(data)
    assert tensors[:, 0].tolist() == [[4, 8, 0], [9, 10, 11], [4, 5, 0]]
    a, b = str(folder / "a.txt"), str(folder / "b.jsonl")
    assert data.sources == [(a, 1), (b, 1), (b, 3)]
    packed = text_data(folder / "b.jsonl", tokenizer, context=3, field="body")
    assert items(packed)[0][:, 0].tolist() == [[9, 10, 11], [3, 4, 5]]


def test_relative_and_home_paths(corpus, tokenizer, monkeypatch):
    monkeypatch.chdir(corpus.parent)
    assert text_data(Path("corpus.txt"), tokenizer, context=4).sources[0][0] == str(corpus)
    monkeypatch.setenv("HOME", str(corpus.parent))
    assert text_data(Path("~/corpus.txt"), tokenizer, context=4).sources[0][0] == str(corpus)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompts_are_as_long_as_the_longest_and_labelled_by_the_answer(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "the cat sat on the", "answer": " mat", "counterfactual": "a dog"},
            {"prompt": "a dog", "answer": "ran away", "counterfactual_answer": " sat"},
        ],
    )
    data = prompt_data(path, tokenizer)
    tensors, labels = items(data)
    assert tensors.shape == (2, 3, 5)  # T = the longest prompt, not the context
    assert tensors[:, 0].tolist() == [[4, 5, 6, 7, 4], [9, 10, PAD, PAD, PAD]]
    assert tensors[:, 1].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert tensors[:, 2].tolist() == [[0, 0, 0, 0, 1], [0, 1, 0, 0, 0]]  # the last real token
    assert labels == [ID["mat"], ID["ran"]] and data.has_labels and data.padded
    assert data.counterfactual_ids == [[9, 10], None]
    assert data.counterfactual_answer == [None, ID["sat"]]
    assert data.sources == [(str(path), 1), (str(path), 2)]
    with_bos = prompt_data(path, tokenizer, prepend_bos=True)
    assert with_bos[1][0][0].tolist() == [BOS, 9, 10, PAD, PAD, PAD]
    assert with_bos.counterfactual_ids == [[BOS, 9, 10], None]
    unlabelled = prompt_data(write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a"}]), tokenizer)
    assert unlabelled[0][1] == NO_LABEL and not unlabelled.has_labels and not unlabelled.padded


def test_answers_are_tokenized_as_written(tmp_path):
    # GPT-2-like words that keep their leading space: " mat" and "mat" are different tokens.
    vocab = {"[PAD]": 0, "[UNK]": 1, "the": 2, " cat": 3, "mat": 4, " mat": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[a-z]+"), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]")
    rows = [{"prompt": "the cat", "answer": " mat"}, {"prompt": "the", "answer": "mat"}]
    data = prompt_data(write_jsonl(tmp_path / "p.jsonl", rows), tokenizer)
    assert data[0][0][0].tolist() == [2, 3] and [data[i][1] for i in range(2)] == [5, 4]


def test_check_vocab_names_the_line_of_the_first_id_past_it(tmp_path, tokenizer):
    path = tmp_path / "c.txt"
    path.write_text("the the\n\nthe cat the\n")  # the=4, cat=5: vocab_size 5 lacks cat
    for keys in ({"context": 3}, {"context": 4, "pack": False}):
        data = text_data(path, tokenizer, **keys)
        check_vocab(data, 6)
        with pytest.raises(HookrunError) as err:
            check_vocab(torch.utils.data.Subset(data, [0]), 5)  # the whole dataset
        assert_names(err, "dataset.path", f"{path}:3", "token id 5")
    rows = [{"prompt": "the", "answer": " the"}, {"prompt": "the", "answer": " cat"}]
    data = prompt_data(write_jsonl(tmp_path / "p.jsonl", rows), tokenizer)
    with pytest.raises(HookrunError) as err:
        check_vocab(data, 5)
    assert_names(err, "dataset.path", "p.jsonl:2", "answer")
    rows = [{"prompt": "the", "counterfactual": "the cat"}]
    data = prompt_data(write_jsonl(tmp_path / "q.jsonl", rows), tokenizer)
    with pytest.raises(HookrunError) as err:
        check_vocab(data, 5)
    assert_names(err, "dataset.path", "q.jsonl:1", "counterfactual")
    assert token_rows(data) is data and token_rows(torch.utils.data.TensorDataset()) is None


def assert_names(err: pytest.ExceptionInfo, *parts: str) -> None:
    message = str(err.value)
    assert "\n" not in message and "valid:" in message, message
    for part in parts:
        assert part in message, (part, message)


def refused(build, path: Path, tokenizer, **keys) -> pytest.ExceptionInfo:
    with pytest.raises(HookrunError) as err:
        build(path, tokenizer, **keys)
    return err


BAD_LINES = [
    ("t.jsonl", b'{"text": "the"}\n\n{"text": "cat"\n', {}, "dataset.path", 3, "not JSON"),
    ("t.jsonl", b'{"text": "the"}\n[1, 2]\n', {}, "dataset.path", 2, "not an object"),
    ("t.jsonl", b'{"text": "the"}\n{"body": "cat"}\n', {}, "dataset.field", 2, "missing"),
    ("t.jsonl", b'{"text": "the"}\n{"text": 5}\n', {}, "dataset.field", 2, "a string"),
    ("t.jsonl", b'{"body": "the"}\n{"body": null}\n', {"field": "body"}, "dataset.field", 2, ""),
    ("t.txt", b"the cat\nthe \xff cat\n", {}, "dataset.path", 2, "UTF-8"),
    ("t.jsonl", b'{"text": "a"}\n{"text": "the \\ud800"}\n', {}, "dataset.field", 2, "UTF-8"),
    ("t.txt", b"the cat\ndog\n", {"pack": False}, "dataset.read", 2, "tokens"),
    ("t.txt", b"the cat\ndog\n", {"pack": False, "read": 0}, "dataset.read", 2, ""),
]


@pytest.mark.parametrize(("name", "content", "keys", "key", "line", "says"), BAD_LINES)
def test_bad_text_lines_are_named(tmp_path, tokenizer, name, content, keys, key, line, says):
    path = tmp_path / name
    path.write_bytes(content)
    err = refused(text_data, path, tokenizer, context=4, **keys)
    assert_names(err, key, f"{path}:{line}", says)


BAD_PROMPTS = [
    ([{"prompt": "the"}, {"answer": " cat"}], {}, "dataset.path", 2, "prompt"),
    ([{"prompt": "the"}, {"prompt": ["the"]}], {}, "dataset.path", 2, "a string"),
    ([{"prompt": "the"}, {"prompt": "a", "answer": 3}], {}, "dataset.path", 2, "answer"),
    ([{"prompt": "the"}, {"prompt": "a", "answer": "cat"}], {}, "dataset.path", 1, "answer"),
    ([{"prompt": "a", "answer": "cat"}, {"prompt": "the"}], {}, "dataset.path", 2, "answer"),
    ([{"prompt": "a"}, {"prompt": "the cat sat on"}], {"context": 3}, "dataset.context", 2, ""),
    (
        [{"prompt": "the cat", "counterfactual": "a dog ran"}],
        {"context": 2},
        "dataset.context",
        1,
        "",
    ),
    ([{"prompt": "the", "answer": ""}], {}, "dataset.path", 1, "no tokens"),
    ([{"prompt": ""}], {}, "dataset.path", 1, "no tokens"),
    ([{"prompt": "a"}, {"prompt": "a"}], {"context": 2, "prepend_bos": True}, "", 0, ""),
]


@pytest.mark.parametrize(("rows", "keys", "key", "line", "says"), BAD_PROMPTS)
def test_bad_prompts_are_named(tmp_path, tokenizer, rows, keys, key, line, says):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    if not key:  # a bos plus one token fits a context of 2
        assert prompt_data(path, tokenizer, **keys)[0][0].shape == (3, 2)
        return
    assert_names(refused(prompt_data, path, tokenizer, **keys), key, f"{path}:{line}", says)


def test_bad_paths_and_files_are_named(tmp_path, tokenizer):
    missing = tmp_path / "nope.txt"
    assert_names(refused(text_data, missing, tokenizer), "dataset.path", "nope.txt", "not exist")
    with pytest.raises(HookrunError) as err:
        DATASETS.get("text", "dataset.kind").build(TextDatasetConfig(), 0, Tokenizing(tokenizer))
    assert_names(err, "dataset.path: null")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    assert_names(refused(text_data, blank, tokenizer), "dataset.path", str(blank), "empty")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_names(refused(prompt_data, empty, tokenizer), "dataset.path", str(empty), "empty")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "x.csv").write_text("the\n")
    assert_names(refused(text_data, folder, tokenizer), "dataset.path", str(folder), ".txt")
    assert_names(refused(prompt_data, folder, tokenizer), "dataset.path", "folder", ".jsonl")
    assert_names(refused(text_data, folder / "x.csv", tokenizer), "dataset.path", "x.csv")
    text = tmp_path / "t.txt"
    text.write_text("the cat\n")
    assert_names(refused(prompt_data, text, tokenizer), "dataset.path", "t.txt", ".jsonl")


def test_sizes_and_tokenizers_that_cannot_work_are_refused(corpus, tokenizer):
    for keys, key in (
        ({"context": 1}, "dataset.context"),
        ({"context": 10**12}, "dataset.context"),
        ({"read": "first"}, "dataset.read"),
        ({"read": True}, "dataset.read"),
        ({"read": -1}, "dataset.read"),
        ({"read": 4, "context": 5}, "dataset.read"),
        ({"field": ""}, "dataset.field"),
    ):
        with pytest.raises(HookrunError) as err:
            TextDatasetConfig(path=str(corpus), **keys).check()
        assert_names(err, key)
    with pytest.raises(HookrunError) as err:
        PromptsDatasetConfig(context=0).check()
    assert_names(err, "dataset.context")
    # 14 tokens with separators: a row of 15 cannot be filled (with a bos, it can).
    assert len(text_data(corpus, tokenizer, context=14)) == 1
    err = refused(text_data, corpus, tokenizer, context=15)
    assert_names(err, "dataset.context", str(corpus), "up to 14")
    assert len(text_data(corpus, tokenizer, context=15, prepend_bos=True)) == 1
    bare = word_tokenizer(pad_token="[PAD]")
    assert_names(refused(text_data, corpus, bare, context=4), "dataset.pack", "eos")
    err = refused(text_data, corpus, bare, context=4, pack=False, prepend_bos=True)
    assert_names(err, "dataset.prepend_bos", "bos")


def test_a_corpus_whose_ids_cannot_be_written_is_refused_naming_the_folder(
    corpus, tokenizer, tmp_path, monkeypatch
):
    # The ids go to a temporary file in TMPDIR, never all held in memory; no room there (a
    # folder that is gone stands in for a full disk) is one line before any work.
    import tempfile

    gone = tmp_path / "gone"
    monkeypatch.setattr(tempfile, "tempdir", str(gone))
    with pytest.raises(HookrunError) as err:
        text_data(corpus, tokenizer, context=4)
    assert_names(err, "dataset", str(gone), "valid: a TMPDIR with room")


def test_the_rows_read_back_are_the_tokens_written_for_a_corpus_of_many_chunks(tmp_path, tokenizer):
    # More documents than one tokenizer call takes (1024): the stream crosses chunks.
    words = WORDS[4:]
    docs = [" ".join(words[(k + j) % len(words)] for j in range(k % 5 + 1)) for k in range(2500)]
    path = tmp_path / "big.txt"
    path.write_text("\n".join(docs) + "\n")
    stream: list[int] = []
    for k, doc in enumerate(docs):
        stream += ids(doc) + ([EOS] if k < len(docs) - 1 else [])
    data = text_data(path, tokenizer, context=16)
    tensors, labels = items(data)
    expected = torch.tensor(stream[: len(stream) // 16 * 16]).reshape(-1, 16)
    assert torch.equal(tensors[:, 0], expected)
    assert labels == expected[:, 15].tolist()
    # Each row's source: the line of its first token's document.
    starts = np.cumsum([0] + [len(ids(d)) + 1 for d in docs[:-1]])
    lines = [int(np.searchsorted(starts, r * 16, side="right")) for r in range(len(expected))]
    assert list(data.sources) == [(str(path), line) for line in lines]


def test_rows_index_like_a_sequence_and_reach_spawned_workers(tmp_path, tokenizer):
    from torch.utils.data import DataLoader

    docs = [" ".join(WORDS[4 + k % 8] for k in range(j, j + 9)) for j in range(40)]
    path = tmp_path / "c.txt"
    path.write_text("\n".join(docs) + "\n")
    data = text_data(path, tokenizer, context=8)
    last = data[len(data) - 1]
    assert torch.equal(data[-1][0], last[0]) and data[-1][1] == last[1]
    with pytest.raises(IndexError):
        data[len(data)]  # the dropped partial row is no row
    assert len(list(iter(data[i] for i in range(len(data))))) == len(data)
    # Workers started by spawn (macOS's default, forkserver Python 3.14's) get the rows too.
    loader = DataLoader(data, batch_size=4, num_workers=1, multiprocessing_context="spawn")
    got = torch.cat([batch[0] for batch in loader])
    assert torch.equal(got, torch.stack([data[i][0] for i in range(len(data))]))


def test_the_path_width_is_that_of_the_runs_rows(tmp_path, tokenizer):
    from hookrun.data.loader import build_dataset, source_files

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("the cat sat on the mat\n" * 4)
    (folder / ("b" * 80 + ".txt")).write_text("a dog ran on the mat the cat\n")
    cfg = TextDatasetConfig(path=str(folder), context=4)
    cfg.check()
    first = build_dataset(cfg, 0, 2, tokenizer)  # limit=2: rows of a.txt only
    assert source_files(first).width == len(str(folder / "a.txt").encode())
    whole = build_dataset(cfg, 0, None, tokenizer)
    assert source_files(whole).width == len(str(folder / ("b" * 80 + ".txt")).encode())
