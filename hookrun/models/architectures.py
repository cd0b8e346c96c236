"""Where each language-model family keeps its parts, by module name as transformers builds
it: the one table the logit lens (blocks, final norm, unembedding), the patching grid (a
block's output, attention, MLP, and the heads: the attention output projection's input),
attention patterns, the patched passes' cache resume and edge attribution's receivers (the
norms a block's attention and MLP read through, the q/k/v projections) read. A family not
in it is refused where it is needed, naming what would describe it (ARCHITECTURE_KEYS).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

__all__ = ["Architecture", "ARCHITECTURES", "ARCHITECTURE_KEYS", "architecture_of", "families"]


@dataclass(frozen=True)
class Architecture:
    """One family: module names, `{}` standing for a layer's index."""

    family: str  # how messages name it
    model_types: tuple[str, ...]  # transformers' config.model_type of its models
    embeddings: str  # the token embedding
    blocks: str  # the nn.ModuleList of the blocks (a block's output: the residual stream)
    attention: str  # a block's attention module (whose forward computes the pattern)
    heads: str  # the attention's output projection: its input is the heads side by side
    mlp: str  # a block's MLP
    final_norm: str | None  # the norm before the unembedding (None: there is none)
    unembedding: tuple[str, ...]  # the unembedding, by the names it has had (first found)
    # Whether a later position never changes an earlier one (a causal LM): the patching
    # grid resumes a pass at the patched position.
    causal: bool = True
    # The patched passes' cache: "kv", per-layer keys and values a pass resumes from (when
    # the model's cache holds them plainly; sliding windows do not); "none": each patched
    # pass runs from position 0.
    cache: str = "kv"
    # The norms whose inputs are what a block's attention and MLP read of the residual
    # stream (edge attribution's receivers; None: not known), and whether both read the
    # block's input (a parallel residual: GPT-NeoX) rather than the MLP reading it after
    # the attention's output was added.
    attention_norm: str | None = None
    mlp_norm: str | None = None
    parallel: bool = False
    # The projections that make a block's queries, keys and values from its attention
    # norm's output (edge attribution's per-head receivers; () : not known), and how their
    # outputs lay the heads out: "stacked", one projection [all queries | all keys | all
    # values] (GPT-2's c_attn); "separate", three projections (Llama's q_proj, k_proj,
    # v_proj); "per_head", one projection [q | k | v] per head (GPT-NeoX's query_key_value).
    qkv: tuple[str, ...] = ()
    qkv_layout: str = "separate"

    def block(self, layer: int) -> str:
        return f"{self.blocks}.{layer}"

    def unembedding_of(self, modules: Mapping[str, nn.Module]) -> str | None:
        """The unembedding's name in this model (transformers renamed GPT-NeoX's)."""
        return next((name for name in self.unembedding if name in modules), None)

    def site(self, kind: str) -> str:
        """The module pattern of a patching site kind: resid, attn, mlp, heads."""
        return {
            "resid": f"{self.blocks}.{{}}",
            "attn": self.attention,
            "mlp": self.mlp,
            "heads": self.heads,
        }[kind]


# What describes a family (the fields of an entry), as a refusal names them.
ARCHITECTURE_KEYS = (
    "embeddings",
    "blocks",
    "attention",
    "heads",
    "mlp",
    "final_norm",
    "unembedding",
    "causal",
    "cache",
    "attention_norm",
    "mlp_norm",
    "parallel",
    "qkv",
    "qkv_layout",
)

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        family="GPT-2",
        model_types=("gpt2",),
        embeddings="transformer.wte",
        blocks="transformer.h",
        attention="transformer.h.{}.attn",
        heads="transformer.h.{}.attn.c_proj",
        mlp="transformer.h.{}.mlp",
        final_norm="transformer.ln_f",
        unembedding=("lm_head",),
        attention_norm="transformer.h.{}.ln_1",
        mlp_norm="transformer.h.{}.ln_2",
        qkv=("transformer.h.{}.attn.c_attn",),
        qkv_layout="stacked",
    ),
    Architecture(
        family="Llama-family",
        model_types=("llama", "mistral", "qwen2", "qwen3", "gemma"),
        embeddings="model.embed_tokens",
        blocks="model.layers",
        attention="model.layers.{}.self_attn",
        heads="model.layers.{}.self_attn.o_proj",
        mlp="model.layers.{}.mlp",
        final_norm="model.norm",
        unembedding=("lm_head",),
        attention_norm="model.layers.{}.input_layernorm",
        mlp_norm="model.layers.{}.post_attention_layernorm",
        qkv=(
            "model.layers.{}.self_attn.q_proj",
            "model.layers.{}.self_attn.k_proj",
            "model.layers.{}.self_attn.v_proj",
        ),
    ),
    Architecture(
        family="Gemma 2",
        model_types=("gemma2",),
        embeddings="model.embed_tokens",
        blocks="model.layers",
        attention="model.layers.{}.self_attn",
        heads="model.layers.{}.self_attn.o_proj",
        mlp="model.layers.{}.mlp",
        final_norm="model.norm",
        unembedding=("lm_head",),
        # No receivers: its post_attention_layernorm and post_feedforward_layernorm norm the
        # sublayers' outputs before they are added, so a head's write is not its slice of
        # the output projection (edge attribution refuses it).
    ),
    Architecture(
        family="GPT-NeoX",
        model_types=("gpt_neox",),
        embeddings="gpt_neox.embed_in",
        blocks="gpt_neox.layers",
        attention="gpt_neox.layers.{}.attention",
        heads="gpt_neox.layers.{}.attention.dense",
        mlp="gpt_neox.layers.{}.mlp",
        final_norm="gpt_neox.final_layer_norm",
        # `embed_out` before transformers 5, `lm_head` since.
        unembedding=("embed_out", "lm_head"),
        attention_norm="gpt_neox.layers.{}.input_layernorm",
        mlp_norm="gpt_neox.layers.{}.post_attention_layernorm",
        parallel=True,  # config.use_parallel_residual (its default)
        qkv=("gpt_neox.layers.{}.attention.query_key_value",),
        qkv_layout="per_head",
    ),
    Architecture(
        family="BERT",
        model_types=("bert",),
        embeddings="bert.embeddings.word_embeddings",
        blocks="bert.encoder.layer",
        attention="bert.encoder.layer.{}.attention.self",
        heads="bert.encoder.layer.{}.attention.output.dense",
        mlp="bert.encoder.layer.{}.intermediate",
        final_norm=None,
        unembedding=("cls.predictions",),
        causal=False,  # a masked LM: every position sees every other
        cache="none",
    ),
)


def families() -> list[str]:
    """Every model_type the table knows, for messages."""
    return [t for a in ARCHITECTURES for t in a.model_types]


def architecture_of(model: nn.Module) -> Architecture | None:
    """The entry of `model`'s family: by its config's model_type, else the first whose
    blocks, final norm and unembedding it has by name (a caller's module); None if none."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for entry in ARCHITECTURES:
        if model_type in entry.model_types:
            return entry
    modules = dict(model.named_modules())
    for entry in ARCHITECTURES:
        named = [entry.blocks, entry.final_norm]
        if all(n is None or n in modules for n in named) and entry.unembedding_of(modules):
            return entry
    return None
