"""The `sae:` node of a training run (experiment=train_sae), typed and checked before any work.

One node says what to train: at which sites (`sae.sites`: a module's input or output for an
SAE; an input → output pair for a transcoder), which architecture, how wide and how sparse
(the base keys, and `sae.grid`: one dictionary per entry per site, each entry overriding
base keys), on how many tokens, from the model or from an earlier run's file. Everything
that can be wrong without the model is refused here, in one line naming the key; the sites
are checked against the model when the job starts, still before any work.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from hookrun.errors import HookrunError, did_you_mean
from hookrun.typed import Frozen, parse_typed

__all__ = [
    "ARCHITECTURES",
    "NORMALIZE",
    "Site",
    "Dictionary",
    "TrainConfig",
    "TrainJob",
    "parse_train",
]

ARCHITECTURES = ("relu", "topk", "batchtopk", "jumprelu", "matryoshka_batchtopk")
NORMALIZE = ("none", "expected_average_only_in")
DTYPES = ("float32", "bfloat16", "float16")
PREFETCH = ("auto", "true", "false")
_SITE = re.compile(r"(?P<module>[^:\s]+):(?P<at>input|output)")
# The keys an entry of `sae.grid` may set: what differs between dictionaries trained from the
# same activations (the data keys are the job's).
GRID_KEYS = (
    "architecture",
    "width",
    "expansion",
    "k",
    "l1_coefficient",
    "l1_warmup_steps",
    "l0_coefficient",
    "jumprelu_bandwidth",
    "jumprelu_init_threshold",
    "matryoshka_widths",
    "lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "aux_k_coefficient",
    "name",
)


@dataclass(frozen=True)
class Site:
    """Where a dictionary reads (and, for a transcoder, what it predicts).

    `source` and `target` are (module, "input" | "output"); an SAE's target is its source.
    """

    source: tuple[str, str]
    target: tuple[str, str]
    skip: bool = False  # a skip transcoder: x W_skip added to its output

    @property
    def transcoder(self) -> bool:
        return self.source != self.target

    @property
    def label(self) -> str:
        """The site in names: `transformer.h.1.output`, a transcoder's `M.input-N.output`."""
        first = ".".join(self.source)
        return first if not self.transcoder else f"{first}-{'.'.join(self.target)}"


@dataclass(frozen=True)
class Dictionary:
    """One dictionary of the job: its site, its name (its folder under <run dir>/sae/) and
    its hyperparameters (width resolved against the site's d_in when the job starts)."""

    name: str
    site: Site
    architecture: str
    width: int | None
    expansion: float
    k: int | None
    l1_coefficient: float
    l1_warmup_steps: int
    l0_coefficient: float
    jumprelu_bandwidth: float
    jumprelu_init_threshold: float
    matryoshka_widths: tuple[int, ...]
    lr: float
    lr_warmup_steps: int
    lr_decay_steps: int
    aux_k_coefficient: float

    def resolved_width(self, d_in: int) -> int:
        return self.width if self.width is not None else int(round(self.expansion * d_in))


@dataclass
class HeldoutConfig(Frozen):
    rows: int = 16
    """The dataset's first rows, left out of training: the scores stage reads them at the end
    (0: no scores)."""


