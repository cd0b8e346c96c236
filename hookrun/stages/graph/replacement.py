"""The local replacement model of one prompt on a Hugging Face GPT-2 or Llama, and its
transposed pass.

circuit-tracer's method (its attribution/context_transformerlens.py): attention patterns and
every LayerNorm's scale frozen at the prompt's values, each MLP replaced by its transcoder
with the error (MLP output minus the transcoder's reconstruction) held constant. What is left
is linear in the residual stream: the attention's value/output path, the norms' centring and
weights, a skip transcoder's W_skip. `Replacement.capture` runs the model once (by hooks,
runtime/handles.hooked) and keeps what the frozen model needs; `sweep` carries a batch of
gradients from the top of the model to its embeddings through that linear model by hand —
the attention pattern is one (heads, T, T) tensor shared by the batch, so memory is the
batch's gradients (B, T, d), never B copies of the patterns as an autograd pass over an
expanded batch holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hookrun.dictionaries.dictionary import Dictionary
from hookrun.runtime.handles import ModuleHook, hooked

__all__ = [
    "Replacement",
    "Block",
    "Family",
    "family_of",
    "PRE_AFFINE",
    "POST_AFFINE",
    "normalise",
]

# Where a transcoder reads: the normalised residual before ln_2's weight and bias
# (TransformerLens's ln2.hook_normalized), or ln_2's output (the MLP's input).
PRE_AFFINE = "pre_affine"
POST_AFFINE = "post_affine"


@dataclass(frozen=True)
class Family:
    """Where a family of causal language models keeps the parts the frozen model reads."""

    name: str
    body: str  # the decoder under the LM head
    blocks: str
    norm1: str  # the norm before the attention
    attn: str
    norm2: str  # the norm before the MLP
    mlp: str
    final: str  # the norm before the unembedding
    embed: str  # the token embedding
    rms: bool  # RMSNorm (x / sqrt(mean x^2 + eps), no centring, no bias), else LayerNorm


GPT2 = Family("GPT-2", "transformer", "h", "ln_1", "attn", "ln_2", "mlp", "ln_f", "wte", False)
LLAMA = Family(
    "Llama",
    "model",
    "layers",
    "input_layernorm",
    "self_attn",
    "post_attention_layernorm",
    "mlp",
    "norm",
    "embed_tokens",
    True,
)
# By the Hugging Face class: the families the frozen model is written for (a Llama's gated
# MLP is replaced by its transcoder; grouped-query attention's value heads are shared).
FAMILIES = {"GPT2LMHeadModel": GPT2, "LlamaForCausalLM": LLAMA}


def family_of(hf: nn.Module) -> Family | None:
    """The family of the Hugging Face model `hf`, or None where the frozen model has none."""
    return FAMILIES.get(type(hf).__name__)


@dataclass
class Block:
    """One layer of the frozen model: its weights and the prompt's frozen values."""

    ln1_w: Tensor  # (d,)
    s1: Tensor  # (T,) ln_1's scale sqrt(var + eps) per position
    pattern: Tensor  # (H, T, T) attention probabilities
    w_v: Tensor  # (d, d) value projection (x W_v)
    w_o: Tensor  # (d, d) output projection (z W_o)
    ln2_w: Tensor  # (d,)
    ln2_b: Tensor  # (d,)
    s2: Tensor  # (T,)
    x_hat: Tensor  # (T, d) ln_2's normalised input, before its weight and bias
    mlp_out: Tensor  # (T, d)
    transcoder: Dictionary
    reads: str  # PRE_AFFINE or POST_AFFINE
    rms: bool  # the norms are RMSNorms: no centring

    def tc_input(self) -> Tensor:
        """What the transcoder reads at every position."""
        if self.reads == PRE_AFFINE:
            return self.x_hat
        return self.x_hat * self.ln2_w + self.ln2_b

    def input_grad(self, u: Tensor, positions: Tensor | None = None) -> Tensor:
        """A gradient at the transcoder's input carried to the residual before ln_2 (its
        scale frozen): u (..., T, d) at every position, or (m, d) at `positions` (m,)."""
        if self.reads == POST_AFFINE:
            u = u * self.ln2_w
        scale = self.s2[:, None] if positions is None else self.s2[positions, None]
        return _centred(u, self.rms) / scale


def _centred(u: Tensor, rms: bool) -> Tensor:
    # A frozen LayerNorm's backward subtracts the mean; a frozen RMSNorm's does not.
    return u if rms else u - u.mean(-1, keepdim=True)


def normalise(x: Tensor, norm: nn.Module, rms: bool) -> tuple[Tensor, Tensor]:
    """x normalised by the norm module `norm` before its weight (and bias), and the scale
    per position: LayerNorm's sqrt(var + eps), RMSNorm's sqrt(mean x^2 + eps)."""
    if rms:
        scale = (x.float().pow(2).mean(-1) + norm.variance_epsilon).sqrt().to(x.dtype)
        return x / scale[:, None], scale
    centred = x - x.mean(-1, keepdim=True)
    scale = (centred.pow(2).mean(-1) + norm.eps).sqrt()
    return centred / scale[:, None], scale


