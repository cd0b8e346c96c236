"""The dictionary scores stage (`sae_scores:`, e.g. `sae_scores=default`): for every SAE or
transcoder a hook splices in (`action: sae | transcoder`), how well it stands in for its site
over the run's tokens — L0, explained variance, MSE, cosine similarity, CE loss recovered, the
KL score, dead and dense latents (scores.py says how each is defined).

Per batch the stage runs passes of its own with the run's hooks aside: the model as it is
(its logits, each site's activations), and for each dictionary on a causal language model
the site replaced by the reconstruction and the site zeroed. Each row's sums are stored
(`/sae/<module>/<site>/score_rows`, `…/activation_sums`, float64), and once every row is in,
the run's scores (`/sae/<module>/<site>/scores`, a whole-run dataset with the attribute
`fields`): they add up the same over a resume or a torchrun join. Dead and dense latents
come from the latents the run recorded (`args.record: [latents]`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.io.encoding import read_floats
from hookrun.models.adapter import adapt
from hookrun.runtime.handles import ModuleHook, hooked
from hookrun.runtime.sites import Site
from hookrun.runtime.splice import Splice
from hookrun.stage import ParseContext, Plan, Setup, Stage, Stored, WholeRun, Work, register_stage
from hookrun.stages.sae.keys import (
    FIELDS_ATTR,
    ROW_FIELDS,
    SCORE_FIELDS,
    rows_key,
    scores_key,
    sums_key,
)
from hookrun.stages.sae.ranking import write_sae_ranking
from hookrun.stages.sae.scores import activation_rows, fired, language_rows, whole_run_scores
from hookrun.typed import Frozen, parse_typed

__all__ = ["SaeScoresStage", "SaeScoresConfig"]

layout.whole_run(scores_key(layout.capture_key("*", "*")))  # one row per dictionary for the run
# The attributes a dictionary's scores carry beside `fields`.
HOOK_ATTR, DICTIONARY_ATTR, DENSE_ATTR, SPECIAL_ATTR = "hook", "dictionary", "dense", "special"
SPECIAL = ("exclude", "keep")


@dataclass
class SaeScoresConfig(Frozen):
    """The `sae_scores:` node."""

    ce: bool | None = None
    """CE loss recovered and the KL score: two passes more per dictionary and batch, on a causal
    language model; null: on for one, off otherwise."""
    dense: float = 0.1
    """A latent firing on more than this fraction of the run's tokens counts as dense."""
    special: str = "exclude"
    """exclude: the tokenizer's special tokens (BOS, EOS, PAD, SEP) are left out of every score
    and the reconstruction is not spliced at them, as SAELens's evals do by default
    (exclude_special_tokens); keep: every real (not padded) token counts."""


@dataclass(frozen=True)
class _Scored:
    """One dictionary at one site of the run."""

    hook: str
    site: str  # its capture path (captures/<layer>/<site>)
    layer: str
    at: Site
    action: Splice
    width: int  # the site's last axis (the reconstruction's)
    latents: str | None  # where the run records its latents, or None


