"""The local replacement model of one prompt on a Hugging Face GPT-2, and its transposed pass.

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

__all__ = ["Replacement", "Block", "PRE_AFFINE", "POST_AFFINE", "centre_scale"]

# Where a transcoder reads: the normalised residual before ln_2's weight and bias
# (TransformerLens's ln2.hook_normalized), or ln_2's output (the MLP's input).
PRE_AFFINE = "pre_affine"
POST_AFFINE = "post_affine"


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
        return (u - u.mean(-1, keepdim=True)) / scale


def centre_scale(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x normalised (before a LayerNorm's weight and bias) and the scale per position."""
    centred = x - x.mean(-1, keepdim=True)
    scale = (centred.pow(2).mean(-1) + eps).sqrt()
    return centred / scale[:, None], scale


class Replacement:
    """The prompt's frozen model: blocks, final norm, embeddings (see the module docstring)."""

    def __init__(
        self, blocks: list[Block], ln_f_w: Tensor, s_f: Tensor, embeds: Tensor, n_heads: int
    ):
        self.blocks, self.ln_f_w, self.s_f, self.embeds = blocks, ln_f_w, s_f, embeds
        self.n_heads = n_heads

    @classmethod
    def capture(
        cls, hf: nn.Module, tokens: Tensor, transcoders: list[Dictionary], reads: list[str]
    ) -> tuple[Replacement, Tensor]:
        """Run the GPT-2 `hf` (a GPT2LMHeadModel) on one prompt and freeze it.

        Returns:
            The replacement model and the logits at the last position (V,).
        """
        body = hf.transformer
        seen: dict[str, Tensor] = {}

        def keep(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple, output: object) -> None:
                seen[name + ".in"] = args[0][0].detach()
                if isinstance(output, Tensor):
                    seen[name + ".out"] = output[0].detach()

            return hook

        hooks = [ModuleHook(body.wte, keep("wte"))]
        for i, block in enumerate(body.h):
            hooks += [
                ModuleHook(block.ln_1, keep(f"{i}.ln_1")),
                ModuleHook(block.ln_2, keep(f"{i}.ln_2")),
                ModuleHook(block.mlp, keep(f"{i}.mlp")),
            ]
        hooks.append(ModuleHook(body.ln_f, keep("ln_f")))
        with torch.no_grad(), hooked(hooks):
            out = hf(
                input_ids=tokens[None],
                attention_mask=torch.ones_like(
                    tokens[None]
                ),  # no padding (said, so transformers does not warn)
                output_attentions=True,
                use_cache=False,
            )
        patterns = out.attentions
        d = body.config.n_embd
        blocks = []
        for i, block in enumerate(body.h):
            _, s1 = centre_scale(seen[f"{i}.ln_1.in"], block.ln_1.eps)
            x_hat, s2 = centre_scale(seen[f"{i}.ln_2.in"], block.ln_2.eps)
            blocks.append(
                Block(
                    ln1_w=block.ln_1.weight.detach(),
                    s1=s1,
                    pattern=patterns[i][0].detach(),
                    w_v=block.attn.c_attn.weight.detach()[:, 2 * d :],
                    w_o=block.attn.c_proj.weight.detach(),
                    ln2_w=block.ln_2.weight.detach(),
                    ln2_b=block.ln_2.bias.detach(),
                    s2=s2,
                    x_hat=x_hat,
                    mlp_out=seen[f"{i}.mlp.out"],
                    transcoder=transcoders[i],
                    reads=reads[i],
                )
            )
        _, s_f = centre_scale(seen["ln_f.in"], body.ln_f.eps)
        model = cls(blocks, body.ln_f.weight.detach(), s_f, seen["wte.out"], body.config.n_head)
        model.unembed = hf.lm_head.weight.detach()  # (V, d)
        return model, out.logits[0, -1].detach()

    def logit_grad(self, vectors: Tensor) -> Tensor:
        """(K, d) directions at ln_f's output -> their gradients at the last residual."""
        u = vectors * self.ln_f_w
        return (u - u.mean(-1, keepdim=True)) / self.s_f[-1]

    def attention_back(self, block: Block, g: Tensor) -> Tensor:
        """g (B, T, d) at the attention's output -> at the block's residual input, through
        the value path with the pattern frozen, and ln_1 with its scale frozen."""
        b, t, d = g.shape
        h = self.n_heads
        gz = (g @ block.w_o.T).view(b, t, h, d // h)
        gv = torch.einsum("hqk,bqhe->bkhe", block.pattern, gz).reshape(b, t, d)
        u = (gv @ block.w_v.T) * block.ln1_w
        return (u - u.mean(-1, keepdim=True)) / block.s1[:, None]

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
