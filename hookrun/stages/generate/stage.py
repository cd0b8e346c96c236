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

Fluency (generate.fluency) is the text's log probability under the model without the
hooks: one more pass over prompt and text where hooks change values (which also tells the
rows they changed nothing, /generation/unchanged: the summary warns when that is every
row), the run's own log probabilities where none does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
import torch

from hookrun.errors import HookrunError
from hookrun.memory import check_fits
from hookrun.models.adapter import adapt
from hookrun.runtime.hooks import attach
from hookrun.runtime.plan import HookPlan, PlannedHook
from hookrun.runtime.sites import Site
from hookrun.stage import ParseContext, Plan, Setup, Stage, Stored, Work, register_stage
from hookrun.stages.generate.config import GenerateConfig, parse_generate
from hookrun.stages.generate.decode import Decoded, Rescored, Sampling, decode, rescore
from hookrun.stages.generate.keys import (
    GENERATION,
    LOGPROBS,
    LOGPROBS_UNHOOKED,
    MASK,
    STEP_CAPTURES,
    TEXT,
    TOKENS,
    UNCHANGED,
    UNCHANGED_TOLERANCE,
    step_capture_key,
)
from hookrun.stages.generate.summary import WARNING, mean_logprobs, summary_lines

__all__ = ["GenerateStage"]

log = logging.getLogger("hookrun")


@dataclass(frozen=True)
class _Decoding:
    """What decoding needs beyond the config: the hooks acting at each step, the captures
    recorded at each step (capture path → row shape after the token axis), the end tokens,
    the bytes of a row's text and the token fed to rows that stopped."""

    hooks: HookPlan
    steps_of: dict[str, tuple[int, ...]]
    ends: list[int]
    width: int
    pad: int  # any token in the vocabulary will do: its outputs are never read

    @property
    def acting(self) -> list[str]:
        """The hooks that change values while decoding (the others only record)."""
        return list(dict.fromkeys(h.name for h in self.hooks.hooks if h.action.changes))


class GeneratePlan(Plan):
    def __init__(self, config: GenerateConfig, decoding: _Decoding) -> None:
        self.config, self.decoding = config, decoding

    @property
    def rescoring(self) -> bool:
        """Whether fluency takes a pass of the plain model: only under hooks that change
        values (without them it is the run's own log probabilities)."""
        return self.config.fluency and bool(self.decoding.acting)

    def stored(self) -> dict[str, Stored]:
        steps = (self.config.max_new_tokens,)
        out = {TOKENS: Stored(steps), MASK: Stored(steps), LOGPROBS: Stored(steps)}
        if self.config.fluency:
            out[LOGPROBS_UNHOOKED] = Stored(steps)
        if self.rescoring:
            said = {"hooks": self.decoding.acting, "tolerance": UNCHANGED_TOLERANCE}
            out[UNCHANGED] = Stored((), said)
        out[TEXT] = Stored((), {"encoding": "utf-8"})
        for key, rest in self.decoding.steps_of.items():
            out[step_capture_key(key)] = Stored((*steps, *rest))
        return out

    def describe(self, itemsize: int) -> str:
        steps = self.config.max_new_tokens
        sizes = {TOKENS: 4 * steps, MASK: steps, LOGPROBS: 4 * steps}
        if self.config.fluency:
            sizes[LOGPROBS_UNHOOKED] = 4 * steps
        if self.rescoring:
            sizes[UNCHANGED] = 1
        sizes[TEXT] = self.decoding.width
        for key, rest in self.decoding.steps_of.items():
            sizes[step_capture_key(key)] = itemsize * steps * math.prod(rest)
        lines = [f"/{GENERATION}: {len(sizes)} dataset(s), {steps} steps"]
        lines += [f"    {size:>8} B/sample  /{key}" for key, size in sizes.items()]
        return "\n".join(lines)

    def attrs(self) -> dict[str, dict]:
        c = self.config
        said = {"max_new_tokens": c.max_new_tokens, "temperature": c.temperature}
        said |= {"top_k": c.top_k or 0, "top_p": c.top_p or 1.0, "end_tokens": self.decoding.ends}
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

        seen: list[dict[str, torch.Tensor]] = []  # each step's captures (generate.captures)
        started = False

        def before_step() -> None:  # each step is a forward pass of its own: calls from 0
            nonlocal started
            if started:  # the step before's captures, before begin() clears them
                seen.append(_step_records(recorder, self.decoding.steps_of))
            started = True
            recorder.begin(first)
            recorder.rows = batch.index  # stored rows to patch in (the prompt's pass)
            recorder.step = next(steps)  # noise draws anew at each step
            recorder.mask = prompts[1] if recorder.step == 0 else None  # args.positions count here

        sampling = Sampling(c.temperature, c.top_k, c.top_p)
        device = batch.inputs.device
        ends = torch.tensor(self.decoding.ends, dtype=torch.int64, device=device)
        pad, width = self.decoding.pad, self.decoding.width
        generator = work.generator("generate", device) if c.temperature > 0 else None
        fluency: dict[str, Any] = {}
        with ExitStack() as stack, torch.inference_mode():
            stack.enter_context(attach(self.decoding.hooks, work.model, recorder))
            out = decode(
                language, prompts, c.max_new_tokens, sampling, (ends, pad), generator, before_step
            )
            seen.append(_step_records(recorder, self.decoding.steps_of))
            stack.close()  # the hooks off: the plain model scores what the hooked one wrote
            if self.rescoring:
                plain = rescore(language, prompts, out, pad)
                fluency[LOGPROBS_UNHOOKED] = plain.logprobs.cpu()
                fluency[UNCHANGED] = _unchanged(out, plain).cpu()
            elif c.fluency:  # nothing changes values: the plain model is the hooked one
                fluency[LOGPROBS_UNHOOKED] = out.logprobs.cpu()
        tokens, mask = out.tokens.cpu(), out.mask.cpu()
        lasts = prompts[1].sum(1).cpu() - 1
        steps_of = self.decoding.steps_of
        captured = {
            step_capture_key(k): _by_step(seen, k, lasts, mask, rest)
            for k, rest in steps_of.items()
        }
        texts = [
            language.tokenizer.decode(row[keep].tolist(), skip_special_tokens=True)
            for row, keep in zip(tokens, mask, strict=True)
        ]
        return {
            TOKENS: tokens.to(torch.int32),
            MASK: mask,
            LOGPROBS: out.logprobs.cpu(),
            **fluency,
            # UTF-8 of one width for the run (resumed rows and torchrun shards share a dtype).
            TEXT: np.array(
                [_fixed(t, width) for t in texts], dtype=h5py.string_dtype("utf-8", width)
            ),
            **captured,
        }


