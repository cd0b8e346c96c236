"""Interventions on a graph's feature nodes: the logits the model gives with some latents edited.

circuit-tracer's `feature_intervention` (freeze_attention=True, its default), on the Hugging
Face model itself: every attention pattern is held at the prompt's (the values still flow),
the norms and the real MLPs run, and at each edited layer the MLP's output gains
(edited − current latents) · W_dec, the current latents being the transcoder's encoding of
what that MLP reads in this very pass — so an edit at one layer changes the latents every
later layer sees, and a later edit acts on those. The edits are Dictionaries I's
(runtime/splice.py `edited`: zero, scale, clamp, set). Position 0 (the beginning of the text)
has no latents, as in the graph: its current latents are zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from hookrun.errors import HookrunError
from hookrun.runtime.handles import ModuleHook, hooked
from hookrun.runtime.splice import EditArgs, edited
from hookrun.stages.graph.config import FeatureEdit
from hookrun.stages.graph.replacement import GPT2, PRE_AFFINE, Replacement, family_of, normalise

__all__ = ["resolve", "intervened_logits"]

# (layer, position, edit) with the position resolved against one prompt.
Resolved = list[tuple[int, int, EditArgs]]


def resolve(
    intervention: tuple[FeatureEdit, ...], positions: int, widths: list[int], key: str
) -> Resolved:
    """The edits of one intervention on a prompt of `positions` tokens, each position made
    non-negative; `widths`: each layer's transcoder width.

    Raises:
        HookrunError: a layer the model lacks, a latent past the transcoders' width, a
            position outside the prompt, a latent edited twice at one position.
    """
    done: Resolved = []
    seen: set[tuple[int, int, int]] = set()
    for j, e in enumerate(intervention):
        where = f"{key}[{j}]" if len(intervention) > 1 else key
        layers = len(widths)
        if e.layer >= layers:
            raise HookrunError(
                f"{where}.layer: {e.layer}; valid: a layer of the model's {layers} (0 to "
                f"{layers - 1})"
            )
        width = widths[e.layer]
        past = [j for j in e.edit.latents if j >= width]
        if past:
            raise HookrunError(
                f"{where}.latents: {past[0]}; valid: latents below layer {e.layer}'s "
                f"transcoder width {width}"
            )
        for p in e.positions:
            at = p + positions if p < 0 else p
            if not 0 <= at < positions:
                raise HookrunError(
                    f"{where}.position: {p} on a prompt of {positions} tokens; valid: "
                    f"{-positions} to {positions - 1}"
                )
            for latent in e.edit.latents:
                if (e.layer, at, latent) in seen:
                    raise HookrunError(
                        f"{where}: latent {latent} of layer {e.layer} at position {at} edited "
                        "twice; valid: one edit per latent and position"
                    )
                seen.add((e.layer, at, latent))
            done.append((e.layer, at, e.edit))
    return done


def intervened_logits(
    hf: nn.Module, tokens: Tensor, frozen: Replacement, edits: Resolved
) -> Tensor:
    """The last position's logits (V,) of `hf` (a causal LM of replacement.FAMILIES) on
    `tokens` (T,) with `edits` made, the attention patterns those `frozen` holds (see the
    module docstring)."""
    family = family_of(hf)
    body = getattr(hf, family.body)
    d, heads = hf.config.hidden_size, hf.config.num_attention_heads
    values: dict[int, Tensor] = {}
    mlp_reads: dict[int, Tensor] = {}

    def keep_values(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            values[i] = output[..., 2 * d :] if family is GPT2 else output

        return hook

    def frozen_mix(i: int) -> Callable[..., tuple[Tensor]]:
        # The output projection's input is the heads' mix of the values; here under the
        # prompt's patterns (grouped-query value heads shared, as HF's repeat_kv shares them).
        def hook(module: nn.Module, args: tuple) -> tuple[Tensor]:
            v = values.pop(i)[0]
            t = v.shape[0]
            pattern = frozen.blocks[i].pattern  # (H, T, T)
            v = v.view(t, -1, args[0].shape[-1] // heads).transpose(0, 1)  # (KV, T, e)
            v = v.repeat_interleave(heads // v.shape[0], dim=0)
            z = (pattern @ v).transpose(0, 1).reshape(1, t, -1)
            return (z.to(args[0].dtype),)

        return hook

    def keep_mlp_read(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            pre_affine = frozen.blocks[i].reads == PRE_AFFINE
            x = args[0][0]
            mlp_reads[i] = normalise(x, module, family.rms)[0] if pre_affine else output[0]

        return hook

    def edit_mlp(i: int, mine: Resolved) -> Callable[..., Tensor]:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
            transcoder = frozen.blocks[i].transcoder
            current = transcoder.encode(mlp_reads.pop(i))
            current[0] = 0  # the beginning of the text has no latents
            new = current
            for _, at, edit in mine:
                new = new.clone()
                new[at] = edited(new[at], edit)
            delta = (new - current) @ transcoder.tensors["W_dec"]
            return output + delta[None].to(output.dtype)

        return hook

    hooks = []
    for i, block in enumerate(getattr(body, family.blocks)):
        attn = getattr(block, family.attn)
        values_of, mix = (
            (attn.c_attn, attn.c_proj) if family is GPT2 else (attn.v_proj, attn.o_proj)
        )
        hooks += [
            ModuleHook(values_of, keep_values(i)),
            ModuleHook(mix, frozen_mix(i), before=True),
        ]
        mine = [e for e in edits if e[0] == i]
        if mine:
            hooks += [
                ModuleHook(getattr(block, family.norm2), keep_mlp_read(i)),
                ModuleHook(getattr(block, family.mlp), edit_mlp(i, mine)),
            ]
    with torch.no_grad(), hooked(hooks):
        out = hf(
            input_ids=tokens[None], attention_mask=torch.ones_like(tokens[None]), use_cache=False
        )
    return out.logits[0, -1].detach()