class SaeScoresPlan(Plan):
    def __init__(
        self, config: SaeScoresConfig, scored: list[_Scored], ce: bool, special: list[int]
    ):
        self.config, self.scored, self.ce, self.special = config, scored, ce, special

    def stored(self) -> dict[str, Stored]:
        out = {}
        for s in self.scored:
            out[rows_key(s.site)] = Stored(
                (len(ROW_FIELDS),), {FIELDS_ATTR: list(ROW_FIELDS)}, "float64"
            )
            out[sums_key(s.site)] = Stored((2, s.width), {}, "float64")
        return out

    def finishes(self) -> dict[str, WholeRun]:
        return {
            scores_key(s.site): WholeRun(
                (len(SCORE_FIELDS),),
                "float64",
                {
                    FIELDS_ATTR: list(SCORE_FIELDS),
                    HOOK_ATTR: s.hook,
                    DICTIONARY_ATTR: s.action.by_layer[s.layer].name,
                    DENSE_ATTR: float(self.config.dense),
                    SPECIAL_ATTR: list(self.special),
                },
            )
            for s in self.scored
        }

    def finish(self, f: h5py.File) -> dict[str, np.ndarray]:
        rows = layout.read_state(f).completed
        mask = f[layout.SAMPLES_MASK][:rows].astype(bool) if layout.SAMPLES_MASK in f else None
        if self.special and layout.SAMPLES_TOKENS in f:
            tokens = f[layout.SAMPLES_TOKENS][:rows]
            kept = ~np.isin(tokens, self.special)
            mask = kept if mask is None else mask & kept
        out = {}
        for s in self.scored:
            d = s.action.by_layer[s.layer]
            firing = None
            if s.latents is not None and s.latents in f:
                firing = fired(f, s.latents, mask, rows, d.d_sae)
            out[scores_key(s.site)] = whole_run_scores(
                np.asarray(f[rows_key(s.site)][:rows], dtype=np.float64),
                np.asarray(f[sums_key(s.site)][:rows], dtype=np.float64),
                firing,
                self.config.dense,
            )
        return out

    def batch(self, work: Work) -> dict[str, Any]:
        batch = work.on_device
        model = work.model
        modules = dict(model.named_modules())
        seen: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

        def keep(s: _Scored):
            def at_output(module, args, output):
                first = output[0] if isinstance(output, tuple) else output
                seen[s.site] = (first, args[0] if args else None)

            def at_input(module, args):
                seen[s.site] = (args[0], None)

            before = s.at == Site.input
            return ModuleHook(modules[s.layer], at_input if before else at_output, before=before)

        with torch.inference_mode():
            with hooked([keep(s) for s in self.scored]):
                clean = self._logits(work)
            out: dict[str, Any] = {}
            for s in self.scored:
                x, given = seen[s.site]
                r = s.action.read(s.site, x, given)
                kept = self._kept(batch, x)
                rows, sums = activation_rows(r.target, r.latents, r.rebuilt, kept)
                if self.ce:
                    placed = r.to_site(r.rebuilt)
                    if self.special and x.dim() == 3:  # SAELens splices at kept tokens only
                        placed = torch.where(kept.to(x.device)[..., None], placed, x)
                    spliced = self._logits(work, self._replace(s, modules, placed))
                    zeroed = self._logits(work, self._replace(s, modules, torch.zeros_like(x)))
                    rows |= language_rows(
                        clean, spliced, zeroed, batch.tokens, kept, self.config.special
                    )
                table = torch.stack(
                    [rows.get(name, torch.zeros_like(rows["tokens"])) for name in ROW_FIELDS], 1
                )
                out[rows_key(s.site)] = table.cpu()
                out[sums_key(s.site)] = sums.cpu()
        return out

    def _kept(self, batch: Any, x: torch.Tensor) -> torch.Tensor:
        """The tokens every score counts: real (not padded), and not special where the
        config leaves special tokens out; (N, 1) for a site of one vector per row."""
        if x.dim() != 3:
            return _all(x)
        kept = batch.mask.bool() if batch.mask is not None else _all(x).to(x.device)
        if self.special and batch.tokens is not None:
            special = torch.tensor(self.special, device=batch.tokens.device)
            kept = kept & ~torch.isin(batch.tokens, special)
        return kept

    def _replace(self, s: _Scored, modules: Mapping[str, Any], value: torch.Tensor) -> ModuleHook:
        """The site's tensor replaced by `value` (the batch's reconstruction, or zeros)."""
        if s.at == Site.input:
            return ModuleHook(modules[s.layer], lambda m, args: (value, *args[1:]), before=True)

        def at_output(module, args, output):
            if isinstance(output, tuple):
                return (value, *output[1:])
            return value

        return ModuleHook(modules[s.layer], at_output)

    def _logits(self, work: Work, change: ModuleHook | None = None) -> torch.Tensor | None:
        """The model's logits over the batch (N, T, vocab), with `change` hooked; None where
        the model is not a language model (no CE then)."""
        batch = work.on_device
        language = adapt(work.model).language
        with hooked([change] if change is not None else []):
            if language is None:
                return work.model(batch.inputs)
            return language(
                input_ids=batch.tokens, attention_mask=batch.mask, use_cache=False
            ).logits