def _value_out(family: Family, attn: nn.Module, d: int, heads: int) -> tuple[Tensor, Tensor]:
    """The attention's value projection (d, H * head) per query head (grouped-query value
    heads repeated, as HF's repeat_kv shares them) and output projection (H * head, d), both
    as x @ W."""
    if family is GPT2:  # Conv1D: x @ W, the values the third d columns of c_attn
        return attn.c_attn.weight.detach()[:, 2 * d :], attn.c_proj.weight.detach()
    w_v = attn.v_proj.weight.detach().T  # (d, KV * head)
    kv = w_v.shape[1] // attn.head_dim
    w_v = w_v.view(d, kv, attn.head_dim).repeat_interleave(heads // kv, dim=1)
    return w_v.reshape(d, -1), attn.o_proj.weight.detach().T


class Replacement:
    """The prompt's frozen model: blocks, final norm, embeddings (see the module docstring)."""

    def __init__(
        self,
        blocks: list[Block],
        ln_f_w: Tensor,
        s_f: Tensor,
        embeds: Tensor,
        n_heads: int,
        rms: bool = False,
    ):
        self.blocks, self.ln_f_w, self.s_f, self.embeds = blocks, ln_f_w, s_f, embeds
        self.n_heads, self.rms = n_heads, rms

    @classmethod
    def capture(
        cls, hf: nn.Module, tokens: Tensor, transcoders: list[Dictionary], reads: list[str]
    ) -> tuple[Replacement, Tensor]:
        """Run `hf` (a causal LM of FAMILIES) on one prompt and freeze it.

        Returns:
            The replacement model and the logits at the last position (V,).
        """
        family = family_of(hf)
        if family is None:
            raise ValueError(f"{type(hf).__name__}: no family of the frozen model")
        body = getattr(hf, family.body)
        layers = getattr(body, family.blocks)
        seen: dict[str, Tensor] = {}

        def keep(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple, output: object) -> None:
                if args:
                    seen[name + ".in"] = args[0][0].detach()
                if isinstance(output, Tensor):
                    seen[name + ".out"] = output[0].detach()

            return hook

        hooks = [ModuleHook(getattr(body, family.embed), keep("embed"))]
        for i, block in enumerate(layers):
            hooks += [
                ModuleHook(getattr(block, family.norm1), keep(f"{i}.norm1")),
                ModuleHook(getattr(block, family.norm2), keep(f"{i}.norm2")),
                ModuleHook(getattr(block, family.mlp), keep(f"{i}.mlp")),
            ]
        hooks.append(ModuleHook(getattr(body, family.final), keep("final")))
        with torch.no_grad(), hooked(hooks):
            out = hf(
                input_ids=tokens[None],
                attention_mask=torch.ones_like(tokens[None]),  # no padding (said, so no warning)
                output_attentions=True,
                use_cache=False,
            )
        patterns = out.attentions
        d, heads = hf.config.hidden_size, hf.config.num_attention_heads
        rms = family.rms
        blocks = []
        for i, block in enumerate(layers):
            norm1, norm2 = getattr(block, family.norm1), getattr(block, family.norm2)
            _, s1 = normalise(seen[f"{i}.norm1.in"], norm1, rms)
            x_hat, s2 = normalise(seen[f"{i}.norm2.in"], norm2, rms)
            w_v, w_o = _value_out(family, getattr(block, family.attn), d, heads)
            bias = getattr(norm2, "bias", None)
            blocks.append(
                Block(
                    ln1_w=norm1.weight.detach(),
                    s1=s1,
                    pattern=patterns[i][0].detach(),
                    w_v=w_v,
                    w_o=w_o,
                    ln2_w=norm2.weight.detach(),
                    ln2_b=torch.zeros(d) if bias is None else bias.detach(),
                    s2=s2,
                    x_hat=x_hat,
                    mlp_out=seen[f"{i}.mlp.out"],
                    transcoder=transcoders[i],
                    reads=reads[i],
                    rms=rms,
                )
            )
        final = getattr(body, family.final)
        _, s_f = normalise(seen["final.in"], final, rms)
        model = cls(blocks, final.weight.detach(), s_f, seen["embed.out"], heads, rms)
        model.unembed = hf.lm_head.weight.detach()  # (V, d)
        return model, out.logits[0, -1].detach()

    def logit_grad(self, vectors: Tensor) -> Tensor:
        """(K, d) directions at ln_f's output -> their gradients at the last residual."""
        return _centred(vectors * self.ln_f_w, self.rms) / self.s_f[-1]

    def attention_back(self, block: Block, g: Tensor) -> Tensor:
        """g (B, T, d) at the attention's output -> at the block's residual input, through
        the value path with the pattern frozen, and ln_1 with its scale frozen."""
        b, t, _ = g.shape
        h = self.n_heads
        gz = (g @ block.w_o.T).view(b, t, h, -1)
        gv = torch.einsum("hqk,bqhe->bkhe", block.pattern, gz).reshape(b, t, -1)
        u = (gv @ block.w_v.T) * block.ln1_w
        return _centred(u, self.rms) / block.s1[:, None]

    def sweep(
        self,
        top: Tensor,
        inject: Callable[[int, Tensor], None],
        read: Callable[[int, Tensor], None],
    ) -> Tensor:
        """The batch's gradients carried from the last residual down to the embeddings.

        Args:
            top: (B, T, d) the gradients at the last block's output (logit rows).
            inject: inject(layer, g): adds the rows' targets that read the MLP input of
                `layer` to g (B, T, d), the gradient at that layer's residual before ln_2.
            read: read(layer, g): g (B, T, d) is the gradient at the layer's MLP output:
                the edges from that layer's features and errors.

        Returns:
            (B, T, d): the gradients at the token embeddings.
        """
        g = top
        for layer in range(len(self.blocks) - 1, -1, -1):
            block = self.blocks[layer]
            read(layer, g)
            mid = g
            skip = block.transcoder.tensors.get("W_skip")
            if skip is not None:  # x W_skip: the one path through an MLP's replacement
                mid = mid + block.input_grad(g @ skip.T.to(g.dtype))
            inject(layer, mid)
            g = mid + self.attention_back(block, mid)
        return g