@dataclass
class TrainConfig(Frozen):
    sites: list[Any] = field(default_factory=list)
    """`module:input|output` for an SAE, or {in: M:S, out: N:S, skip: false} for a
    transcoder (skip: a skip transcoder's W_skip)."""
    architecture: str = "topk"
    """relu | topk | batchtopk | jumprelu | matryoshka_batchtopk"""
    width: int | None = None
    """Latents (d_sae); null: expansion × the site's width."""
    expansion: float = 8.0
    """Latents per feature of the site when `width` is null."""
    k: int | None = 32
    """Latents kept per token (topk) or on average per token (batchtopk, matryoshka)."""
    l1_coefficient: float = 1.0
    """relu: the L1 penalty on latents × their decoder rows' norms."""
    l1_warmup_steps: int = 0
    """relu: steps over which the L1 coefficient rises linearly from 0."""
    l0_coefficient: float = 1.0
    """jumprelu: the L0 penalty."""
    jumprelu_bandwidth: float = 0.05
    """jumprelu: the straight-through estimator's rectangle kernel width."""
    jumprelu_init_threshold: float = 0.01
    """jumprelu: every latent's threshold at the start."""
    matryoshka_widths: list[int] = field(default_factory=list)
    """matryoshka_batchtopk: the nested prefixes' widths, increasing; the last is the width
    (added when missing)."""
    aux_k_coefficient: float = 1.0
    """topk, batchtopk, matryoshka: the AuxK loss's weight (dead latents' reconstruction of
    the residual)."""
    lr: float = 3e-4
    """Adam's learning rate."""
    lr_warmup_steps: int = 0
    """Steps over which the learning rate rises linearly to `lr`."""
    lr_decay_steps: int = 0
    """The last steps, over which the learning rate falls linearly to 0."""
    tokens: int = 1_000_000
    """Training tokens, each dictionary (steps = tokens // batch)."""
    batch: int = 4096
    """Tokens per step."""
    buffer: int = 65_536
    """Tokens shuffled together (a whole number of batches: rounded down to one)."""
    normalize: str = "none"
    """none | expected_average_only_in (inputs scaled to mean norm sqrt(d_in); saved as
    SAELens saves it)."""
    dtype: str = "float32"
    """The dictionaries' forward under torch.autocast in this dtype, as SAELens's `autocast`
    (the parameters, gradients and Adam stay float32): float32 (no autocast) | bfloat16 |
    float16. Meant for a GPU; the CPU's autocast runs too, mostly slower."""
    prefetch: str = "auto"
    """Streamed: the next chunk's forward passes run in a thread while the steps run on this
    chunk (the same weights either way; memory: two chunks): auto (on a GPU in one process)
    | true | false. Not under torchrun."""
    from_: str | None = None
    """A captures.h5 of an earlier run holding the sites' captures (`sae.from` on the command
    line): read through TokenBatches instead of running the model."""
    checkpoint_tokens: int = 1_000_000
    """A checkpoint (weights, optimiser, schedule, data position) every this many tokens."""
    log_steps: int = 10
    """A row of training curves every this many steps."""
    grid: list[Any] = field(default_factory=list)
    """One dictionary per entry per site, each entry overriding base keys, e.g.
    [{width: 512, k: 16}, {width: 1024, k: 32}]; empty: one from the base keys."""
    heldout: HeldoutConfig = field(default_factory=HeldoutConfig)

    @property
    def steps(self) -> int:
        return self.tokens // self.batch

    @property
    def checkpoint_steps(self) -> int:
        return max(1, self.checkpoint_tokens // self.batch)

    @property
    def chunk(self) -> int:
        """Tokens per shuffled chunk: the buffer rounded down to whole batches."""
        return max(1, self.buffer // self.batch) * self.batch


@dataclass(frozen=True)
class TrainJob:
    """The parsed `sae:` node: its keys, and every dictionary they make (sites × grid)."""

    config: TrainConfig
    dictionaries: tuple[Dictionary, ...]


def _site(raw: Any, key: str) -> Site:
    def one(text: Any, where: str) -> tuple[str, str]:
        match = _SITE.fullmatch(str(text)) if isinstance(text, str) else None
        if match is None:
            raise HookrunError(
                f"{where}: {text!r}; valid: MODULE:input or MODULE:output, e.g. "
                "transformer.h.1:output"
            )
        return match["module"], match["at"]

    if isinstance(raw, str):
        source = one(raw, key)
        return Site(source, source)
    if isinstance(raw, dict):
        unknown = set(raw) - {"in", "out", "skip"}
        if unknown or "in" not in raw or "out" not in raw:
            raise HookrunError(
                f"{key}: {dict(raw)!r}; valid: a transcoder as {{in: MODULE:SITE, out: "
                "MODULE:SITE, skip: false}"
            )
        skip = raw.get("skip", False)
        if not isinstance(skip, bool):
            raise HookrunError(f"{key}.skip: {skip!r}; valid: true or false")
        site = Site(one(raw["in"], f"{key}.in"), one(raw["out"], f"{key}.out"), skip)
        if not site.transcoder:
            raise HookrunError(
                f"{key}: in and out are both {raw['in']}; valid: an SAE as the string "
                f"{raw['in']!r}, or a transcoder's two different sites"
            )
        return site
    raise HookrunError(
        f"{key}: {raw!r}; valid: MODULE:input|output, or {{in: MODULE:SITE, out: MODULE:SITE}}"
    )


def _positive(key: str, value: Any, zero: bool = False) -> None:
    low = 0 if zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise HookrunError(f"{key}: {value!r}; valid: an integer >= {low}")


def _finite(key: str, value: Any, positive: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise HookrunError(
            f"{key}: {value!r}; valid: a finite number {'>' if positive else '>='} 0"
        )


def _dictionary(config: TrainConfig, entry: dict, site: Site, key: str) -> Dictionary:
    values = {name: getattr(config, name) for name in GRID_KEYS if name != "name"}
    values.update({k: v for k, v in entry.items() if k != "name"})
    arch = values["architecture"]
    if arch not in ARCHITECTURES:
        raise HookrunError(
            f"{key}.architecture: {arch!r}; valid: {', '.join(ARCHITECTURES)}"
            + did_you_mean(arch, ARCHITECTURES)
        )
    if site.transcoder and arch == "topk":
        # SAELens 6.54 has no topk transcoder class: the saved folder could not be loaded
        valid = ", ".join(a for a in ARCHITECTURES if a != "topk")
        raise HookrunError(
            f"{key}.architecture: 'topk' for the transcoder {':'.join(site.source)} -> "
            f"{':'.join(site.target)}; valid: {valid} "
            "(SAELens has no topk transcoder to save it as)"
        )
    width, k = values["width"], values["k"]
    if width is not None:
        _positive(f"{key}.width", width)
    _finite(f"{key}.expansion", values["expansion"], positive=True)
    topk_like = arch != "relu" and arch != "jumprelu"
    if topk_like:
        if k is None:
            raise HookrunError(f"{key}.k: null; valid: an integer >= 1 for {arch}")
        _positive(f"{key}.k", k)
    for name in ("l1_warmup_steps", "lr_warmup_steps", "lr_decay_steps"):
        _positive(f"{key}.{name}", values[name], zero=True)
    for name in (
        "l1_coefficient",
        "l0_coefficient",
        "aux_k_coefficient",
        "jumprelu_init_threshold",
    ):
        _finite(f"{key}.{name}", values[name])
    for name in ("lr", "jumprelu_bandwidth"):
        _finite(f"{key}.{name}", values[name], positive=True)
    nested = tuple(values["matryoshka_widths"] or ())
    if arch == "matryoshka_batchtopk":
        for i, w in enumerate(nested):
            _positive(f"{key}.matryoshka_widths[{i}]", w)
        if list(nested) != sorted(set(nested)):
            raise HookrunError(
                f"{key}.matryoshka_widths: {list(nested)}; valid: increasing widths, each once"
            )
    elif nested:
        raise HookrunError(
            f"{key}.matryoshka_widths: {list(nested)} with architecture {arch}; valid: [] "
            "(only matryoshka_batchtopk nests its latents)"
        )
    if width is not None:
        check_width(key, width, k if topk_like else None, nested)
    name = entry.get("name") or _name(site, arch, width, values)
    if not re.fullmatch(r"[A-Za-z0-9_.=-]+", str(name)):
        raise HookrunError(
            f"{key}.name: {name!r}; valid: letters, digits and _ . = - (a folder's name)"
        )
    return Dictionary(
        name=str(name),
        site=site,
        architecture=arch,
        width=width,
        expansion=float(values["expansion"]),
        k=k if topk_like else None,
        l1_coefficient=float(values["l1_coefficient"]),
        l1_warmup_steps=values["l1_warmup_steps"],
        l0_coefficient=float(values["l0_coefficient"]),
        jumprelu_bandwidth=float(values["jumprelu_bandwidth"]),
        jumprelu_init_threshold=float(values["jumprelu_init_threshold"]),
        matryoshka_widths=nested,
        lr=float(values["lr"]),
        lr_warmup_steps=values["lr_warmup_steps"],
        lr_decay_steps=values["lr_decay_steps"],
        aux_k_coefficient=float(values["aux_k_coefficient"]),
    )


def check_width(key: str, width: int, k: int | None, nested: tuple[int, ...]) -> None:
    """A dictionary's width against its k and nested widths: at parse time for a width
    given, once the site's width is known for one from `expansion` (training/job.py)."""
    if width < 1:
        raise HookrunError(f"{key}.width: {width}; valid: an integer >= 1")
    if k is not None and k >= width:
        raise HookrunError(
            f"{key}.k: {k} with width {width}; valid: 1 <= k < width (k latents of width)"
        )
    if nested and nested[-1] > width:
        raise HookrunError(
            f"{key}.matryoshka_widths: {list(nested)} with width {width}; valid: widths up to "
            "the width"
        )


def _name(site: Site, arch: str, width: int | None, values: dict) -> str:
    size = f"w{width}" if width is not None else f"x{values['expansion']:g}"
    sparsity = {
        "relu": f"l1_{values['l1_coefficient']:g}",
        "jumprelu": f"l0_{values['l0_coefficient']:g}",
    }.get(arch, f"k{values['k']}")
    return f"{site.label}.{arch}.{size}.{sparsity}"


def parse_train(raw: Any) -> TrainJob | None:
    """The typed `sae:` node, or None when it names no sites (no training).

    Raises:
        HookrunError: a key, value or combination that cannot train, naming the key.
    """
    if not raw:
        return None
    node = dict(raw)
    if "from" in node:  # `from` is a Python keyword: the field is from_
        node["from_"] = node.pop("from")
    if isinstance(node.get("prefetch"), bool):  # YAML's and the command line's true/false
        node["prefetch"] = str(node["prefetch"]).lower()
    config = parse_typed(node, TrainConfig, "sae")
    if not config.sites:
        raise HookrunError("sae.sites: []; valid: one or more sites, e.g. [transformer.h.1:output]")
    sites = [_site(s, f"sae.sites[{i}]") for i, s in enumerate(config.sites)]
    for name in ("tokens", "batch", "buffer", "checkpoint_tokens", "log_steps"):
        _positive(f"sae.{name}", getattr(config, name))
    _positive("sae.heldout.rows", config.heldout.rows, zero=True)
    if config.tokens < config.batch:
        raise HookrunError(
            f"sae.tokens: {config.tokens} is fewer than one batch (sae.batch: {config.batch}); "
            "valid: tokens >= batch"
        )
    if config.normalize not in NORMALIZE:
        raise HookrunError(f"sae.normalize: {config.normalize!r}; valid: {', '.join(NORMALIZE)}")
    if config.prefetch not in PREFETCH:
        raise HookrunError(f"sae.prefetch: {config.prefetch!r}; valid: {', '.join(PREFETCH)}")
    if config.dtype not in DTYPES:
        raise HookrunError(f"sae.dtype: {config.dtype!r}; valid: {', '.join(DTYPES)}")
    entries = list(config.grid) or [{}]
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise HookrunError(
                f"sae.grid[{i}]: {entry!r}; valid: a mapping of {', '.join(GRID_KEYS)}"
            )
        for k in entry:
            if k not in GRID_KEYS:
                raise HookrunError(
                    f"sae.grid[{i}].{k}: not a dictionary's key; valid: {', '.join(GRID_KEYS)}"
                    + did_you_mean(k, GRID_KEYS)
                )
    made = []
    for site in sites:
        for i, entry in enumerate(entries):
            key = f"sae.grid[{i}]" if config.grid else "sae"
            made.append(_dictionary(config, dict(entry), site, key))
    names = [d.name for d in made]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise HookrunError(
            f"sae.grid: two dictionaries named {twice[0]!r}; valid: entries that differ, or "
            "a name each (grid entry `name`)"
        )
    return TrainJob(config, tuple(made))