def _all(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(x.shape[:2] if x.dim() == 3 else (x.shape[0], 1), dtype=torch.bool)


@register_stage
class SaeScoresStage(Stage):
    name = node = "sae_scores"
    order = 57  # after metrics
    axes = {
        f"{layout.SAE}/*/score_rows": "sample score_field",
        f"{layout.SAE}/*/activation_sums": "sample moment feature",
        f"{layout.SAE}/*/scores": "score",
    }

    @classmethod
    def schema(cls) -> Mapping[str, type]:
        return {"sae_scores": SaeScoresConfig}

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> Any:
        if not raw:
            return None
        config = parse_typed(raw, SaeScoresConfig, "sae_scores")
        if config.special not in SPECIAL:
            raise HookrunError(
                f"sae_scores.special: {config.special!r}; valid: {', '.join(SPECIAL)}"
            )
        if not 0 < config.dense <= 1:
            raise HookrunError(
                f"sae_scores.dense: {config.dense}; valid: a fraction of the tokens, 0 < dense <= 1"
            )
        return config

    @classmethod
    def plan(cls, config: SaeScoresConfig, setup: Setup) -> Plan:
        scored = []
        for hook, key, leaf, outputs in _splice_sites(setup):
            latents = layout.splice_key(key, "latents")
            scored.append(
                _Scored(
                    hook.name,
                    key,
                    layout.layer_of(key),
                    hook.site,
                    hook.action,
                    int(leaf.shape[-1]),
                    latents if latents in outputs else None,
                )
            )
        if not scored:
            raise HookrunError(
                "sae_scores: no hook splices a dictionary (action: sae or transcoder) into "
                "the model; valid: such a hook, or sae_scores=null"
            )
        language = adapt(setup.model).language
        causal = language is not None and setup.tokens is not None
        ce = causal if config.ce is None else config.ce
        if ce:
            setup.causal_language("sae_scores.ce")
        return SaeScoresPlan(config, scored, ce, _special_ids(config, setup))

    @classmethod
    def rank(cls, sweep_dir: Path, jobs: list[dict[str, Any]]) -> list[Path]:
        return write_sae_ranking(sweep_dir, jobs)

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        lines = []
        for site, score in _scores(f).items():
            said = ", ".join(
                f"{name} {score[name]:.4g}"
                for name in ("l0", "explained_variance", "ce_loss_score", "kl_div_score", "dead")
                if np.isfinite(score[name])
            )
            lines.append(f"sae_scores: {site}: {said}")
        return lines

    @classmethod
    def columns(cls, f: h5py.File, rows: int) -> dict[str, float]:
        return {
            f"sae:{site}:{name}": float(value)
            for site, score in _scores(f).items()
            for name, value in score.items()
            if np.isfinite(value)
        }

    @classmethod
    def draw(cls, f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
        from hookrun.stages.sae.draw import render_scores  # matplotlib: when drawing

        return render_scores(_scores(f), out_dir)


def _special_ids(config: SaeScoresConfig, setup: Setup) -> list[int]:
    """The token ids left out (special: exclude): the tokenizer's BOS, EOS, PAD, SEP and
    decoder-start ids, as SAELens's get_special_token_ids takes them."""
    tokenizer = adapt(setup.model).tokenizer
    if config.special != "exclude" or setup.tokens is None or tokenizer is None:
        return []
    names = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id")
    found = {getattr(tokenizer, n, None) for n in (*names, "decoder_start_token_id")}
    return sorted(int(i) for i in found if i is not None)


def _splice_sites(setup: Setup):
    """(hook, site path, leaf, its outputs) of every site a dictionary is spliced into."""
    found = {key: outputs for _, key, _, outputs in setup.plan.site_outputs(setup.shapes)}
    for hook, key, leaf in setup.plan.sites(setup.shapes):
        if isinstance(hook.action, Splice):
            yield hook, key, leaf, found.get(key, {})


def _scores(f: h5py.File) -> dict[str, dict[str, float]]:
    """Each written dictionary's scores, by its site (`<module>/<site>`)."""
    out = {}
    group = f.get(layout.SAE)
    if group is None:
        return out

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and name.endswith("/scores"):
            fields = layout.attr(obj, FIELDS_ATTR)
            if layout.is_pending(obj) or fields is None:
                return
            fields = [str(x) for x in fields]
            values = read_floats(obj)
            out[name.removesuffix("/scores")] = dict(zip(fields, map(float, values), strict=True))

    group.visititems(visit)
    return out
