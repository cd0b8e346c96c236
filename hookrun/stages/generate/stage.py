"""The generation stage (`generate:`, experiment=generate): each row's prompt continued by a
causal language model with the run's hooks acting at every decoding step — the prompt's
pass and each new token's, through the key-value cache (decode.py) — and what it gave
stored per row (keys.py); the summary shows the first rows' text.

Every hook that changes values (add, scale, zero, clamp, noise, ablate_direction, on module
inputs and outputs, heads included) acts at each step as in the run's own pass; the prompt's
pass is the run's own (decode.py), so hooks tied to the prompt's tokens — `args.positions`,
`patch` — act there, and through the cache on everything after. Captures are the run's
pass over the prompt (its datasets as without `generate`); attention-pattern actions are
refused before any work.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import h5py
import numpy as np
import torch

from hookrun.errors import HookrunError
from hookrun.io.encoding import read_floats
from hookrun.models.adapter import adapt
from hookrun.runtime.hooks import attach
from hookrun.runtime.plan import HookPlan
from hookrun.runtime.sites import Site
from hookrun.stage import ParseContext, Plan, Setup, Stage, Stored, Work, register_stage
from hookrun.stages.generate.config import GenerateConfig, parse_generate
from hookrun.stages.generate.decode import Sampling, decode, rescore
from hookrun.stages.generate.keys import (
    GENERATION,
    LOGPROBS,
    LOGPROBS_UNHOOKED,
    MASK,
    TEXT,
    TOKENS,
)

__all__ = ["GenerateStage"]

_SHOWN_ROWS = 3


class GeneratePlan(Plan):
    def __init__(
        self, config: GenerateConfig, hooks: HookPlan, ends: list[int], width: int, pad: int
    ) -> None:
        self.config, self.hooks, self.ends, self.width = config, hooks, ends, width
        self.pad = pad  # fed to rows that stopped (any token in the vocabulary will do)

    def stored(self) -> dict[str, Stored]:
        steps = (self.config.max_new_tokens,)
        return {
            TOKENS: Stored(steps),
            MASK: Stored(steps),
            LOGPROBS: Stored(steps),
            LOGPROBS_UNHOOKED: Stored(steps),
            TEXT: Stored((), {"encoding": "utf-8"}),
        }

    def describe(self, itemsize: int) -> str:
        steps = self.config.max_new_tokens
        sizes = {TOKENS: 4 * steps, MASK: steps, LOGPROBS: 4 * steps}
        sizes |= {LOGPROBS_UNHOOKED: 4 * steps, TEXT: self.width}
        lines = [f"/{GENERATION}: {len(sizes)} dataset(s), {steps} steps"]
        lines += [f"    {size:>8} B/sample  /{key}" for key, size in sizes.items()]
        return "\n".join(lines)

    def attrs(self) -> dict[str, dict]:
        c = self.config
        said = {"max_new_tokens": c.max_new_tokens, "temperature": c.temperature}
        said |= {"top_k": c.top_k or 0, "top_p": c.top_p or 1.0, "end_tokens": self.ends}
        return {GENERATION: said}

    def batch(self, work: Work) -> dict[str, Any]:
        language = adapt(work.model).language
        batch = work.on_device
        recorder = work.recorder({})
        first = int(batch.index[0])
        c = self.config
        steps = iter(range(c.max_new_tokens))

        # Each row's prompt: its real tokens up to its read position.
        upto = (
            torch.arange(batch.tokens.shape[1], device=batch.tokens.device) <= batch.read[:, None]
        )
        prompts = (batch.tokens, (batch.mask.bool() & upto).to(batch.mask.dtype))

        def before_step() -> None:  # each step is a forward pass of its own: calls from 0
            recorder.begin(first)
            recorder.rows = batch.index  # stored rows to patch in (the prompt's pass)
            recorder.step = next(steps)  # noise draws anew at each step
            recorder.mask = prompts[1] if recorder.step == 0 else None  # args.positions count here

        sampling = Sampling(c.temperature, c.top_k, c.top_p)
        device = batch.inputs.device
        ends = torch.tensor(self.ends, dtype=torch.int64, device=device)
        pad = self.pad
        generator = work.generator("generate", device) if c.temperature > 0 else None
        with ExitStack() as stack, torch.inference_mode():
            stack.enter_context(attach(self.hooks, work.model, recorder))
            out = decode(
                language, prompts, c.max_new_tokens, sampling, (ends, pad), generator, before_step
            )
            stack.close()  # the hooks off: the plain model scores what the hooked one wrote
            plain = rescore(language, prompts, out, pad)
        tokens, mask = out.tokens.cpu(), out.mask.cpu()
        texts = [
            language.tokenizer.decode(row[keep].tolist(), skip_special_tokens=True)
            for row, keep in zip(tokens, mask, strict=True)
        ]
        return {
            TOKENS: tokens.to(torch.int32),
            MASK: mask,
            LOGPROBS: out.logprobs.cpu(),
            LOGPROBS_UNHOOKED: plain.cpu(),
            # UTF-8 of one width for the run (resumed rows and torchrun shards share a dtype).
            TEXT: np.array(
                [_fixed(t, self.width) for t in texts], dtype=h5py.string_dtype("utf-8", self.width)
            ),
        }


def _fixed(text: str, width: int) -> bytes:
    """`text` as UTF-8 in at most `width` bytes, cut at a character's boundary."""
    return text.encode("utf-8")[:width].decode("utf-8", "ignore").encode("utf-8")


