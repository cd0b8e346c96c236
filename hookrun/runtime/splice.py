"""The `sae` and `transcoder` actions: a learned dictionary spliced into its site.

    hooks:
      sae: {select: {name: transformer.h.1}, at: output, action: sae,
            args: {path: DIR, error_term: true, record: [latents],
                   edit: {latents: [12, 40], op: zero}}}

The site's tensor x becomes decode(edit(encode(x))) + error, the error x − decode(encode(x))
held fixed (computed outside the graph, as SAELens's `use_error_term` does): without an
edit the model's outputs are unchanged to float rounding, and gradients flow through the
dictionary's encoder and decoder (what attribution to its latents needs). With
`error_term: false` the site is the edited reconstruction. A transcoder reads its MLP's
input and writes in place of the MLP's output (the hook is at the MLP's `output`).

Each action records what `record` names, at paths of their own beside the site
(io/layout.py `splice_key`): `latents` (…, d_sae), stored sparse (io/sparse.py: only the
non-zeros, with their indices), `reconstruction` and `error` (…, d_out), dense. The latents
recorded are the dictionary's own (before the edit). `args.positions` limits the edit (and
the splice) to those positions; the records cover every position. `args.dtype` is the float
the dictionary computes in and its records are stored in (null: the model's, and sink.dtype).

Where the hook selects no module, the dictionaries place themselves: each one's
`metadata.hook_name` (a TransformerLens name) translated to the model's module through the
architecture table (hookrun/dictionaries/sites.py); a folder of several, one per hook.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from hookrun.dictionaries.dictionary import Dictionary
from hookrun.dictionaries.load import load_dictionaries
from hookrun.dictionaries.sites import is_mlp, module_site, norm_affine
from hookrun.errors import HookrunError
from hookrun.io.layout import layer_of, splice_key
from hookrun.runtime.actions import ACTIONS, Action, Output, SiteContext
from hookrun.runtime.sites import Site
from hookrun.typed import check_choices, parse_typed

__all__ = [
    "SpliceArgs",
    "EditArgs",
    "Splice",
    "Transcoder",
    "Reading",
    "RECORDS",
    "OPS",
    "parse_edit",
    "edited",
]

RECORDS = ("latents", "reconstruction", "error", "attribution")
OPS = ("zero", "scale", "clamp", "set")


@dataclass
class EditArgs:
    """`args.edit` of a splice: what happens to some latents before they are decoded."""

    latents: Any = None
    """The latent indices edited (a list of integers, each below d_sae)."""
    op: str = "zero"
    """zero | scale (times `value`) | clamp (at most `value`) | set (to `value`)."""
    value: float | None = None
    """The number `scale`, `clamp` and `set` use."""


@dataclass
class SpliceArgs:
    """The `args:` of sae and transcoder."""

    path: str | None = None
    """A SAELens folder (cfg.json + sae_weights.safetensors), a folder of them (one per hook),
    or per-layer transcoder files (layer_<i>.safetensors, hookrun/dictionaries/)."""
    error_term: bool = True
    """Add back the dictionary's error: the model's outputs stay what they were; false: the
    site becomes the reconstruction."""
    record: list[str] = field(default_factory=lambda: ["latents"])
    """What is stored: any of latents (sparse), reconstruction, error, attribution (each
    latent times the gradient of the run's target with respect to it, sparse)."""
    edit: Any = None
    """{latents: [j, ...], op: zero | scale | clamp | set, value: x}; null: no edit."""


@dataclass(frozen=True)
class Reading:
    """A dictionary on one site's tensor, in its own space (Splice.read)."""

    dictionary: Dictionary  # on the tensor's device, in the compute float
    x: torch.Tensor  # what it reads
    latents: torch.Tensor
    rebuilt: torch.Tensor  # decode(encode(x))
    target: torch.Tensor  # what `rebuilt` stands in for
    affine: tuple[torch.Tensor, torch.Tensor] | None  # (weight, bias) back to the site's space
    dtype: torch.dtype  # the site's

    def to_site(self, value: torch.Tensor) -> torch.Tensor:
        """A value of the dictionary's output space in the site's space and float."""
        if self.affine is not None:
            value = value * self.affine[0] + self.affine[1]
        return value.to(self.dtype)


class Splice(Action):
    """A sparse autoencoder at its site: encoded, edited, decoded, its error added back."""

    Args = SpliceArgs
    stores = True
    transcoder: ClassVar[bool] = False

    def __init__(self, args: SpliceArgs) -> None:
        super().__init__(args)
        self.names = tuple(args.record)
        self.edit: EditArgs | None = parse_edit(args.edit, "args.edit") if args.edit else None
        self.by_layer: dict[str, Dictionary] = {}  # module → its dictionary
        # module → (weight, bias) of the norm whose affine its dictionary's input lacks
        # (a TransformerLens ln2.hook_normalized reads the norm's output before them).
        self.affine: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.on_device: dict[tuple[str, Any, Any], Dictionary] = {}  # moved once per device

    @property
    def records(self) -> bool:
        """Whether `record` names anything."""
        return bool(self.names)

    @property
    def needs_gradient(self) -> bool:
        """Whether it records the latents' attribution (a backward pass from the target)."""
        return "attribution" in self.names

    @classmethod
    def check(cls, args: SpliceArgs, key: str) -> None:
        """Refuse a missing path, unknown records and a bad edit, before any work."""
        if args.path is None:
            raise HookrunError(
                f"{key}.args.path: null; valid: a SAELens folder (cfg.json + "
                "sae_weights.safetensors), a folder of them, or per-layer transcoder files"
            )
        if not Path(str(args.path)).expanduser().exists():
            raise HookrunError(f"{key}.args.path: {args.path!r} does not exist")
        if list(args.record):  # [] records nothing: an edit alone
            check_choices(f"{key}.args.record", list(args.record), RECORDS, "record")
        if args.edit is not None:
            parse_edit(args.edit, f"{key}.args.edit")

    def claims(self) -> tuple[str, ...]:
        """Its records, by name: one splice's latents per site."""
        return tuple(f"sae {name}" for name in self.names)

    def bind(self, model: nn.Module, layers: tuple[str, ...], site: Site, key: str) -> None:
        """Each selected module's dictionary: the only one loaded, or the one whose hook name
        is that module's site."""
        if not layers:
            raise HookrunError(
                f"{key}.select: {self.name} needs modules, selected by name, regex or type (or "
                "no select: each dictionary at its own hook); valid: not select.function"
            )
        loaded = load_dictionaries(Path(str(self.args.path)).expanduser(), f"{key}.args.path")
        self._check_kind(loaded, key)
        if len(loaded) == 1:
            self.by_layer = dict.fromkeys(layers, loaded[0])
        else:
            placed = self._placed(loaded, model, key)
            missing = [layer for layer in layers if layer not in placed]
            if missing:
                raise HookrunError(
                    f"{key}.args.path: no dictionary of {self.args.path} is for {missing[0]} "
                    f"({len(loaded)} there, for {', '.join(sorted(placed))}); valid: select "
                    "those modules, or no select (each dictionary at its own hook)"
                )
            self.by_layer = {layer: placed[layer][1] for layer in layers}
        self._affines(model, key)
        for layer in layers:
            self._check_module(layer, site, model, key)

    def place(self, model: nn.Module, site: Site, key: str) -> tuple[str, ...]:
        """The modules the dictionaries name (no select): each at its own hook."""
        loaded = load_dictionaries(Path(str(self.args.path)).expanduser(), f"{key}.args.path")
        self._check_kind(loaded, key)
        placed = self._placed(loaded, model, key)
        for layer, (where, _) in placed.items():
            if where != site.value:
                raise HookrunError(
                    f"{key}.at: {site.value!r}, but the dictionary for {layer} reads its "
                    f"{where}; valid: {where} (a hook per site kind)"
                )
        self.by_layer = {layer: d for layer, (_, d) in placed.items()}
        self._affines(model, key)
        for layer in self.by_layer:
            self._check_module(layer, site, model, key)
        return tuple(self.by_layer)

    def _affines(self, model: nn.Module, key: str) -> None:
        """The norm weight and bias each dictionary's input lacks (by its hook name)."""
        modules = dict(model.named_modules())
        for layer, d in self.by_layer.items():
            norm = norm_affine(d.hook_name, model)
            if norm is None:
                continue
            weight = getattr(modules[norm], "weight", None)
            bias = getattr(modules[norm], "bias", None)
            if weight is None or not bool((weight != 0).all()):
                raise HookrunError(
                    f"{key}.args.path: {d.name} reads {d.hook_name} (the norm's output before "
                    f"its weight and bias), but {norm} has no weight or a zero in it to undo; "
                    "valid: a dictionary of the MLP's input (blocks.<L>.mlp.hook_in)"
                )
            zero = torch.zeros_like(weight)
            self.affine[layer] = (weight.detach(), zero if bias is None else bias.detach())

    def _placed(
        self, loaded: list[Dictionary], model: nn.Module, key: str
    ) -> dict[str, tuple[str, Dictionary]]:
        """module → (site, dictionary), from each dictionary's TransformerLens hook name."""
        placed: dict[str, tuple[str, Dictionary]] = {}
        for d in loaded:
            name = d.hook_name_out if self.transcoder and d.hook_name_out else d.hook_name
            if name is None:
                raise HookrunError(
                    f"{key}.args.path: {d.source} names no hook (cfg.json metadata.hook_name); "
                    "valid: select its module with hooks.<name>.select"
                )
            layer, where = module_site(name, model, f"{key}.args.path")
            if self.transcoder and where == "input" and is_mlp(layer, model):
                # One that names only what it reads (a trained one's, SAELens's without
                # hook_name_out) still writes in place of that MLP's output.
                where = "output"
            if layer in placed:
                raise HookrunError(
                    f"{key}.args.path: two dictionaries for {layer} ({placed[layer][1].name}, "
                    f"{d.name}); valid: one per module and site (a hook each)"
                )
            placed[layer] = (where, d)
        return placed

    def _check_kind(self, loaded: list[Dictionary], key: str) -> None:
        for d in loaded:
            if d.transcoder and not self.transcoder:
                raise HookrunError(
                    f"{key}.action: sae with {d.source}, a transcoder (d_out {d.d_out}); "
                    "valid: action transcoder"
                )

    def _check_module(self, layer: str, site: Site, model: nn.Module, key: str) -> None:
        if site not in (Site.input, Site.output):
            raise HookrunError(
                f"{key}.at: {site.value!r}; valid: input, output (a dictionary reads and "
                "writes activations)"
            )

    def prepare(
        self, shape: tuple[int, ...], site: str, key: str, rows: int, measured: Any = None
    ) -> None:
        """Refuse a dictionary whose width is not the site's, and an edited latent past it."""
        d = self._dictionary(site)
        width = shape[-1] if shape else 0
        if width != d.d_out or (not self.transcoder and width != d.d_in):
            what = "d_out" if self.transcoder else "d_in"
            raise HookrunError(
                f"{key}.args.path: {d.name} has {what} {d.d_out if self.transcoder else d.d_in}"
                f", but /{site} is {list(shape)} per sample (width {width}); valid: a "
                "dictionary of the site's width"
            )
        latents = list(self.edit.latents) if self.edit else []
        if latents and max(latents) >= d.d_sae:
            raise HookrunError(
                f"{key}.args.edit.latents: {max(latents)} is past the {d.d_sae} latents of "
                f"{d.name}; valid: 0..{d.d_sae - 1}"
            )

    def outputs(self, shape: tuple[int, ...], site: str, key: str) -> dict[str, Output]:
        """Its records at `site`: latents sparse, reconstruction and error dense."""
        d = self._dictionary(site)
        lead = tuple(shape[:-1])
        names = ("token",) if len(lead) == 1 else tuple(f"dim_{i}" for i in range(len(lead)))
        out = {}
        for name in self.names:
            path = splice_key(site, name)
            if name in ("latents", "attribution"):
                out[path] = Output(path, (*lead, d.d_sae), (*names, "latent"), self.dtype, True)
            else:
                out[path] = Output(path, (*lead, d.d_out), (*names, "feature"), self.dtype)
        return out

    def _dictionary(self, site: str) -> Dictionary:
        layer = layer_of(site)
        if layer not in self.by_layer:
            raise RuntimeError(f"{self.name}: no dictionary was bound for /{site}")
        return self.by_layer[layer]

    def _on(self, site: str, tensor: torch.Tensor) -> Dictionary:
        """The site's dictionary on the tensor's device, in the compute float."""
        dtype = getattr(torch, self.dtype) if self.dtype else tensor.dtype
        slot = (layer_of(site), tensor.device, dtype)
        if slot not in self.on_device:
            self.on_device[slot] = self._dictionary(site).to(tensor.device, dtype)
        return self.on_device[slot]

    def read(self, site: str, tensor: torch.Tensor, inputs: torch.Tensor | None) -> Reading:
        """The site's dictionary on `tensor` (a transcoder: on the module's `inputs`).

        Args:
            site: The site's capture path.
            tensor: The site's tensor.
            inputs: The module call's input (what a transcoder reads), or None.

        Returns:
            Its input in its own space (a norm's affine undone for ln2.hook_normalized), its
            latents and reconstruction, and what the reconstruction stands in for.
        """
        d = self._on(site, tensor)
        if self.transcoder and inputs is None:
            raise RuntimeError(f"transcoder: /{site} was given no module input")
        x = (inputs if self.transcoder else tensor).to(d.tensors["W_enc"].dtype)
        affine = self.affine.get(layer_of(site))
        if affine is not None:  # ln2.hook_normalized: the norm's output before its affine
            affine = tuple(t.to(x.device, x.dtype) for t in affine)
            x = (x - affine[1]) / affine[0]
        latents = d.encode(x)
        rebuilt = d.decode(latents, x)
        # What the reconstruction stands in for, in the dictionary's space: the MLP's output
        # for a transcoder, else the tensor it read.
        target = tensor.to(rebuilt.dtype) if self.transcoder else x
        back = None if self.transcoder else affine
        return Reading(d, x, latents, rebuilt, target, back, tensor.dtype)

    def apply(self, tensor: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
        """decode(edit(encode(x))) + the error held fixed (or the reconstruction alone)."""
        r = self.read(ctx.key, tensor, ctx.inputs)
        edited = self._edited(r.latents)
        out = r.rebuilt if edited is r.latents else r.dictionary.decode(edited, r.x)
        if self.args.error_term:
            with torch.no_grad():
                error = r.target - r.rebuilt
            out = out + error
        for name in self.names:
            if name == "attribution":
                self._attribute(r.latents, ctx)
                continue
            value = {"latents": r.latents, "reconstruction": r.rebuilt}.get(name)
            if name == "error":
                value = r.target - r.rebuilt
            ctx.record(value.detach(), splice_key(ctx.key, name))
        return r.to_site(out)

    def _attribute(self, latents: torch.Tensor, ctx: SiteContext) -> None:
        """Each latent × ∂target/∂latent, recorded when the backward pass reaches the
        latents: the linear estimate of its part in the target (its negative, the
        first-order estimate of zeroing it); zero wherever the latent is."""
        path = splice_key(ctx.key, "attribution")
        value = latents.detach()
        ctx.on_gradient(latents, lambda grad: ctx.record(value * grad, path))

    def _edited(self, latents: torch.Tensor) -> torch.Tensor:
        """The latents after `edit` (the same tensor when there is none)."""
        return latents if self.edit is None else edited(latents, self.edit)

    def sources(self) -> dict[str, str]:
        """The dictionaries' weights files and their digests."""
        seen = {d.source: d.sha256 for d in self.by_layer.values()}
        if len(seen) == 1:
            (source, digest), *_ = seen.items()
            return {"file": str(source), "sha256": digest}
        return {
            "file": ", ".join(str(s) for s in seen),
            "sha256": ", ".join(seen.values()),
        }

    def describe(self) -> str:
        """The action with its dictionary's folder name."""
        return super().describe().replace(f"path={self.args.path}", f"path=<{self.args.path}>")


ACTIONS.register("sae")(Splice)
Splice.name = "sae"


@ACTIONS.register("transcoder")
class Transcoder(Splice):
    """A transcoder in place of an MLP: it reads the MLP's input and writes its output."""

    name = "transcoder"
    transcoder = True

    def _check_module(self, layer: str, site: Site, model: nn.Module, key: str) -> None:
        if site != Site.output or not is_mlp(layer, model):
            raise HookrunError(
                f"{key}: a transcoder at {layer}/{site.value}; valid: the output of a block's "
                "MLP (it reads the MLP's input and writes in place of its output)"
            )


def parse_edit(raw: Any, key: str) -> EditArgs:
    """`args.edit`, checked: latents a non-empty list of integers >= 0, a known op, a finite
    value where the op needs one."""
    edit = parse_typed(raw, EditArgs, key)
    latents = edit.latents
    if isinstance(latents, int) and not isinstance(latents, bool):
        latents = [latents]
    valid = "a list of latent indices (integers >= 0)"
    if not isinstance(latents, (list, tuple)) or not latents:
        raise HookrunError(f"{key}.latents: {edit.latents!r}; valid: {valid}")
    if any(isinstance(j, bool) or not isinstance(j, int) or j < 0 for j in latents):
        raise HookrunError(f"{key}.latents: {list(latents)!r}; valid: {valid}")
    if edit.op not in OPS:
        raise HookrunError(f"{key}.op: {edit.op!r}; valid: {', '.join(OPS)}")
    if edit.op != "zero":
        value = edit.value
        if value is None or not isinstance(value, (int, float)) or value != value:
            raise HookrunError(f"{key}.value: {value!r} with op {edit.op}; valid: a finite number")
        if abs(float(value)) == float("inf"):
            raise HookrunError(f"{key}.value: {value!r}; valid: a finite number")
    edit.latents = [int(j) for j in latents]
    return edit


def edited(latents: torch.Tensor, edit: EditArgs) -> torch.Tensor:
    """A copy of `latents` (..., d_sae) with `edit` applied to its chosen latents."""
    chosen = list(edit.latents)
    part = latents[..., chosen]
    if edit.op == "zero":
        new = torch.zeros_like(part)
    elif edit.op == "scale":
        new = part * edit.value
    elif edit.op == "clamp":
        new = part.clamp(max=edit.value)
    else:  # set
        new = torch.full_like(part, float(edit.value))
    out = latents.clone()
    out[..., chosen] = new
    return out
