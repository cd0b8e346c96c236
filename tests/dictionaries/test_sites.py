"""TransformerLens hook names on Hugging Face GPT-2 and Llama built from tiny configs (no
download): each name's module and site, checked by a hook there that sees the tensor
(its last axis the dictionary's d_in), and the residual after attention checked by value."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from hookrun.dictionaries import is_mlp, module_site
from hookrun.dictionaries.sites import HOOK_FORMS
from hookrun.errors import HookrunError

HIDDEN = 16


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=HIDDEN, n_head=2, n_positions=16, vocab_size=40, n_inner=24
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def _llama() -> nn.Module:
    # head_dim * heads (12) differs from the hidden size: hook_z's width is its own
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=HIDDEN,
        intermediate_size=24,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=6,
        vocab_size=40,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


MODELS = {"gpt2": _gpt2, "llama": _llama}
# name -> (GPT-2's (module, site), Llama's, the tensor's width on Llama)
EXPECTED = {
    "blocks.1.hook_resid_pre": (("transformer.h.1", "input"), ("model.layers.1", "input"), 16),
    "blocks.1.hook_resid_post": (("transformer.h.1", "output"), ("model.layers.1", "output"), 16),
    "blocks.1.hook_resid_mid": (
        ("transformer.h.1.ln_2", "input"),
        ("model.layers.1.post_attention_layernorm", "input"),
        16,
    ),
    "blocks.0.ln2.hook_normalized": (
        ("transformer.h.0.mlp", "input"),
        ("model.layers.0.mlp", "input"),
        16,
    ),
    # TransformerLens's hook_mlp_in is resid_mid, before ln2 (its transformer_block.py).
    "blocks.0.hook_mlp_in": (
        ("transformer.h.0.ln_2", "input"),
        ("model.layers.0.post_attention_layernorm", "input"),
        16,
    ),
    "blocks.0.mlp.hook_in": (("transformer.h.0.mlp", "input"), ("model.layers.0.mlp", "input"), 16),
    "blocks.1.hook_mlp_out": (
        ("transformer.h.1.mlp", "output"),
        ("model.layers.1.mlp", "output"),
        16,
    ),
    "blocks.1.mlp.hook_out": (
        ("transformer.h.1.mlp", "output"),
        ("model.layers.1.mlp", "output"),
        16,
    ),
    "blocks.0.attn.hook_z": (
        ("transformer.h.0.attn.c_proj", "input"),
        ("model.layers.0.self_attn.o_proj", "input"),
        12,
    ),
}


def test_every_form_is_tested():
    forms = {".".join(["blocks", "<L>", *n.split(".")[2:]]) for n in EXPECTED}
    assert forms == set(HOOK_FORMS)


def _seen(model: nn.Module, module: str, site: str) -> torch.Tensor:
    """The tensor at `module`'s `site` in one forward pass."""
    seen = []
    target = dict(model.named_modules())[module]
    if site == "input":
        handle = target.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    else:
        handle = target.register_forward_hook(lambda m, args, out: seen.append(out))
    try:
        with torch.no_grad():
            model(torch.arange(7).reshape(1, 7))
    finally:
        handle.remove()
    (tensor,) = seen
    return tensor[0] if isinstance(tensor, tuple) else tensor  # attention: (output, weights)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_each_name_places_a_hook_that_sees_its_tensor(family: str):
    model = MODELS[family]()
    for name, (gpt2, llama, width) in EXPECTED.items():
        where = module_site(name, model, key="hooks.sae.args.path")
        assert where == (gpt2 if family == "gpt2" else llama), name
        tensor = _seen(model, *where)
        assert isinstance(tensor, torch.Tensor), name
        assert tensor.shape[:2] == (1, 7), name
        assert tensor.shape[-1] == (width if family == "llama" else HIDDEN), name


@pytest.mark.parametrize("family", sorted(MODELS))
def test_resid_mid_is_the_residual_after_attention(family: str):
    model = MODELS[family]()
    block = module_site("blocks.1.hook_resid_pre", model, "k")[0]
    attention = f"{block}.attn" if family == "gpt2" else f"{block}.self_attn"
    resid_pre = _seen(model, block, "input")
    attn_out = _seen(model, attention, "output")
    mid = _seen(model, *module_site("blocks.1.hook_resid_mid", model, "k"))
    torch.testing.assert_close(mid, resid_pre + attn_out)


def test_is_mlp_reads_the_table():
    model = _gpt2()
    assert is_mlp("transformer.h.1.mlp", model)
    assert not is_mlp("transformer.h.1.mlp.c_fc", model)
    assert not is_mlp("transformer.h.1.attn", model)
    assert not is_mlp("transformer.h.1.mlp", nn.Sequential(nn.Linear(2, 2)))


def test_refusals_name_the_key_the_name_and_the_valid_forms():
    model = _gpt2()
    forms = ", ".join(HOOK_FORMS)
    with pytest.raises(HookrunError) as err:
        module_site("blocks.0.hook_attn_out", model, "hooks.sae.args.hook")
    assert str(err.value) == f"hooks.sae.args.hook: 'blocks.0.hook_attn_out'; valid: {forms}"
    with pytest.raises(HookrunError) as err:
        module_site("blocks.2.hook_resid_pre", model, "hooks.sae.args.hook")
    assert str(err.value) == (
        "hooks.sae.args.hook: 'blocks.2.hook_resid_pre': the model has no layer 2; valid: "
        "blocks.0 to blocks.1"
    )
    with pytest.raises(HookrunError, match=r"^k: 'blocks.0.hook_resid_pre' needs the model's "):
        module_site("blocks.0.hook_resid_pre", nn.Sequential(nn.Linear(2, 2)), "k")


def test_a_parallel_residual_has_no_resid_mid():
    cfg = transformers.GPTNeoXConfig(
        num_hidden_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        intermediate_size=24,
        vocab_size=40,
        max_position_embeddings=16,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    for name in ("blocks.0.hook_resid_mid", "blocks.0.hook_mlp_in"):
        with pytest.raises(HookrunError, match=r"does not place it for GPT-NeoX; valid there: "):
            module_site(name, model, "k")
    assert module_site("blocks.0.mlp.hook_in", model, "k") == ("gpt_neox.layers.0.mlp", "input")
