"""A model spread over the CPU and disk (`model.device_map`, through Accelerate) gives what
the model on one device gives: captures, gradients, the patching grid, the logit lens and
generation, byte for byte (each module computes on the CPU either way, its weights read in
from disk for its forward: the same arithmetic in the same order). What cannot be placed is
refused in one line before any work."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from conftest import hookrun_cli, run_config, torchrun
from lm_models import save_lm, write_jsonl
from test_lm_patching import _prompts

from hookrun.errors import HookrunError

ROWS = [
    {"prompt": "The cat sat on the", "answer": " mat"},
    {"prompt": "A quick brown fox", "answer": " jumps"},
    {"prompt": "def add(a, b): return a +", "answer": " b"},
]


# Every block's output and the embeddings' output gradient, for the answer's logit.
CAPTURES = [
    "++hooks.blocks.select.regex=transformer\\.h\\.\\d+",
    "++hooks.blocks.at=output",
    "++hooks.blocks.action=capture",
    "++hooks.g.select.name=transformer.wte",
    "++hooks.g.at=grad_output",
    "++hooks.g.action=capture",
    "target.kind=answer",
]


def _mapped(tmp_path) -> list[str]:
    """A max_memory too small for the whole model (149 kB of float32): what does not fit
    goes to disk, in the offload folder."""
    return [
        "model.device_map=auto",
        "model.max_memory={cpu: 100000}",
        f"model.offload_folder={tmp_path / 'offload'}",
    ]


def _both(tmp_path, name: str, args: list[str]) -> tuple[dict, dict]:
    def read(path) -> dict:
        out = {}
        with h5py.File(path) as f:
            f.visititems(
                lambda k, v: out.__setitem__(k, v[()]) if isinstance(v, h5py.Dataset) else None
            )
        return out

    one = read(run_config(tmp_path / f"{name}-one", args).path)
    spread = read(run_config(tmp_path / f"{name}-spread", [*args, *_mapped(tmp_path)]).path)
    return one, spread


@pytest.fixture
def lm(tmp_path):
    save_lm(tmp_path / "lm", "gpt2")
    return ["model=hf", f"model.path={tmp_path / 'lm'}", "render=false", "progress=false"]


def _same(one: dict, spread: dict, prefix: str) -> None:
    keys = [k for k in one if k.startswith(prefix)]
    assert keys, prefix
    for key in keys:
        assert one[key].tobytes() == spread[key].tobytes(), key


def test_captures_gradients_and_the_lens_are_the_one_device_runs(tmp_path, lm):
    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    args = [
        *lm,
        "dataset=prompts",
        f"dataset.path={data}",
        "batch_size=2",
        *CAPTURES,
    ]
    one, spread = _both(tmp_path, "captures", args)
    _same(one, spread, "captures/")
    assert np.abs(one["captures/transformer.wte/grad_output"]).max() > 1e-4
    # The file says where each module ran (the map Accelerate made), the one-device run none.
    with h5py.File(tmp_path / "captures-spread" / "captures.h5") as f:
        placed = json.loads(f.attrs["device_map"])
    with h5py.File(tmp_path / "captures-one" / "captures.h5") as f:
        assert f.attrs["device_map"] == ""
    assert set(placed.values()) == {"cpu", "disk"} and "transformer.h" in placed, placed
    lens = [*lm, "experiment=logit_lens", f"dataset.path={data}", "batch_size=2"]
    one, spread = _both(tmp_path, "lens", lens)
    _same(one, spread, "derived/logit_lens/")


def test_the_patching_grid_and_generation_are_the_one_device_runs(tmp_path, lm):
    data = _prompts(tmp_path / "patching.jsonl")
    grid = [*lm, "experiment=lm_patching", f"dataset.path={data}", "batch_size=2"]
    one, spread = _both(tmp_path, "grid", [*grid, "patching.method=[exact,atp]"])
    _same(one, spread, "patching/")
    prompts = write_jsonl(tmp_path / "g.jsonl", ROWS)
    generate = [
        *lm,
        "experiment=generate",
        f"dataset.path={prompts}",
        "batch_size=3",
        "generate.max_new_tokens=4",
        "generate.stop_at_eos=false",
    ]
    one, spread = _both(tmp_path, "generate", generate)
    _same(one, spread, "generation/")


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["model.device_map=fast"], "model.device_map: 'fast'; valid: auto, balanced"),
        (
            ["model.device_map=auto", "model.max_memory={cpu: 100000}"],
            "model.device_map: 'auto' under model.max_memory {'cpu': 100000} leaves "
            "transformer.h, transformer.ln_f (101,888 of the model's 148,992 bytes) for the "
            "disk, without model.offload_folder; valid: model.offload_folder=DIR, or more "
            "model.max_memory",
        ),
        (
            ["model.device_map=auto", "model.max_memory={3: 1GiB}"],
            "model.max_memory.3: 3 but this machine has",
        ),
        (["model.device_map=auto", "model.max_memory={cpu: lots}"], "model.max_memory.cpu: 'lots'"),
        (
            ["model.max_memory={cpu: 1GiB}"],
            "model.max_memory: {'cpu': '1GiB'} without model.device_map",
        ),
        (
            ["model.device_map={transformer.h.9: cpu}"],
            "model.device_map: 'transformer.h.9' is no module",
        ),
        (
            ["model.device_map={transformer: 'cuda:0', lm_head: cpu}"],
            "model.device_map.transformer: 'cuda:0' but this machine has",
        ),
    ],
)
def test_what_cannot_be_placed_is_refused_before_any_work(tmp_path, lm, extra, said):
    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", [*lm, "dataset=prompts", f"dataset.path={data}", *extra])
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run" / "captures.h5").exists()


@pytest.mark.slow
def test_a_map_naming_disk_without_an_offload_folder_is_refused_naming_the_map(tmp_path, lm):
    """Issue 40: a map of the user's own sending the blocks to disk, typed on the command line
    with no model.max_memory and no model.offload_folder, is refused naming the map and the
    offload folder (not model.max_memory, which was never given), with the blocks' bytes:
    GPT-2's 2 blocks of width 16 in float32, counted here from the saved model."""
    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    parts = "transformer.wte: cpu, transformer.wpe: cpu, transformer.h: disk, "
    parts += "transformer.ln_f: cpu, lm_head: cpu"
    job = hookrun_cli(
        [*lm, "dataset=prompts", f"dataset.path={data}", f"model.device_map={{{parts}}}"],
        tmp_path,
    )
    assert job.returncode != 0
    said = [line for line in job.stderr.splitlines() if line.startswith("hookrun: error:")]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
    blocks = sum(p.numel() * 4 for p in model.transformer.h.parameters())
    whole = sum(p.numel() * 4 for p in model.parameters())  # lm_head tied: counted once
    assert said == [
        f"hookrun: error: model.device_map: sends transformer.h ({blocks:,} of the model's "
        f"{whole:,} bytes) to disk without model.offload_folder; valid: "
        "model.offload_folder=DIR, or cpu / cuda:N for those modules"
    ], job.stderr[-2000:]
    assert not list(tmp_path.rglob("captures.h5"))