@register_stage
class GenerateStage(Stage):
    name = node = "generate"
    order = 60
    axes = {TEXT: "sample", f"{GENERATION}/*": "sample step"}

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> Any:
        return parse_generate(raw)

    @classmethod
    def plan(cls, config: GenerateConfig, setup: Setup) -> Plan:
        language = setup.causal_language("generate")
        if language.tokenizer is None:
            raise HookrunError(
                "generate: the model has no tokenizer to write the text with; valid: "
                "LanguageModel(model, tokenizer), or model=hf with its tokenizer files"
            )
        hooks = _generation_hooks(setup.plan)
        # Every token row has the padded width of sample 0's: no prompt is longer.
        _check_positions(config, language, int(setup.sample.shape[-1]))
        ends = _end_tokens(language) if config.stop_at_eos else []
        width = _text_width(language, config.max_new_tokens)
        return GeneratePlan(config, hooks, ends, width, _pad(language))

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        if TEXT not in f:
            return []
        shown = min(rows, _SHOWN_ROWS)
        texts = [t.decode("utf-8") for t in f[TEXT][:shown]]
        lines = [f"generated, sample {i}: {t!r}" for i, t in enumerate(texts)]
        if LOGPROBS_UNHOOKED in f:
            hooked, plain = _mean_logprobs(f, rows)
            lines.append(
                f"generated tokens' mean log probability: {hooked:.3f} under the hooked model, "
                f"{plain:.3f} under the model without hooks (fluency)"
            )
        return lines

    @classmethod
    def columns(cls, f: h5py.File, rows: int) -> dict[str, float]:
        if LOGPROBS_UNHOOKED not in f:
            return {}
        hooked, plain = _mean_logprobs(f, rows)
        return {"generate:logprob": hooked, "generate:fluency": plain}


def _mean_logprobs(f: h5py.File, rows: int) -> tuple[float, float]:
    """The generated tokens' mean log probability under the hooked model and under the
    model without hooks (fluency), over every real token of the first `rows` rows."""
    hooked = float(np.nanmean(read_floats(f[LOGPROBS], slice(0, rows))))
    plain = float(np.nanmean(read_floats(f[LOGPROBS_UNHOOKED], slice(0, rows))))
    return hooked, plain


def _generation_hooks(plan: HookPlan) -> HookPlan:
    """The run's hooks that act during decoding: those that change values (captures and
    gradient sites keep to the run's pass over the prompt). Those tied to the prompt's
    tokens (`args.positions`, `patch`) act at the prompt's pass only (plan.acts_at_step).
    Refused: attention-pattern actions."""
    for hook in plan.hooks:
        if hook.site == Site.pattern and not hook.action.captures:
            raise HookrunError(
                f"hooks.{hook.name}.at: pattern with generate; valid: capture there (the prompt's "
                "pass), or a module's input or output"
            )
    return plan.acting()


def _check_positions(config: GenerateConfig, language: Any, longest: int) -> None:
    """The longest row and its new tokens fit the model's learned positions (the last token
    chosen is never fed back: it needs none)."""
    limit = language.max_positions()
    if limit is None:
        return
    most, key = limit
    if longest + config.max_new_tokens - 1 > most:
        raise HookrunError(
            f"generate.max_new_tokens: {config.max_new_tokens} after a prompt of up to "
            f"{longest} tokens passes the model's {most} positions ({key}); valid: at most "
            f"{max(most - longest + 1, 0)}"
        )


def _pad(language: Any) -> int:
    """The token fed to rows that stopped: the tokenizer's pad or end token where it is in
    the vocabulary, else 0 (its outputs are never read)."""
    vocab = int(language.config.vocab_size)
    tok = language.tokenizer
    found = [t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None and 0 <= t < vocab]
    return int(found[0]) if found else 0


def _end_tokens(language: Any) -> list[int]:
    """The model's end-of-text token ids (its generation config's, else its config's)."""
    found = getattr(getattr(language.hf, "generation_config", None), "eos_token_id", None)
    if found is None:
        found = getattr(language.config, "eos_token_id", None)
    if found is None:
        return []
    return [int(x) for x in (found if isinstance(found, (list, tuple)) else [found])]


def _text_width(language: Any, steps: int) -> int:
    """Bytes of /generation/text: `steps` tokens of the vocabulary's longest text, with room
    for a word's leading space a token decoded alone loses."""
    vocab = int(language.config.vocab_size)
    texts = language.tokenizer.batch_decode([[i] for i in range(vocab)])
    return steps * (max(len(t.encode("utf-8")) for t in texts) + 4)
