"""model=hf: Hugging Face transformers models (random-init tiny configs of GPT-2, Llama,
GPT-NeoX and BERT) behind the LanguageModel adapter, checked against the same HF model called
directly; the folder checks and every refusal, one line naming the key."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hookrun
from hookrun.errors import HookrunError
from hookrun.models.hf import EOS, byte_tokenizer, load_tokenizer
from hookrun.models.language import LanguageModel
from hookrun.models.sources import build_model
from hookrun.models.weights import sha256_of

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
V = 300  # >= the byte tokenizer's 257
SMALL = {
    "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32},
    "llama": {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32,
    },
    "gpt_neox": {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "max_position_embeddings": 32,
    },
    "bert": {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "max_position_embeddings": 32,
    },
}
CLASS = {"gpt2": "causal_lm", "llama": "causal_lm", "gpt_neox": "causal_lm", "bert": "masked_lm"}
BLOCK = {
    "gpt2": "transformer.h.1",
    "llama": "model.layers.1",
    "gpt_neox": "gpt_neox.layers.1",
    "bert": "bert.encoder.layer.1",
}
MLP = {
    "gpt2": "transformer.h.0.mlp",
    "llama": "model.layers.0.mlp",
    "gpt_neox": "gpt_neox.layers.0.mlp",
    "bert": "bert.encoder.layer.0.output.dense",
}


def _config_arg(model_type: str, **extra: object) -> str:
    items = {"model_type": model_type, **SMALL[model_type], "vocab_size": V, **extra}
    return "model.config={" + ", ".join(f"{k}: {v}" for k, v in items.items()) + "}"


def _spec(model_type: str, *overrides: str, seed: int = 0):
    args = ["model=hf", _config_arg(model_type), f"model.class={CLASS[model_type]}"]
    return hookrun.compose([*args, f"seed={seed}", *overrides])


def _built(model_type: str, *overrides: str, seed: int = 0) -> LanguageModel:
    spec = _spec(model_type, *overrides, seed=seed)
    return build_model(spec.model, spec.seed).module


def _batch(lengths: list[int], reads: list[int], pad: int, seed: int = 1) -> torch.Tensor:
    """A token sample batch (N, 3, T), right-padded to the longest row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.zeros(len(lengths), 3, max(lengths), dtype=torch.int64)
    x[:, 0] = pad
    for i, (n, r) in enumerate(zip(lengths, reads, strict=True)):
        x[i, 0, :n] = torch.randint(0, 257, (n,), generator=gen)
        x[i, 1, :n] = 1
        x[i, 2, r] = 1
    return x


def _tensor(out):
    return out[0] if isinstance(out, tuple) else out


def _one_line(excinfo, key: str) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.startswith(f"{key}:"), msg
    return msg


@pytest.mark.parametrize("model_type", list(SMALL))
def test_output_is_the_hf_models_own_logits_at_the_read_position(model_type):
    lm = _built(model_type)
    x = _batch([9, 9, 9], reads=[8, 3, 0], pad=256)
    with torch.no_grad():
        got = lm(x)
        logits = lm.hf(input_ids=x[:, 0], attention_mask=x[:, 1], use_cache=False).logits
    assert got.shape == (3, V)
    assert torch.equal(got, torch.stack([logits[0, 8], logits[1, 3], logits[2, 0]]))


