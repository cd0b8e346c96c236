"""The decoding loop: each row's prompt continued token by token with the key-value cache,
every step a forward pass of the Hugging Face model under whatever hooks are attached.

The prompt's pass is the run's own pass: the rows as the data gave them, right-padded to
the run's width and masked, so a hook sees at step 0 the very tensor it sees in the run
(stored rows patch in, `args.positions` count as there). Each new token goes after the
padding, masked out of every row's attention, with its position counted from its row's
real tokens — so a row is continued as it would be alone (to float rounding), as Hugging
Face's left-padded `generate` continues it. A row that has given its end token stops: later
steps still run it (the batch moves together) but nothing of it is kept.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hookrun.stages.generate.keys import NO_TOKEN

__all__ = ["Sampling", "Decoded", "Rescored", "decode", "prompt_positions", "choose", "rescore"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else drawn."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None


@dataclass(frozen=True)
class Decoded:
    tokens: torch.Tensor  # (N, steps) int64, NO_TOKEN after a row stopped
    logprobs: torch.Tensor  # (N, steps) float32, NaN after a row stopped
    # (N, steps) int64: the most likely token at each step (the tokens themselves when
    # greedy), NO_TOKEN after a row stopped
    top: torch.Tensor

    @property
    def mask(self) -> torch.Tensor:
        return self.tokens != NO_TOKEN


@dataclass(frozen=True)
class Rescored:
    """The generated tokens under another model (the plain one): each one's log probability
    (N, steps) float32 and that model's most likely token at each step (N, steps) int64;
    NaN and NO_TOKEN after a row's end."""

    logprobs: torch.Tensor
    top: torch.Tensor


def prompt_positions(mask: torch.Tensor) -> torch.Tensor:
    """(N, T): each real token's position in its row (padding after it: its last)."""
    return (mask.long().cumsum(1) - 1).clamp(min=0)


def rescore(
    language: nn.Module, prompts: tuple[torch.Tensor, torch.Tensor], decoded: Decoded, pad: int
) -> Rescored:
    """The generated tokens under whatever hooks are attached now (none: the plain model),
    in one pass over each prompt and its generated tokens (laid out as decoding laid
    them)."""
    ids, mask = prompts
    new = torch.where(decoded.mask, decoded.tokens, torch.full_like(decoded.tokens, pad))
    steps, lengths = new.shape[1], mask.sum(1)
    # The last token is scored, never fed (decoding did not feed it either: a prompt and
    # its tokens may fill the model's positions but for that one).
    fed = new[:, :-1]
    inputs = torch.cat([ids, fed], dim=1)
    full = torch.cat([mask.long(), decoded.mask[:, :-1].long()], dim=1)
    after = lengths[:, None] + torch.arange(steps - 1, device=ids.device)
    positions = torch.cat([prompt_positions(mask), after], 1)
    out = language(input_ids=inputs, attention_mask=full, position_ids=positions, use_cache=False)
    # Token 0 is predicted at the prompt's last real token, token s at column T + s - 1.
    width = ids.shape[1]
    columns = torch.cat(
        [
            lengths[:, None] - 1,
            width + torch.arange(steps - 1, device=ids.device).expand(len(ids), -1),
        ],
        1,
    )
    logits = out.logits.gather(1, columns[..., None].expand(-1, -1, out.logits.shape[-1])).float()
    logp = logits.log_softmax(-1).gather(2, new[..., None])[..., 0]
    top = logits.argmax(-1)
    return Rescored(
        torch.where(decoded.mask, logp, torch.full_like(logp, float("nan"))),
        torch.where(decoded.mask, top, torch.full_like(top, NO_TOKEN)),
    )


def choose(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> torch.Tensor:
    """The next token of each row from its logits (N, V) float32."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    # From the largest logit down, in float64: a temperature near 0 sends the others to −inf
    # (the most likely token is then certain) instead of every logit to ±inf (NaN).
    shifted = (logits - logits.max(dim=-1, keepdim=True).values).double()
    scaled = shifted / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scaled.shape[-1]:
        kth = scaled.topk(sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered, order = scaled.sort(dim=-1, descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # mass above each token
        drop = before >= sampling.top_p
        drop[:, 0] = False  # the most likely token always stays (a top_p that rounds to 0)
        scaled = scaled.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def decode(
    language: nn.Module,
    prompts: tuple[torch.Tensor, torch.Tensor],
    steps: int,
    sampling: Sampling,
    stop: tuple[torch.Tensor, int],
    generator: torch.Generator | None = None,
    before_step: Callable[[], None] = lambda: None,
) -> Decoded:
    """Up to `steps` tokens after each prompt (`prompts`: right-padded ids (N, T) and their
    mask); `stop`: the end-token ids (empty: none) and the pad id fed to rows that stopped.
    `before_step` runs before each forward pass (the hooks' call counts start again
    there)."""
    (inputs, mask), (ends, pad) = prompts, stop
    rows, lengths = len(inputs), mask.sum(1)
    mask, positions = mask.long(), prompt_positions(mask)
    device = inputs.device
    tokens = torch.full((rows, steps), NO_TOKEN, dtype=torch.int64, device=device)
    top = torch.full_like(tokens, NO_TOKEN)
    logprobs = torch.full((rows, steps), float("nan"), dtype=torch.float32, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    # transformers 5 names the key-value cache `cache`; earlier versions `past_key_values`.
    cache_key = (
        "cache"
        if "cache" in inspect.signature(language.hf.forward).parameters
        else "past_key_values"
    )
    cache = None
    for step in range(steps):
        before_step()
        out = language(  # through the root: function sites see each step
            input_ids=inputs,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            return_dict=True,
            **{cache_key: cache},
        )
        cache = getattr(out, cache_key)
        # The prompt's pass: each row's last real token; later passes: the one new token.
        last = lengths - 1 if step == 0 else torch.zeros_like(lengths)
        logits = out.logits[torch.arange(rows, device=device), last].float()
        chosen = choose(logits, sampling, generator)
        likeliest = chosen if sampling.temperature == 0 else logits.argmax(dim=-1)
        logp = logits.log_softmax(-1).gather(1, chosen[:, None])[:, 0]
        tokens[:, step] = torch.where(done, NO_TOKEN, chosen)
        top[:, step] = torch.where(done, NO_TOKEN, likeliest)
        logprobs[:, step] = torch.where(done, float("nan"), logp)
        done |= torch.isin(chosen, ends)
        if bool(done.all()):
            break
        inputs = torch.where(done, pad, chosen)[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = (lengths + step)[:, None]
    return Decoded(tokens, logprobs, top)
