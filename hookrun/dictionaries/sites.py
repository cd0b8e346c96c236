"""TransformerLens hook names as the Hugging Face module and site carrying the same tensor.

The names are what SAELens's and circuit-tracer's configs say a dictionary reads and writes.

The translation goes through the architecture table (hookrun/models/architectures.py), the
one place that knows where each family keeps its parts, so a family added there is
understood here too. Each name's tensor, as TransformerLens defines it:

- `blocks.L.hook_resid_pre` / `hook_resid_post`: block L's input / output;
- `blocks.L.hook_resid_mid`, `blocks.L.hook_mlp_in`: the residual after the attention is
  added, which is what block L's MLP norm takes in (not in a parallel-residual block: there
  is none; TransformerLens's hook_mlp_in is taken before ln2);
- `blocks.L.mlp.hook_in`: the MLP's input (the norm's output, its weight and bias applied);
- `blocks.L.ln2.hook_normalized`: the MLP norm's output *before* its weight and bias
  (TransformerLens applies them after this hook): the MLP's input with the norm's affine
  undone, (input − bias) / weight (`norm_affine` names the norm);
- `blocks.L.hook_mlp_out`, `blocks.L.mlp.hook_out`: the MLP's output, added to the residual;
- `blocks.L.attn.hook_z`: the heads' outputs side by side, the input of the attention's
  output projection (TransformerLens's (T, H, d_head) flattened to (T, H * d_head), as
  SAELens's hook_z SAEs flatten it).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from hookrun.errors import HookrunError
from hookrun.models.architectures import Architecture, architecture_of, families

__all__ = ["HOOK_FORMS", "module_site", "hook_name_of", "is_mlp", "norm_affine"]

# Each form: the pattern, and where its tensor is (the module pattern from the table, the
# site), or None where the table cannot say for the family.
_Where = Callable[[Architecture], tuple[str | None, str]]


def _mlp(arch: Architecture, site: str) -> tuple[str | None, str]:
    # The MLP's own input and output are the residual stream's only where its norm is the
    # one before it and nothing norms its output (the table knows the norm: mlp_norm;
    # Gemma 2 norms the MLP's output again, BERT's "mlp" is its intermediate layer).
    return (arch.mlp if arch.mlp_norm else None), site


def _resid_mid(arch: Architecture) -> tuple[str | None, str]:
    return (None if arch.parallel else arch.mlp_norm), "input"


_FORMS: tuple[tuple[str, _Where], ...] = (
    ("hook_resid_pre", lambda a: (f"{a.blocks}.{{}}", "input")),
    ("hook_resid_post", lambda a: (f"{a.blocks}.{{}}", "output")),
    ("hook_resid_mid", _resid_mid),
    ("ln2.hook_normalized", lambda a: _mlp(a, "input")),
    ("hook_mlp_in", _resid_mid),
    ("mlp.hook_in", lambda a: _mlp(a, "input")),
    ("hook_mlp_out", lambda a: _mlp(a, "output")),
    ("mlp.hook_out", lambda a: _mlp(a, "output")),
    ("attn.hook_z", lambda a: (a.heads, "input")),
)
HOOK_FORMS = tuple(f"blocks.<L>.{suffix}" for suffix, _ in _FORMS)
_NAME = re.compile(r"blocks\.(\d+)\.(.+)")
# hookrun's own site names (`transformer.h.1:output`): what a trained dictionary's cfg.json
# says where no TransformerLens name carries its tensor.
_NATIVE = re.compile(r"(?P<module>[^:\s]+):(?P<at>input|output)")


def module_site(hook_name: str, model: nn.Module, key: str) -> tuple[str, str]:
    """The module (by `model.named_modules()` name) and site carrying a TransformerLens hook.

    Args:
        hook_name: e.g. `blocks.3.hook_resid_pre` (HOOK_FORMS are the forms understood).
        model: a Hugging Face model of a family in the architecture table (or hookrun's
            LanguageModel around one: the module names are the same).
        key: the config key that gave the name, for messages.

    Returns:
        (module name, site): site "input" (the module's first positional input) or
        "output" (its output), e.g. ("transformer.h.3", "input") on GPT-2.

    Raises:
        HookrunError: the name is not one of HOOK_FORMS, the model's family is not in the
            table or the table cannot place the name for it, or the model has no layer L.
    """
    native = _NATIVE.fullmatch(hook_name)
    if native is not None:  # hookrun's own name of a site, as a training job saves it
        if native["module"] not in dict(model.named_modules()):
            raise HookrunError(
                f"{key}: {hook_name!r}: the model has no module {native['module']!r}; valid: a "
                "module of model.named_modules()"
            )
        return native["module"], native["at"]
    arch = architecture_of(model)
    if arch is None:
        raise HookrunError(
            f"{key}: {hook_name!r} needs the model's family in the architecture table; "
            f"valid families: {', '.join(families())}"
        )
    match = _NAME.fullmatch(hook_name)
    where = dict(_FORMS).get(match.group(2)) if match else None
    if match is None or where is None:
        raise HookrunError(f"{key}: {hook_name!r}; valid: {', '.join(HOOK_FORMS)}")
    layer = int(match.group(1))
    modules = dict(model.named_modules())
    blocks = modules.get(arch.blocks)
    n_layers = len(blocks) if isinstance(blocks, nn.ModuleList) else 0
    if layer >= n_layers:
        raise HookrunError(
            f"{key}: {hook_name!r}: the model has no layer {layer}; valid: blocks.0 to "
            f"blocks.{n_layers - 1}"
        )
    pattern, site = where(arch)
    if pattern is None:
        placeable = [f for f, (s, w) in zip(HOOK_FORMS, _FORMS, strict=True) if w(arch)[0]]
        raise HookrunError(
            f"{key}: {hook_name!r}: the architecture table does not place it for "
            f"{arch.family}; valid there: {', '.join(placeable)}"
        )
    name = pattern.format(layer)
    if name not in modules:
        raise HookrunError(
            f"{key}: {hook_name!r} is {name!r} for {arch.family}, which this model lacks; "
            "valid: a model the architecture table describes"
        )
    return name, site


# The forms whose tensor is a norm's output before its weight and bias: the module site
# carries it with them applied.
_BEFORE_AFFINE = {"ln2.hook_normalized": lambda a: a.mlp_norm}


def hook_name_of(module: str, site: str, model: nn.Module) -> str:
    """The name a dictionary trained at `module`'s `site` is saved under.

    cfg.json's metadata.hook_name: the TransformerLens hook name carrying the same tensor
    (the residual stream's first), else hookrun's own `module:site`.

    Args:
        module: a name from `model.named_modules()`.
        site: "input" or "output".
        model: the model the module is in.

    Returns:
        e.g. `blocks.1.hook_resid_post` for GPT-2's `transformer.h.1` output;
        `transformer.h.0.attn.c_attn:output` where no hook name carries it.
    """
    arch = architecture_of(model)
    blocks = dict(model.named_modules()).get(arch.blocks) if arch else None
    if arch is not None and isinstance(blocks, nn.ModuleList):
        for layer in range(len(blocks)):
            for form, where in _FORMS:
                if form in _BEFORE_AFFINE:
                    continue  # its tensor lacks the norm's affine: not the module's
                pattern, at = where(arch)
                if pattern is not None and (pattern.format(layer), at) == (module, site):
                    return f"blocks.{layer}.{form}"
    return f"{module}:{site}"


def norm_affine(hook_name: str | None, model: nn.Module) -> str | None:
    """The norm module whose weight and bias a hook's tensor lacks.

    Its module site carries them applied (`ln2.hook_normalized`: block L's MLP norm).

    Args:
        hook_name: a TransformerLens hook name (None: none).
        model: the model `module_site` placed it on.

    Returns:
        The norm's module name, or None.
    """
    match = _NAME.fullmatch(hook_name or "")
    arch = architecture_of(model)
    if match is None or arch is None or match.group(2) not in _BEFORE_AFFINE:
        return None
    pattern = _BEFORE_AFFINE[match.group(2)](arch)
    return None if pattern is None else pattern.format(int(match.group(1)))


def is_mlp(module_name: str, model: nn.Module) -> bool:
    """Whether `module_name` is a block's MLP, per the architecture table.

    Args:
        module_name: a name from `model.named_modules()`.
        model: the model it names a module of.

    Returns:
        True for the table's MLP of some layer (`transformer.h.2.mlp` on GPT-2); False
        otherwise, and for a family the table does not know.
    """
    arch = architecture_of(model)
    if arch is None:
        return False
    pattern = re.escape(arch.mlp).replace(re.escape("{}"), r"\d+")
    return re.fullmatch(pattern, module_name) is not None
