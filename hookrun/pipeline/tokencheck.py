"""What a run on token data (a language model) may and may not ask for, checked before any work.

The model's input is token ids, so nothing differentiates it: what needs the input's
gradient (an input gradient hook; a stage whose work does, Stage.needs_input_gradient) is
refused with where a gradient does exist (the embeddings' output). `args.positions` needs
token data and a (tokens, ...) site; listed positions must lie inside every row's real
tokens. `target.kind` next_token reads text rows'
next token, answer a prompt's answer, logit_diff its answer and counterfactual answer.

`check_token_model` runs before the model's first forward pass (the probe, which would fail
first on what it refuses): the stages' gradient refusals, and rows longer than the model's
learned positions (named by the key that makes them long). `check_token_run` runs after the
probe: targets and hook positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data import Dataset

from hookrun.config.build import RunSpec
from hookrun.data.repeated import KIND
from hookrun.errors import HookrunError
from hookrun.models.adapter import adapt
from hookrun.runtime.plan import CallShapes, HookPlan
from hookrun.runtime.positions import check_lengths, check_positions
from hookrun.runtime.selectors import INPUT_LAYER
from hookrun.runtime.sites import Site
from hookrun.runtime.targets import TargetKind
from hookrun.stage import stages

__all__ = ["check_token_model", "check_token_run"]

_GRADIENT_HINT = (
    "a language model's input is token ids, which have no gradient; valid: a gradient site "
    "on the embeddings' output, e.g. select: {name: transformer.wte}, at: grad_output"
)
# The data kind whose rows carry each language-model target's token.
_TARGET_DATA = {
    TargetKind.next_token: "text",
    TargetKind.answer: "prompts",
    TargetKind.logit_diff: "prompts",
}


def _shortest(data: Dataset, tokens: Any) -> int:
    """The fewest real tokens of any row of the run."""
    if not getattr(tokens, "padded", False):
        return int(data[0][0].shape[-1])
    return min(int(data[i][0][1].sum()) for i in range(len(data)))  # type: ignore[arg-type]


def _check_targets(spec: RunSpec, tokens: Any, rows: int) -> None:
    """target.kind against the data: its kind, and for logit_diff every one of the run's
    first `rows` rows (dataset.limit) having both answers."""
    kind = spec.target.kind
    need = _TARGET_DATA.get(kind)
    if need is None:
        return
    if tokens is None or tokens.kind != need:
        have = "data without tokens" if tokens is None else f"dataset={spec.dataset.kind}"
        if tokens is not None and tokens.kind != spec.dataset.kind:  # hf_disk: its `rows`
            have += f" with {tokens.kind} rows"
        raise HookrunError(
            f"target.kind: {kind.value} reads the token each row of dataset={need} names (or "
            f"of dataset=hf_disk with rows: {need}), but "
            f"this run reads {have}; valid here: "
            + ", ".join(k.value for k in TargetKind if k not in _TARGET_DATA)
        )
    if kind == TargetKind.logit_diff:
        for row in range(rows):
            missing = tokens.missing(row, ("answer", "counterfactual_answer"))
            if missing:
                name, line = tokens.sources[row]
                raise HookrunError(
                    f"target.kind: logit_diff needs each row's answer and counterfactual_answer;"
                    f" dataset.path: {name}:{line} has no '{missing}'; valid: rows {{prompt, "
                    "answer, counterfactual_answer}, or target.kind=answer"
                )


def _too_long(spec: RunSpec, tokens: Any, width: int, most: int) -> tuple[str, str]:
    """(what makes the rows `width` tokens long, as key and value; what it may be with a
    model of `most` positions) for the run's token data."""
    cfg = spec.dataset
    if tokens.kind == KIND:
        bos = int(bool(cfg.prepend_bos))
        return (
            f"dataset.length: {cfg.length} × dataset.repeats: {cfg.repeats}"
            f"{' + a bos' if bos else ''} = {width} tokens a row",
            f"length × repeats{' + 1' if bos else ''} up to {most}",
        )
    if tokens.kind == "prompts" and getattr(tokens, "lengths", None) is not None:
        name, line = tokens.sources[int(tokens.lengths.argmax())]
        return (
            f"dataset.path: the prompt at {name}:{line} has {width} tokens",
            f"prompts of up to {most} tokens (dataset.context={most} refuses longer ones)",
        )
    return f"dataset.context: {getattr(cfg, 'context', width)}", f"a context from 2 to {most}"


def _check_positions(spec: RunSpec, model: Any, data: Dataset, tokens: Any) -> None:
    """Rows longer than the model's learned positions (GPT-2's n_positions, BERT's
    max_position_embeddings) are refused, naming the key that makes them that long; a model
    without a hard limit (rotary positions) passes."""
    limit = adapt(model).max_positions()
    width = int(data[0][0].shape[-1])
    if limit is None or width <= limit[0]:
        return
    most, key = limit
    given, valid = _too_long(spec, tokens, width, most)
    if most < 2:  # no row fits: the model is what to change
        valid = f"a model with 2 positions or more ({key})"
    raise HookrunError(f"{given}, past the model's {most} positions ({key}); valid: {valid}")


def check_reads_tokens(model: Any, tokens: Any) -> None:
    """Token rows go to a language model (hookrun's LanguageModel around a transformers
    one); any other model is refused before anything reads its config."""
    if tokens is not None and adapt(model).language is None:
        raise HookrunError(
            f"dataset: token rows are a language model's input, and this run's model (a "
            f"{type(model).__name__}) is not one; valid: a transformers model with tokenizer= "
            "(hookrun.run), model=hf or model=tiny_lm, or data this model takes (tensors, "
            "images)"
        )


def check_token_model(spec: RunSpec, model: Any, data: Dataset, tokens: Any) -> None:
    """What can be refused on token data once the model is built, before its first forward
    pass (the probe): a stage whose work needs the input's gradient, and rows longer than
    the model's positions."""
    if tokens is None:
        return
    for stage in stages():
        config = spec.stage(stage.node) if stage.node else None
        key = stage.needs_input_gradient(config) if config is not None else None
        if key:
            raise HookrunError(f"{key}: {_GRADIENT_HINT}")
    _check_positions(spec, model, data, tokens)


def check_token_run(
    spec: RunSpec,
    plan: HookPlan,
    shapes: Mapping[str, list[CallShapes]],
    data: Dataset,
    tokens: Any,
) -> None:
    """Refuse what a run on token data (`tokens`: the token dataset, or None for other data)
    cannot do, each in one line naming the key."""
    _check_targets(spec, tokens, len(data))
    if tokens is None:
        for hook in plan.hooks:
            if hook.action.positions is not None:
                raise HookrunError(
                    f"hooks.{hook.name}.args.positions: {hook.action.positions.describe()}, but "
                    f"dataset={spec.dataset.kind} has no tokens; valid: positions only with "
                    "token data (dataset=text, prompts, hf_disk, repeated_tokens)"
                )
        return
    length, shortest = int(data[0][0].shape[-1]), None
    for hook, _, leaf in plan.sites(shapes):
        key = f"hooks.{hook.name}"
        if INPUT_LAYER in hook.layers and hook.site == Site.grad_output:
            raise HookrunError(f"{key}: the input's gradient: {_GRADIENT_HINT}")
        positions = hook.action.positions
        if positions is None:
            continue
        check_positions(positions, leaf.shape, length, f"{key}.args.positions")
        if positions.items:
            shortest = _shortest(data, tokens) if shortest is None else shortest
            check_lengths(positions, shortest, f"{key}.args.positions")