@pytest.mark.slow
def test_a_random_init_or_torchrun_with_a_map_is_refused(tmp_path, lm):
    with pytest.raises(HookrunError) as err:
        run_config(
            tmp_path / "run",
            [
                "model=hf",
                "model.config={model_type: gpt2, n_layer: 1}",
                "model.device_map=auto",
                "dataset=prompts",
            ],
        )
    assert "model.device_map: 'auto' with model.config (a random init)" in str(err.value)
    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    job = torchrun(
        [
            *lm,
            "dataset=prompts",
            f"dataset.path={data}",
            *_mapped(tmp_path),
            f"hydra.run.dir={tmp_path / 'tr'}",
        ],
        tmp_path,
    )
    assert job.returncode != 0
    assert "model.device_map: 'auto' under torchrun (2 processes)" in job.stderr, job.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_map_split_between_cuda_and_cpu_is_the_one_device_run(tmp_path, lm):
    """The blocks on cuda:0, the embeddings, final norm and head on the CPU: the captures
    and gradients equal the model on cuda:0 alone to 1e-5 (the CPU's and the GPU's
    kernels round differently: not byte for byte)."""
    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    args = [
        *lm,
        "dataset=prompts",
        f"dataset.path={data}",
        "batch_size=2",
        "device.name=cuda",
        *CAPTURES,
    ]
    parts = ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.ln_f"]
    places = ", ".join([*(f"{p}: cpu" for p in parts), "transformer.h: 0", "lm_head: cpu"])
    split = f"model.device_map={{{places}}}"
    one = run_config(tmp_path / "one", args).path
    spread = run_config(tmp_path / "spread", [*args, split]).path
    with h5py.File(one) as f, h5py.File(spread) as g:
        for key in ("captures/transformer.h.0/output", "captures/transformer.wte/grad_output"):
            np.testing.assert_allclose(g[key][()], f[key][()], rtol=1e-5, atol=1e-5, err_msg=key)


def test_circuits_refuse_a_model_on_several_devices_or_on_disk(tmp_path, lm):
    data = _prompts(tmp_path / "patching.jsonl")
    with pytest.raises(HookrunError) as err:
        run_config(
            tmp_path / "run",
            [*lm, "experiment=circuit", f"dataset.path={data}", *_mapped(tmp_path)],
        )
    said = str(err.value)
    assert "circuit: model.device_map puts the model on cpu, disk" in said, said
    assert "weights exist only during its forward" in said and "\n" not in said, said
