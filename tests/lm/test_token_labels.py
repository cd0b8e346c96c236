"""Tokens labelled from the file (issue 40): a run stores each token id's text as its
tokenizer decodes it (/model/vocabulary), so the pictures of a run from Python with a model
object and its tokenizer, `python -m hookrun.render` elsewhere and the summary of a resumed
complete file name tokens by their text, not by byte-level fallbacks or class numbers."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest
import transformers
from conftest import hookrun_cli
from lm_models import save_lm, tokenizer, write_jsonl

import hookrun
from hookrun.io.layout import read_vocabulary
from hookrun.render.tokens import token_texts

pytestmark = pytest.mark.slow  # every test here takes over ~1.5 s

PROMPTS = [{"prompt": "The cat sat on the"}, {"prompt": "Hooks\ncapture"}]
QUIET = ["progress=false"]


def test_a_python_runs_tokens_are_named_by_the_callers_tokenizer(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
    tok = tokenizer()
    capture = ["++hooks.b.select.name=transformer.h.1", "++hooks.b.at=output"]
    capture += ["++hooks.b.action=capture", *QUIET]
    result = hookrun.run(
        capture, model=model, tokenizer=tok, dataset=PROMPTS, run_dir=tmp_path / "r"
    )
    vocab = model.config.vocab_size  # the tokenizer's tokens and 4 more the model pads with
    want = [tok.decode([i]) for i in range(len(tok))] + [""] * (vocab - len(tok))
    with h5py.File(result.path) as f:
        stored = read_vocabulary(f, range(vocab))
        assert stored == want
        ids = f["samples/tokens"][1][: int(f["samples/mask"][1].sum())]
        # What the pictures write under each token (escaped: the newline shows as \n).
        assert token_texts(f, {}, ids) == [repr(tok.decode([int(i)]))[1:-1] for i in ids]
        assert "\\n" in "".join(token_texts(f, {}, ids))
        top = int(f["model/output"][0].argmax())
    assert f"sample 0: top-1 token {top} {tok.decode([top])!r}" in result.summary
    drawn = subprocess.run(
        [
            sys.executable,
            "-m",
            "hookrun.render",
            str(result.path),
            "--out",
            str(tmp_path / "pictures"),
        ],
        capture_output=True,
        text=True,
    )
    assert drawn.returncode == 0, drawn.stderr[-2000:]
    assert (tmp_path / "pictures" / "residual_norms.png").stat().st_size > 1000


def test_a_resumed_complete_language_model_file_names_its_top_tokens(tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    args = ["experiment=logit_lens", f"dataset.path={data}", "target.kind=predicted"]
    args += ["render=false", *QUIET]
    args.append(f"hydra.run.dir={tmp_path / 'run'}")
    first = hookrun_cli(args, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    again = hookrun_cli([*args, "resume=true"], tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    said = [line for line in (first.stdout + first.stderr).splitlines() if "top-1" in line]
    resumed = [line for line in (again.stdout + again.stderr).splitlines() if "top-1" in line]
    assert said and resumed == said and all("top-1 token " in line for line in said), resumed
    assert not np.any(["class" in line for line in resumed])