@pytest.mark.parametrize("model_type", list(SMALL))
def test_right_padded_batch_equals_rows_run_one_at_a_time(model_type):
    lm = _built(model_type)
    lengths = [16, 9, 5]
    x = _batch(lengths, reads=[15, 8, 2], pad=256)
    block = dict(lm.named_modules())[BLOCK[model_type]]
    seen: list[torch.Tensor] = []
    handle = block.register_forward_hook(lambda m, i, o: seen.append(_tensor(o).detach()))
    with torch.no_grad():
        batch = lm(x)
        alone = [lm(x[i : i + 1, :, :n]) for i, n in enumerate(lengths)]
    handle.remove()
    torch.testing.assert_close(batch, torch.cat(alone), atol=1e-5, rtol=0)
    for i, n in enumerate(lengths):  # every real position of the block's output too
        torch.testing.assert_close(seen[0][i, :n], seen[1 + i][0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", list(SMALL))
def test_sdpa_attention_gives_the_eager_models_numbers(model_type):
    """model.attention=sdpa loads torch's fused attention: the same weights (seeded alike)
    give the eager model's outputs and block outputs on a right-padded batch, to float
    rounding."""
    eager, fused = _built(model_type), _built(model_type, "model.attention=sdpa")
    assert eager.hf.config._attn_implementation == "eager"
    assert fused.hf.config._attn_implementation == "sdpa"
    x = _batch([16, 9, 5], reads=[15, 8, 2], pad=256)
    seen: dict[str, torch.Tensor] = {}
    for name, lm in (("eager", eager), ("sdpa", fused)):
        block = dict(lm.named_modules())[BLOCK[model_type]]
        handle = block.register_forward_hook(lambda m, i, o, k=name: seen.__setitem__(k, o))
        with torch.no_grad():
            seen[name + " output"] = lm(x)
        handle.remove()
    torch.testing.assert_close(seen["sdpa output"], seen["eager output"], atol=1e-5, rtol=0)
    for i, n in enumerate([16, 9, 5]):  # the real positions (padding's rows may differ)
        got, want = _tensor(seen["sdpa"])[i, :n], _tensor(seen["eager"])[i, :n]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", list(SMALL))
def test_module_names_and_state_dict_keys_are_the_hf_models(model_type):
    lm = _built(model_type)
    assert [n for n, _ in lm.named_modules()] == [n for n, _ in lm.hf.named_modules()]
    assert list(lm.state_dict()) == list(lm.hf.state_dict())
    assert not any(n.startswith("hf.") for n, _ in lm.named_modules())
    assert lm.config is lm.hf.config and lm.tokenizer is not None
    assert lm.hf.config._attn_implementation == "eager"
    lm.train()
    assert lm.hf.training and all(m.training for m in lm.hf.modules())
    lm.eval()
    assert not lm.hf.training and not any(m.training for m in lm.hf.modules())


@pytest.mark.parametrize("model_type", list(SMALL))
def test_hooks_on_the_adapter_see_what_hooks_on_the_bare_model_see(model_type):
    lm = _built(model_type)
    x = _batch([7, 5], reads=[6, 4], pad=256)
    name = BLOCK[model_type]
    ours: dict[str, torch.Tensor] = {}
    handles = [
        lm.get_submodule(name).register_forward_hook(
            lambda m, i, o: ours.__setitem__("out", _tensor(o))
        ),
        lm.get_submodule(name).register_forward_pre_hook(
            lambda m, a, kw: ours.__setitem__("in", (a or (kw["hidden_states"],))[0].detach()),
            with_kwargs=True,
        ),
        lm.get_submodule(MLP[model_type]).register_full_backward_hook(
            lambda m, gi, go: ours.__setitem__("grad", go[0])
        ),
    ]
    mlp_out: dict[str, torch.Tensor] = {}

    def keep(m, i, o):
        o.retain_grad()
        mlp_out["out"] = o

    handles.append(lm.get_submodule(MLP[model_type]).register_forward_hook(keep))
    got = lm(x)
    got.sum().backward()
    for h in handles:
        h.remove()
    assert "grad" in ours and torch.equal(ours["grad"], mlp_out["out"].grad)
    assert ours["grad"].abs().sum() > 0  # the returned logits reach the blocks

    # The bare HF model, called directly, with a hand-registered hook on the same name.
    bare: dict[str, torch.Tensor] = {}
    previous = name[:-1] + "0"  # block 0, whose output is block 1's input
    handles = [
        lm.hf.get_submodule(n).register_forward_hook(
            lambda m, i, o, key=key: bare.__setitem__(key, _tensor(o))
        )
        for n, key in ((name, "out"), (previous, "in"))
    ]
    with torch.no_grad():
        lm.hf(input_ids=x[:, 0], attention_mask=x[:, 1], use_cache=False)
    for h in handles:
        h.remove()
    assert torch.equal(ours["out"].detach(), bare["out"])
    assert torch.equal(ours["in"], bare["in"])


def test_base_and_sequence_classification_outputs():
    base = _built("gpt2", "model.class=base")
    x = _batch([6, 4], reads=[5, 1], pad=256)
    with torch.no_grad():
        out = base.hf(input_ids=x[:, 0], attention_mask=x[:, 1], use_cache=False)
        hidden = out.last_hidden_state
        assert torch.equal(base(x), torch.stack([hidden[0, 5], hidden[1, 1]]))
    cls = _built("bert", "model.class=sequence_classification")
    with torch.no_grad():
        want = cls.hf(input_ids=x[:, 0], attention_mask=x[:, 1], use_cache=False).logits
        assert torch.equal(cls(x), want) and want.shape == (2, 2)


def test_random_init_is_seeded_by_the_run_seed():
    a, b, c = (_built("gpt2", seed=s) for s in (3, 3, 4))
    wte = "transformer.wte.weight"
    assert torch.equal(a.state_dict()[wte], b.state_dict()[wte])
    assert not torch.equal(a.state_dict()[wte], c.state_dict()[wte])


def test_bfloat16_gives_a_bf16_model():
    lm = _built("llama", "model.dtype=bfloat16")
    assert {p.dtype for p in lm.parameters()} == {torch.bfloat16}
    assert lm(_batch([5], reads=[4], pad=256)).dtype == torch.bfloat16
    lm.to(torch.float32)  # the adapter and the wrapped model share their tensors
    assert {p.dtype for p in lm.hf.parameters()} == {torch.float32}


def test_byte_tokenizer_needs_no_files():
    tok = byte_tokenizer()
    text = "héllo, wörld"
    assert tok(text)["input_ids"] == list(text.encode())
    assert len(tok) == 257 and tok.eos_token == EOS and tok.eos_token_id == 256
    assert tok(text + EOS)["input_ids"][-1] == 256
    assert tok.decode(list(text.encode())) == text


def _save(lm: LanguageModel, folder: Path, safe: bool = True) -> Path:
    lm.hf.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    if not safe:  # a .bin as older transformers wrote it
        state = {k: v.clone() for k, v in lm.hf.state_dict().items()}
        (folder / "model.safetensors").unlink()
        torch.save(state, folder / "pytorch_model.bin")
    return folder


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_save_pretrained_folder_round_trip_gives_identical_logits(tmp_path, safe):
    lm = _built("gpt2")
    folder = _save(lm, tmp_path / "gpt2", safe)
    spec = hookrun.compose(["model=hf", f"model.path={folder}"])
    built = build_model(spec.model, spec.seed)
    x = _batch([8, 6], reads=[7, 5], pad=256)
    with torch.no_grad():
        assert torch.equal(built.module(x), lm(x))
    name = "model.safetensors" if safe else "pytorch_model.bin"
    assert built.weights_file == folder / name
    from hookrun.scale.provenance import provenance

    header = provenance(spec, built.weights_file, torch.device("cpu"), 1)
    assert header.weights_sha256 == sha256_of(folder / name)


def test_load_tokenizer_reads_no_weights(tmp_path):
    folder = _save(_built("gpt2"), tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"not weights")
    spec = hookrun.compose(["model=hf", f"model.path={folder}"])
    assert load_tokenizer(spec.model)("ab")["input_ids"] == [97, 98]
    with pytest.raises(HookrunError) as err:
        build_model(spec.model, 0)
    assert str(folder / "model.safetensors") in _one_line(err, "model.path")


def test_tokenizer_folder_for_a_config(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat", "the dog ran"], trainers.WordLevelTrainer())
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(tmp_path / "tok")
    lm = _built("gpt2", f"model.tokenizer={tmp_path / 'tok'}")
    assert (
        len(lm.tokenizer) == len(fast)
        and lm.tokenizer("the cat")["input_ids"] == fast("the cat")["input_ids"]
    )


# ---- refusals: one line naming the key, before anything is built ----


def _refused(overrides: list[str], key: str) -> str:
    with pytest.raises(HookrunError) as err:
        hookrun.compose(["model=hf", *overrides])
    return _one_line(err, key)


def test_missing_and_partial_folders_are_refused(tmp_path):
    assert "not a folder" in _refused([f"model.path={tmp_path / 'nope'}"], "model.path")
    folder = _save(_built("gpt2"), tmp_path / "m")
    (folder / "config.json").rename(tmp_path / "config.json")
    assert "no config.json" in _refused([f"model.path={folder}"], "model.path")
    (tmp_path / "config.json").rename(folder / "config.json")
    (folder / "model.safetensors").rename(tmp_path / "model.safetensors")
    assert "no weights file" in _refused([f"model.path={folder}"], "model.path")
    (tmp_path / "model.safetensors").rename(folder / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    assert "no tokenizer files" in _refused([f"model.path={folder}"], "model.path")
    assert "is not a folder" in _refused(
        [_config_arg("gpt2"), f"model.tokenizer={tmp_path / 'nope'}"], "model.tokenizer"
    )
    assert "null" in _refused([], "model.path")


def test_remote_code_is_refused_unless_trusted(tmp_path):
    folder = _save(_built("gpt2"), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    msg = _refused([f"model.path={folder}"], "model.trust_remote_code")
    assert "auto_map" in msg
    config.pop("auto_map")
    config["model_type"] = "evil_lm"
    (folder / "config.json").write_text(json.dumps(config))
    assert "evil_lm" in _refused([f"model.path={folder}"], "model.trust_remote_code")


class _Payload:
    """A pickle that would create a file when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_bin_holding_a_pickled_object_is_refused(tmp_path):
    folder = _save(_built("gpt2"), tmp_path / "m", safe=False)
    marker = tmp_path / "unpickled"
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    state["payload"] = _Payload(marker)
    with (folder / "pytorch_model.bin").open("wb") as f:
        pickle.dump(state, f, protocol=2)
    spec = hookrun.compose(["model=hf", f"model.path={folder}"])
    with pytest.raises(HookrunError) as err:
        build_model(spec.model, 0)
    msg = _one_line(err, "model.path")
    assert "pytorch_model.bin" in msg and "Unpickling" in msg, msg
    assert not marker.exists()


def test_bad_values_are_refused_naming_the_key():
    config = _config_arg("gpt2")
    assert "valid: causal_lm, masked_lm" in _refused([config, "model.class=lm"], "model.class")
    msg = _refused([config, "model.class=masked_lm"], "model.class")
    assert "valid: causal_lm, base, sequence_classification" in msg
    assert "bfloat16" in _refused([config, "model.dtype=int8"], "model.dtype")
    assert "valid: eager, sdpa" in _refused([config, "model.attention=flash"], "model.attention")
    small = _config_arg("gpt2").replace(f"vocab_size: {V}", "vocab_size: 100")
    assert " 100 is below the tokenizer's 257" in _refused([small], "model.config.vocab_size")
    msg = _refused([_config_arg("gpt2").replace("gpt2", "gtp2", 1)], "model.config.model_type")
    assert "gpt2" in msg
    assert "did you mean 'class'" in _refused([config, "+model.klass=base"], "model.klass")
    with pytest.raises(HookrunError) as err:  # hf keys under another source
        hookrun.compose(["model=resnet18", "+model.dtype=bfloat16"])
    assert "model=hf" in _one_line(err, "model.dtype")


@pytest.mark.slow
def test_without_transformers_model_hf_says_how_to_install_it():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import hookrun\n"
        "try:\n"
        "    hookrun.compose(['model=hf', 'model.config={model_type: gpt2}'])\n"
        "except hookrun.HookrunError as err:\n"
        "    print(err)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("model.source: 'hf'"), out.stdout
    assert "needs the hf extra: pip install 'hookrun[hf]'" in lines[0]


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "gpt_neox"])
def test_causal_lms_unembed_only_the_read_positions_unless_the_unembedding_is_hooked(model_type):
    """Only the read positions' logits are ever read: the unembedding runs on those alone
    (the (N, T, V) logits are most of a small model's work), and on every position again
    as soon as anything hooks it, so a capture of its output is the model's own."""
    lm = _built(model_type)
    head = lm.hf.get_output_embeddings()
    x = _batch([9, 9, 6], reads=[8, 3, 5], pad=256)
    rows_seen: list[int] = []
    plain = head.forward
    head.forward = lambda h: (rows_seen.append(h.shape[1]), plain(h))[1]  # not a hook
    try:
        with torch.no_grad():
            got = lm(x)
            full = lm.hf(input_ids=x[:, 0], attention_mask=x[:, 1], use_cache=False).logits
            seen: list[torch.Tensor] = []
            handle = head.register_forward_hook(lambda m, i, o: seen.append(o))
            hooked = lm(x)
            handle.remove()
    finally:
        del head.forward
    assert rows_seen == [3, 9, 9]  # the distinct read positions 3, 5, 8; then all 9 twice
    want = torch.stack([full[0, 8], full[1, 3], full[2, 5]])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert seen[0].shape == (3, 9, V) and torch.equal(hooked, want)
