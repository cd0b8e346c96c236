"""hookrun from Python: `hookrun.run(...)` and `hookrun.compose(...)`.

Both compose the same conf/ tree the CLI does (Hydra's compose API, no global state left
behind, no chdir, no logging set up), so `hookrun.run(["experiment=guided_bp"])` writes the
same datasets as `python -m hookrun experiment=guided_bp`. A caller's own model or dataset
replaces the config's; the model leaves the run exactly as it came in.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from torch import nn

import hookrun.stages  # noqa: F401  (registers every stage before a config is built)
from hookrun.config.build import RunSpec, build_spec, release_model_keys
from hookrun.config.groups import refuse_null_groups
from hookrun.config.schema import conf_dir, register_configs
from hookrun.config.shorthands import expanded
from hookrun.data.inline import INLINE_FILE, inline_rows, token_tensors, write_rows
from hookrun.errors import HookrunError
from hookrun.models.config import ModelConfig
from hookrun.pipeline.finish import Result
from hookrun.pipeline.prepare import CallerObjects
from hookrun.pipeline.runner import execute
from hookrun.typed import freeze

__all__ = ["conf_dir", "compose", "run"]


def _compose(overrides: Sequence[str] | None) -> tuple[DictConfig, str | None, Path]:
    """The composed config (without its `hydra` node), the experiment and default run dir."""
    if isinstance(overrides, str | bytes) or not all(isinstance(o, str) for o in (overrides or [])):
        raise HookrunError(
            f"overrides: {overrides!r}; valid: a list of strings, e.g. ['experiment=saliency']"
        )
    register_configs()
    overrides = expanded(overrides or [])  # lrp.composite=... is derive.lrp.composite=...
    refuse_null_groups(overrides, conf_dir())
    try:
        with initialize_config_dir(
            config_dir=str(conf_dir()), version_base="1.3", job_name="hookrun"
        ):
            cfg = hydra_compose("config", overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise HookrunError("; ".join(str(err).split("\n"))) from None
    experiment = cfg.hydra.runtime.choices.get("experiment")
    run_dir = Path(str(cfg.hydra.run.dir)).absolute()
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, experiment, run_dir


def compose(overrides: Sequence[str] | None = None) -> RunSpec:
    """The validated, frozen RunSpec `python -m hookrun OVERRIDES` would run, without running.

    Composes the same conf/ tree as the CLI (no global state left behind, no chdir, no
    logging set up) and checks every key the config alone can check.

    Args:
        overrides: Hydra overrides, as on the command line: `["experiment=grad_cam",
            "batch_size=8"]`; None or []: the default experiment.

    Returns:
        The RunSpec: every key typed and frozen (`spec.config`), the free-form nodes
        (model, dataset, hooks, each stage's) parsed.

    Raises:
        HookrunError: `overrides` is not a list of strings; Hydra refused an override (an
            unknown key, an unknown option of a group); or a value is invalid (the message
            names the key, the value and what is valid).

    Example:
        >>> spec = hookrun.compose(["experiment=grad_cam", "batch_size=8"])
        >>> spec.batch_size
        8
    """
    cfg, experiment, _ = _compose(overrides)
    release_model_keys(cfg, overrides or [], caller_model=False)
    return build_spec(cfg, experiment)


def _describe_objects(spec: RunSpec, model: nn.Module | None, dataset: Any) -> RunSpec:
    """The spec, with the config's model / dataset replaced by what the caller handed in.

    So the file's `config` attribute says where the numbers came from.
    """
    tree = OmegaConf.create(spec.config_yaml)
    new_model = spec.model
    if model is not None:
        name = f"{type(model).__module__}.{type(model).__qualname__}"
        new_model = freeze(ModelConfig(source="python", name=name, cam_layer=spec.model.cam_layer))
        tree.model = {"source": "python", "name": name, "cam_layer": spec.model.cam_layer}
    if dataset is not None:
        kind = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
        tree.dataset = {"kind": "python", "type": kind}
    return replace(spec, model=new_model, config_yaml=OmegaConf.to_yaml(tree))


def _dataset_key(override: str) -> bool:
    """Whether an override sets a key of the dataset node (`dataset.pack=false`).

    Not the dataset kind (`dataset=text`).
    """
    return override.lstrip("+~").startswith("dataset.")


def _refuse_text_without_language_model(cfg: DictConfig, model: Any, kind: str) -> None:
    """Strings and prompt dicts are read with a language model's tokenizer."""
    from hookrun.models.adapter import adapt

    language = adapt(model).language is not None if model is not None else None
    if language is None:
        language = cfg.model.get("source") == "hf"
    if not language:
        what = "strings" if kind == "text" else "prompt dicts"
        if type(model).__module__.startswith("transformers."):  # a language model, untokenized
            raise HookrunError(
                f"dataset: a list of {what} is read with a tokenizer, and the "
                f"{type(model).__name__} was given without one; valid: "
                "hookrun.run(..., model=model, tokenizer=its tokenizer), or token ids "
                "({input_ids, attention_mask}: a tokenizer's output)"
            )
        raise HookrunError(
            f"dataset: a list of {what} is a language model's data, and this run's model is "
            "not one; valid: model=hf or model=tiny_lm (from Python a transformers model with "
            "tokenizer=), or a dataset of tensors for this model"
        )


def _language_model(model: nn.Module | None, tokenizer: Any) -> nn.Module:
    """A Hugging Face model and its tokenizer as hookrun's LanguageModel.

    Its kind is read from the model's class (…ForCausalLM, …ForMaskedLM,
    …ForSequenceClassification, else base).
    """
    from hookrun.models.language import LanguageModel

    if model is None:
        raise HookrunError("tokenizer: given without model; valid: model=a transformers model")
    if isinstance(model, LanguageModel):
        raise HookrunError(
            "tokenizer: given with a LanguageModel, which has its own; valid: no tokenizer, "
            "or model=the transformers model inside it"
        )
    if not type(model).__module__.startswith("transformers."):
        raise HookrunError(
            f"tokenizer: given with a {type(model).__name__}, not a transformers model; valid: "
            "model=a transformers model (AutoModelFor...), or no tokenizer"
        )
    name = type(model).__name__
    kinds = {
        "ForCausalLM": "causal_lm",
        "LMHeadModel": "causal_lm",
        "ForMaskedLM": "masked_lm",
        "ForSequenceClassification": "sequence_classification",
    }
    kind = next((k for end, k in kinds.items() if name.endswith(end)), "base")
    return LanguageModel(model, tokenizer, kind)


def run(
    overrides: Sequence[str] | None = None,
    *,
    model: nn.Module | None = None,
    dataset: Any = None,
    run_dir: str | Path | None = None,
    tokenizer: Any = None,
) -> Result:
    """Run an experiment as `python -m hookrun OVERRIDES` would.

    The same datasets as the CLI's run are written; a caller's model leaves the run exactly
    as it came in (hooks, flags, devices, weights).

    Args:
        overrides: Hydra overrides, as on the command line: `["experiment=guided_bp"]`;
            None or []: the default experiment.
        model: Any nn.Module to run instead of the config's (the selectors apply to it); a
            Hugging Face model with its `tokenizer` runs as model=hf would.
        dataset: Instead of the config's: a map-style dataset or iterable of tensors or
            (tensor, label) pairs, a list of strings (documents, as dataset=text) or of
            prompt dicts (as dataset=prompts), or token ids made already
            ({input_ids, attention_mask}: a tokenizer's output).
        run_dir: Where captures.h5 and the pictures go; default: the CLI's
            outputs/<date>/<time>/, relative to the current directory.
        tokenizer: The tokenizer of a transformers `model`.

    Returns:
        The Result: the file's path (`result.open()` reads it), the run folder, the rows,
        the plan and the summary.

    Raises:
        HookrunError: Bad input, named by its key: an override, a value, a `model` that is
            not an nn.Module, a `tokenizer` without a transformers model, text data for a
            model that is not a language model, a bad `run_dir`. Its subclass RunFault: a
            fault of the surroundings (a full disk) after some rows were written;
            `resume=true` continues the file.
        Interrupted: SIGTERM or SIGINT stopped the run after the batch in flight (not an
            Exception, as KeyboardInterrupt is not).

    Example:
        >>> result = hookrun.run(["experiment=grad_cam", "limit=4"], run_dir="out")
        >>> with result.open() as res:
        ...     res.layers
    """
    if model is not None and not isinstance(model, nn.Module):
        raise HookrunError(f"model: a {type(model).__name__} is not a torch.nn.Module")
    if tokenizer is not None:
        model = _language_model(model, tokenizer)
    if run_dir is not None and not isinstance(run_dir, str | os.PathLike):
        raise HookrunError(f"run_dir: {run_dir!r}; valid: a folder path (str or Path)")
    dataset = token_tensors(dataset) or dataset  # token ids made already: rows in memory
    inline = inline_rows(dataset)
    if inline is not None:  # written into the run dir, read by the kind from there
        kind, rows = inline
        # The kind the config names without the caller's dataset.* keys, which are the
        # rows' kind's: composed against another kind's node they could not be set.
        cfg, _, default_dir = _compose([o for o in overrides or [] if not _dataset_key(o)])
        _refuse_text_without_language_model(cfg, model, kind)
        folder = Path(run_dir).expanduser().absolute() if run_dir is not None else default_dir
        run_dir, dataset = folder, None
        write_rows(rows, folder / INLINE_FILE)
        chosen = [] if cfg.dataset.get("kind") == kind else [f"dataset={kind}"]
        path = str(folder / INLINE_FILE).replace("'", "\\'")
        overrides = [*(overrides or []), *chosen, f"dataset.path='{path}'"]
    cfg, experiment, default_dir = _compose(overrides)
    # A caller's model is not the preset's: the preset's CAM layer falls back to auto.
    release_model_keys(cfg, overrides or [], caller_model=model is not None)
    spec = build_spec(cfg, experiment)
    if model is not None or dataset is not None:
        spec = _describe_objects(spec, model, dataset)
    folder = Path(run_dir).expanduser().absolute() if run_dir is not None else default_dir
    return execute(spec, folder, CallerObjects(model, dataset))
