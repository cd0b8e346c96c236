"""The `generate:` config node (experiment=generate), typed and checked before any work;
errors name `generate.<key>`. An empty node turns generation off."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hookrun.errors import HookrunError
from hookrun.typed import Frozen, check_range, parse_typed

__all__ = ["GenerateConfig", "parse_generate"]


@dataclass
class GenerateConfig(Frozen):
    max_new_tokens: int = 20
    """Tokens generated after each row's prompt (its tokens up to the read position)."""
    temperature: float = 0.0
    """0: greedy (the most likely token); above 0: sampling from the distribution at this
    temperature, seeded by the run's seed and the batch (a resume draws the same tokens).
    """
    top_k: int | None = None
    """Sampling only: the k most likely tokens (null: all), then the smallest set whose probability
    reaches top_p (null or 1: all).
    """
    top_p: float | None = None
    """Sampling only: after top_k, the smallest set of tokens whose probability reaches top_p (null
    or 1: all).
    """
    stop_at_eos: bool = True
    """Stop a row at the model's end token (its config's eos_token_id), which is kept."""
    fluency: bool = True
    """true: each generated token's log probability under the model without the run's hooks too
    (/generation/logprobs_unhooked: how fluent the hooked text is to the plain model). Under
    hooks that change values that is one more pass over each prompt and its text; without them
    it is the run's own log probabilities, stored as they are. false: not stored (nor
    /generation/unchanged).
    """
    captures: bool = False
    """true: each capture of the run (a module's input or output, one row per token) also stores
    what its site saw at every step, at the position whose output chose the step's token:
    /generation/captures/<module>/<site> (N, steps, ...).
    """


def parse_generate(raw: Mapping[str, Any] | None) -> GenerateConfig | None:
    """The read-only GenerateConfig of a `generate:` node (None when it is empty)."""
    if not raw:
        return None
    for key in ("stop_at_eos", "fluency", "captures"):  # OmegaConf's words name no choices
        if key in raw and not isinstance(raw[key], bool):
            said = "null" if raw[key] is None else repr(raw[key])
            raise HookrunError(f"generate.{key}: {said}; valid: true, false")
    config = parse_typed(raw, GenerateConfig, "generate")
    check_range("generate.max_new_tokens", config.max_new_tokens, 1)
    if not config.temperature >= 0:  # NaN too
        raise HookrunError(
            f"generate.temperature: {config.temperature}; valid: 0 (greedy) or above (sampling)"
        )
    check_range("generate.top_k", config.top_k, 1, allow_none=True)
    if config.top_p is not None and not 0 < config.top_p <= 1:
        raise HookrunError(f"generate.top_p: {config.top_p}; valid: above 0 and at most 1, or null")
    sampling_keys = [k for k in ("top_k", "top_p") if getattr(config, k) is not None]
    if config.temperature == 0 and sampling_keys:
        raise HookrunError(
            f"generate.{sampling_keys[0]}: {getattr(config, sampling_keys[0])} with temperature 0 "
            "(greedy), which draws nothing; valid: a temperature above 0 to sample, or null"
        )
    return config