def _unchanged(hooked: Decoded, plain: Rescored) -> torch.Tensor:
    """(N,) bool: whether the plain model gives each of the row's generated tokens the
    hooked model's log probability (to UNCHANGED_TOLERANCE) and the same most likely token
    at each step (greedy: it writes the same tokens)."""
    same_top = (plain.top == hooked.top) | ~hooked.mask
    close = (plain.logprobs - hooked.logprobs).abs() <= UNCHANGED_TOLERANCE
    return (same_top & (close | ~hooked.mask)).all(dim=1)


def _step_records(recorder: Any, keys: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The step's captures of `keys`, on the host (their copies finished)."""
    for event in recorder.events:
        event.synchronize()
    return {k: recorder.records[k] for k in keys if k in recorder.records}


def _by_step(
    seen: list[dict[str, torch.Tensor]],
    key: str,
    lasts: torch.Tensor,
    mask: torch.Tensor,
    rest: tuple[int, ...],
) -> torch.Tensor:
    """(N, steps, *rest): at each step the row of the position whose output chose the
    step's token — the prompt's last real token at step 0, the one new token after — NaN
    where the row had stopped (and at steps never run: every row had stopped)."""
    rows, steps = mask.shape
    dtype = next((records[key].dtype for records in seen if key in records), torch.float32)
    out = torch.full((rows, steps, *rest), float("nan"), dtype=dtype)
    for step, records in enumerate(seen[:steps]):
        if key not in records:
            continue
        values = records[key]
        out[:, step] = values[torch.arange(rows), lasts] if step == 0 else values[:, 0]
    out[~mask] = float("nan")
    return out


def _fixed(text: str, width: int) -> bytes:
    """`text` as UTF-8 in at most `width` bytes, cut at a character's boundary."""
    return text.encode("utf-8")[:width].decode("utf-8", "ignore").encode("utf-8")


@register_stage
class GenerateStage(Stage):
    name = node = "generate"
    order = 60
    axes = {
        TEXT: "sample",
        UNCHANGED: "sample",
        f"{STEP_CAPTURES}/*": "sample step feature",
        f"{GENERATION}/*": "sample step",
    }

    @classmethod
    def schema(cls) -> Mapping[str, type]:
        return {"generate": GenerateConfig}

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
        # Every token row has the padded width of sample 0's: no prompt is longer.
        tokens = int(setup.sample.shape[-1])
        steps_of, stepped = _step_captures(config, setup, tokens)
        hooks = _generation_hooks(setup.plan, stepped)
        _check_positions(config, language, tokens)
        ends = _end_tokens(language) if config.stop_at_eos else []
        width = _text_width(setup.vocabulary, config.max_new_tokens)
        _check_batch_fits(config, setup, width, steps_of)
        return GeneratePlan(config, _Decoding(hooks, steps_of, ends, width, _pad(language)))

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        lines = summary_lines(f, rows)
        for line in lines:
            if line.startswith(WARNING):
                log.warning("%s", line.replace(WARNING, "generate: ", 1))
        return lines

    @classmethod
    def draw(cls, f: h5py.File, out_dir: Any, rows: int, config: dict) -> list:
        from hookrun.stages.generate.draw import render_generation  # matplotlib: when drawing

        return render_generation(f, out_dir, rows, config)

    @classmethod
    def columns(cls, f: h5py.File, rows: int) -> dict[str, float]:
        if LOGPROBS not in f:
            return {}
        hooked, plain = mean_logprobs(f, rows)
        out = {"generate:logprob": hooked}
        return out if plain is None else out | {"generate:fluency": plain}


def _generation_hooks(plan: HookPlan, stepped: set[str]) -> HookPlan:
    """The run's hooks that act during decoding: those that change values, and with
    generate.captures the captures recorded at each step (the hooks named `stepped`;
    gradient sites and the other captures keep to the run's pass over the prompt). Those
    tied to the prompt's tokens
    (`args.positions`, `patch`) act at the prompt's pass only (plan.acts_at_step).
    Refused: attention-pattern actions."""
    for hook in plan.hooks:
        if hook.site == Site.pattern and hook.action.changes:
            raise HookrunError(
                f"hooks.{hook.name}.at: pattern with generate; valid: capture there (the prompt's "
                "pass), or a module's input or output"
            )
    keep = [h for h in plan.hooks if not h.site.is_grad and (h.action.changes or h.name in stepped)]
    return dataclasses.replace(plan, hooks=keep)


def _per_token(hook: PlannedHook) -> bool:
    """Whether a capture stores its site whole at a module's input or output (not pooled,
    not limited to positions, not a pattern): what a decoding step's one token has too."""
    no_pool = not getattr(hook.action.args, "pool", None)
    at_module = hook.site in (Site.input, Site.output)
    return at_module and hook.action.positions is None and no_pool


def _step_captures(
    config: GenerateConfig, setup: Setup, tokens: int
) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """With generate.captures: each capture path recorded at every step → its row shape
    after the token axis, and the names of their hooks; HookrunError when the run captures
    nothing a step has."""
    if not config.captures:
        return {}, set()
    out, hooks = {}, set()
    for hook, key, leaf in setup.plan.sites(setup.shapes):
        per_token = bool(leaf.shape) and leaf.shape[0] == tokens and leaf.fold == 1
        if hook.action.records and not hook.action.changes and _per_token(hook) and per_token:
            out[key] = tuple(leaf.shape[1:])
            hooks.add(hook.name)
    if not out:
        raise HookrunError(
            "generate.captures: true, but the run captures no module input or output with "
            "a row per token; valid: a capture hook (e.g. at: output of a block, no "
            "positions, no pool), or false"
        )
    return out, hooks


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


def _check_batch_fits(
    config: GenerateConfig, setup: Setup, width: int, steps_of: Mapping[str, tuple[int, ...]]
) -> None:
    """Refuse a `max_new_tokens` whose batch of outputs cannot fit in memory: what one batch
    holds at once whatever the text — its tokens and most likely tokens (int64) and log
    probabilities (float32) per step, its rows of text and its step captures. (The
    key-value cache grows with the steps too, but rows may stop early: it is not counted.)"""
    steps = config.max_new_tokens
    rows = min(setup.spec.batch_size, len(setup.data))
    itemsize = torch.empty((), dtype=setup.store_dtype).element_size()
    per_row = 20 * steps + width + sum(itemsize * steps * math.prod(r) for r in steps_of.values())
    check_fits(
        "generate.max_new_tokens",
        steps,
        rows * per_row,
        f"one batch's generated tokens, log probabilities and text [{rows}, {steps}]",
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


def _text_width(vocabulary: list[str], steps: int) -> int:
    """Bytes of /generation/text: `steps` tokens of the vocabulary's longest text (each id's,
    decoded alone: the run's Setup), with room for a word's leading space a token decoded
    alone loses."""
    return steps * (max((len(t.encode("utf-8")) for t in vocabulary), default=0) + 4)
