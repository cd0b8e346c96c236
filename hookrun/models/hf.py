"""`model.source: hf`: a Hugging Face transformers model and its tokenizer, offline.

- `model.path`: a folder written by `save_pretrained` (config.json, weights, tokenizer files),
  read with `local_files_only` (nothing is downloaded). Weights load from safetensors, or from
  a `.bin` through `torch.load(weights_only=True)` only (a pickled object is refused).
- `model.config`: a dict for `AutoConfig.for_model(**config)`, a random init seeded by the
  run's `seed`. Its tokenizer is `model.tokenizer` (a folder) or, without one, BYTE_TOKENIZER:
  a byte-level BPE of the 256 bytes alone (token id = byte value, no merges) plus
  `<|endoftext|>` (id 256, the bos/eos token), built from no files; `vocab_size` must be at
  least the tokenizer's size (257).
- Before any work the model is built once on the meta device (no memory, no random draws):
  a config transformers cannot build a model from (heads that do not divide the width, a
  negative size) is refused naming model.config (or model.path's config.json) and
  transformers' reason, and parameters that cannot fit the machine's memory are refused.
- `model.class`: causal_lm | masked_lm | base | sequence_classification (the transformers
  Auto class); `model.dtype`: float32 | bfloat16 | float16; `model.trust_remote_code`: false
  refuses a folder that needs the folder's own Python code (an `auto_map`, an unknown
  `model_type`).

`model.attention`: eager (the default: its probabilities are a module's output, and every
family has it) | sdpa (torch's fused scaled_dot_product_attention: the same numbers to float
rounding, faster; experiment=lm_cache uses it). A run with `at: pattern` sites switches an
sdpa model to eager for that run and says so (runtime/pattern.py).
transformers is an optional extra (`pip install hookrun[hf]`), imported only here, on use.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hookrun.errors import HookrunError, nearest, unknown_key
from hookrun.extras import missing_extra
from hookrun.memory import check_fits
from hookrun.models.config import ModelConfig
from hookrun.models.language import LanguageModel
from hookrun.models.placement import check_placement, is_placed, placement_kwargs

__all__ = [
    "CLASSES",
    "DTYPES",
    "EOS",
    "BYTE_TOKENIZER",
    "byte_tokenizer",
    "check_hf",
    "load_tokenizer",
    "build_hf",
    "weights_file",
]

log = logging.getLogger("hookrun")

# model.class -> the transformers Auto class that builds it.
CLASSES = {
    "causal_lm": "AutoModelForCausalLM",
    "masked_lm": "AutoModelForMaskedLM",
    "base": "AutoModel",
    "sequence_classification": "AutoModelForSequenceClassification",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION = ("eager", "sdpa")
EOS = "<|endoftext|>"
BYTE_TOKENIZER = "bytes: the 256 byte tokens (id = byte value) and <|endoftext|> (id 256)"
# What save_pretrained writes for the weights, in the order they are preferred.
_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt")
_FOLDER = "a folder written by save_pretrained (config.json, weights, tokenizer files)"


def _transformers() -> Any:
    try:
        import transformers  # an optional extra: pip install hookrun[hf]
    except ImportError:
        raise missing_extra("model.source: 'hf'", "hf") from None
    return transformers


def _plain(value: Any) -> Any:
    """A frozen config value (read-only mappings, tuples) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _check_choices(cfg: ModelConfig) -> None:
    if cfg.class_ not in CLASSES:
        raise HookrunError(f"model.class: {cfg.class_!r}; valid: {', '.join(CLASSES)}")
    if cfg.dtype not in DTYPES:
        raise HookrunError(f"model.dtype: {cfg.dtype!r}; valid: {', '.join(DTYPES)}")
    if cfg.attention not in ATTENTION:
        raise HookrunError(f"model.attention: {cfg.attention!r}; valid: {', '.join(ATTENTION)}")
    if cfg.path is not None and cfg.config is not None:
        raise HookrunError(
            "model.config: set together with model.path; valid: one of them (a folder, or a "
            "config for a random init)"
        )
    if cfg.path is None and cfg.config is None:
        raise HookrunError(
            f"model.path: null; valid: {_FOLDER}, or model.config={{model_type: gpt2, ...}} "
            "for a random init"
        )
    for key, value in (("name", cfg.name), ("weights", cfg.weights), ("_target_", cfg._target_)):
        if value is not None:
            raise HookrunError(
                f"model.{key}: {value!r}; valid: null with model.source=hf (the model is "
                "model.path, a local folder, or model.config)"
            )
    if cfg.kwargs:
        raise HookrunError(
            f"model.kwargs: {dict(cfg.kwargs)}; valid: {{}} with model.source=hf (set the "
            "architecture in model.config)"
        )


def _folder(value: str, key: str) -> Path:
    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise HookrunError(f"{key}: {value!r} is not a folder; valid: {_FOLDER}")
    return folder


def weights_file(folder: Path) -> Path | None:
    """The weights file save_pretrained wrote in `folder` (the index of sharded weights),
    safetensors first; None when there is none."""
    for name in _WEIGHTS:
        if (folder / name).is_file():
            return folder / name
    return None


def _refuse_remote(path: Path, why: str) -> None:
    raise HookrunError(
        f"model.trust_remote_code: false, but {path} {why}, which runs Python code from the "
        "folder; valid: true (you trust that code), or a folder of a built-in transformers "
        "model type"
    )


_JSON_KINDS = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}


def _json(path: Path, key: str) -> dict:
    """The JSON object in `path` (a config.json, a tokenizer_config.json), or one line saying
    what is wrong with the file."""
    valid = "valid: a JSON object, as save_pretrained writes it"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise HookrunError(f"{key}: {path} cannot be read ({_first(err)}); {valid}") from None
    if not text.strip():
        raise HookrunError(f"{key}: {path} is empty; {valid}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise HookrunError(f"{key}: {path} is not valid JSON ({err}); {valid}") from None
    if not isinstance(data, dict):
        kind = _JSON_KINDS.get(type(data), "a number")
        raise HookrunError(f"{key}: {path} holds {kind}, not a JSON object; {valid}")
    return data


def _model_folder(cfg: ModelConfig) -> Path:
    """model.path with a readable config.json and a weights file, or one line naming what is
    missing or broken."""
    folder = _folder(str(cfg.path), "model.path")
    if not (folder / "config.json").is_file():
        raise HookrunError(f"model.path: {folder} has no config.json; valid: {_FOLDER}")
    raw = _json(folder / "config.json", "model.path")
    if "model_type" not in raw and "auto_map" not in raw:
        raise HookrunError(
            f"model.path: {folder / 'config.json'} has no model_type; valid: a config.json "
            "that names its model_type (gpt2, llama, ...), as save_pretrained writes it"
        )
    if weights_file(folder) is None:
        raise HookrunError(
            f"model.path: {folder} has no weights file ({', '.join(_WEIGHTS)}); valid: {_FOLDER}"
        )
    return folder


def _config(cfg: ModelConfig, tokenizer: Any) -> Any:
    """The model's transformers config: from model.path's config.json, or model.config."""
    tf = _transformers()
    known = tf.models.auto.configuration_auto.CONFIG_MAPPING_NAMES
    if cfg.path is not None:
        folder = _model_folder(cfg)
        raw = _json(folder / "config.json", "model.path")
        if not cfg.trust_remote_code and "auto_map" in raw:
            _refuse_remote(folder / "config.json", "names its own classes (auto_map)")
        if not cfg.trust_remote_code and raw.get("model_type") not in known:
            _refuse_remote(folder / "config.json", f"has model_type {raw.get('model_type')!r}")
        try:
            return tf.AutoConfig.from_pretrained(
                str(folder), local_files_only=True, trust_remote_code=cfg.trust_remote_code
            )
        except Exception as err:  # transformers (and huggingface_hub's checks) raise many types
            raise HookrunError(f"model.path: {folder}/config.json: {_first(err)}") from None
    given = _plain(cfg.config)
    model_type = given.pop("model_type", None)
    if model_type not in known:
        hint = ", ".join(nearest(str(model_type), known)) or "gpt2, llama, gpt_neox, bert"
        raise HookrunError(
            f"model.config.model_type: {model_type!r} is not a transformers model type; "
            f"nearest: {hint}; valid: one of transformers' CONFIG_MAPPING"
        )
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    defaults = {k: v for k, v in special.items() if v is not None}
    _check_vocab(cfg, given.get("vocab_size"), tokenizer)  # before transformers warns of it
    try:
        config = tf.AutoConfig.for_model(model_type, **{**defaults, **given})
    except Exception as err:  # transformers (and huggingface_hub's checks) raise many types
        raise HookrunError(
            f"model.config: {model_type} {given}: {_first(err)}; valid: the keys and value "
            f"types of transformers' {model_type} config"
        ) from None
    _refuse_ignored(tf, model_type, given, defaults, config)
    return config


def _refuse_ignored(tf: Any, model_type: str, given: dict, defaults: dict, config: Any) -> None:
    """A model.config key transformers keeps as a bare attribute, which changes nothing else
    in the config (`n_layers` for gpt2's `n_layer`), is a typo that would build the default
    model without a word: refused, naming the config's keys. A key its class reads under
    another name (llama's `rope_theta` into `rope_parameters`) changes the config: kept."""
    cls = type(config)
    known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))
    built = config.to_dict()
    for key in given:
        if key in known:
            continue
        without = {k: v for k, v in given.items() if k != key}
        other = tf.AutoConfig.for_model(model_type, **{**defaults, **without}).to_dict()
        if {k: v for k, v in built.items() if k != key} == other:
            valid = sorted(k for k in known if not k.startswith("_"))
            raise unknown_key("model.config", key, valid)


def _first(err: BaseException) -> str:
    """An error's type and first line (with the next when the first only introduces it:
    "Validation error for field 'x':")."""
    lines = [x.strip() for x in str(err).strip().splitlines() if x.strip()] or [""]
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return f"{type(err).__name__}: {text[:300]}"


def _auto_class(cfg: ModelConfig, config: Any) -> Any:
    """The Auto class of model.class, refused when the architecture has no such model."""
    tf = _transformers()
    auto = getattr(tf, CLASSES[cfg.class_])
    if cfg.trust_remote_code and getattr(config, "auto_map", None):
        return auto  # the folder's own classes: transformers finds them in auto_map
    if type(config) not in auto._model_mapping:
        valid = [k for k, v in CLASSES.items() if type(config) in getattr(tf, v)._model_mapping]
        raise HookrunError(
            f"model.class: {cfg.class_!r} has no {config.model_type} model; valid: "
            f"{', '.join(valid) or 'none'}"
        )
    return auto


def byte_tokenizer() -> Any:
    """BYTE_TOKENIZER: a PreTrainedTokenizerFast made from no files."""
    tf = _transformers()
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's printable stand-ins for the 256 bytes (the byte-level pre-tokenizer's alphabet).
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = [], 0
    for byte in range(256):
        chars.append(chr(byte) if byte in kept else chr(256 + extra))
        extra += byte not in kept
    vocab = {c: i for i, c in enumerate(chars)}
    vocab[EOS] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS, special=True)])
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS)


def load_tokenizer(cfg: ModelConfig) -> Any:
    """The tokenizer of `cfg` (no weights read): model.tokenizer, else model.path's, else
    (model.config alone) BYTE_TOKENIZER."""
    _transformers()
    if cfg.tokenizer is None and cfg.path is None:
        return byte_tokenizer()
    key = "model.tokenizer" if cfg.tokenizer is not None else "model.path"
    folder = _folder(str(cfg.tokenizer if cfg.tokenizer is not None else cfg.path), key)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise HookrunError(
            f"{key}: {folder} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); valid: "
            "a folder a tokenizer's save_pretrained wrote"
        )
    if (folder / "config.json").is_file():  # AutoTokenizer reads it too: named when broken
        _json(folder / "config.json", key)
    settings = folder / "tokenizer_config.json"
    if not cfg.trust_remote_code and settings.is_file() and "auto_map" in _json(settings, key):
        _refuse_remote(settings, "names its own tokenizer class (auto_map)")
    try:
        return _transformers().AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=cfg.trust_remote_code
        )
    except Exception as err:  # transformers raises many types for a bad folder
        raise HookrunError(f"{key}: {folder}: cannot load its tokenizer ({_first(err)})") from None


def _check_vocab(cfg: ModelConfig, size: Any, tokenizer: Any) -> None:
    if not isinstance(size, int) or size >= len(tokenizer):
        return
    key, what = "model.config.vocab_size", str(size)
    if cfg.config is None:
        key, what = "model.path", f"{cfg.path}/config.json's vocab_size {size}"
    raise HookrunError(
        f"{key}: {what} is below the tokenizer's {len(tokenizer)} tokens; valid: "
        f"vocab_size >= {len(tokenizer)} (a token id past the embedding would fail)"
    )


def _prepared(cfg: ModelConfig) -> tuple[Any, Any, Any]:
    _check_choices(cfg)
    if cfg.path is not None:
        _model_folder(cfg)  # config.json and weights before the tokenizer files
    tokenizer = load_tokenizer(cfg)
    config = _config(cfg, tokenizer)
    auto = _auto_class(cfg, config)
    _check_attention(cfg, auto, config)
    _check_vocab(cfg, getattr(config, "vocab_size", None), tokenizer)
    _check_builds(cfg, auto, config)
    if cfg.class_ == "sequence_classification" and config.pad_token_id is None:
        # GPT-2-style classifiers find each row's last token by the pad id.
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else None
        config.pad_token_id = pad if pad is not None else tokenizer.eos_token_id
    return tokenizer, config, auto


def _check_attention(cfg: ModelConfig, auto: Any, config: Any) -> None:
    """model.attention=sdpa on an architecture transformers has no sdpa for: refused."""
    if cfg.attention != "sdpa":
        return
    mapping = getattr(auto, "_model_mapping", None)
    try:
        cls = mapping[type(config)] if mapping is not None else None
    except KeyError:  # a remote-code model: its class is known only when loaded
        cls = None
    if cls is not None and not getattr(cls, "_supports_sdpa", False):
        raise HookrunError(
            f"model.attention: sdpa: transformers has no sdpa attention for {cls.__name__}; "
            "valid: eager"
        )


def _config_key(cfg: ModelConfig) -> str:
    """Where the model's config comes from, as errors name it."""
    if cfg.config is not None:
        return f"model.config: {_plain(cfg.config)}"
    return f"model.path: {Path(str(cfg.path)).expanduser() / 'config.json'}"


def _unbuildable(cfg: ModelConfig, config: Any, err: BaseException) -> HookrunError:
    return HookrunError(
        f"{_config_key(cfg)}: transformers cannot build a {config.model_type} model from it "
        f"({_first(err)}); valid: a config its model class accepts"
    )


def _check_builds(cfg: ModelConfig, auto: Any, config: Any) -> None:
    """Build the model on the meta device (no memory, no weights, no random draws): what
    transformers refuses in the config (heads that do not divide the width, a negative
    size) is refused here, naming the config, before any work."""
    if cfg.trust_remote_code and getattr(config, "auto_map", None):
        check_placement(cfg, None)
        return  # the folder's own classes: built only when the run loads them
    try:
        with torch.device("meta"):
            meta = auto.from_config(copy.deepcopy(config), attn_implementation=cfg.attention)
    except Exception as err:  # transformers and torch raise many types for a bad config
        raise _unbuildable(cfg, config, err) from None
    check_placement(cfg, meta)
    if is_placed(cfg):
        return  # spread over the map's devices: checked against its max_memory
    # Its parameters are allocated at once: a random init in float32 (then cast to
    # model.dtype), the weights read from model.path in model.dtype.
    count = sum(p.numel() for p in meta.parameters())
    dtype = "float32" if cfg.path is None else cfg.dtype
    key, value = _config_key(cfg).split(": ", 1)
    what = f"the model's {count:,} parameters in {dtype}"
    check_fits(key, value, count * DTYPES[dtype].itemsize, what)


def check_hf(cfg: ModelConfig) -> None:
    """Everything about an hf model that can be checked without its weights: the keys, the
    folders and their files, the config, the class, the tokenizer and its size."""
    _prepared(cfg)


def _dtype_key() -> str:
    """transformers 4.56 renamed from_pretrained's torch_dtype to dtype."""
    version = _transformers().__version__.split(".")
    return "dtype" if (int(version[0]), int(version[1])) >= (4, 56) else "torch_dtype"


def build_hf(cfg: ModelConfig) -> tuple[LanguageModel, Path | None]:
    """The model (in eval mode) and the weights file it was read from (None for
    model.config). Random init draws from torch's global generator: seed it first."""
    tokenizer, config, auto = _prepared(cfg)
    dtype = DTYPES[cfg.dtype]
    if cfg.path is None:
        try:
            model = auto.from_config(config, attn_implementation=cfg.attention).to(dtype)
        except Exception as err:  # what the meta build let through: still the config's
            raise _unbuildable(cfg, config, err) from None
        return LanguageModel(model.eval(), tokenizer, cfg.class_), None
    folder = _model_folder(cfg)
    weights = weights_file(folder)
    try:
        model, info = auto.from_pretrained(
            str(folder),
            config=config,
            local_files_only=True,
            trust_remote_code=cfg.trust_remote_code,
            use_safetensors=weights is not None and ".safetensors" in weights.name,
            weights_only=True,
            attn_implementation=cfg.attention,
            output_loading_info=True,
            **{_dtype_key(): dtype},
            **placement_kwargs(cfg),
        )
    except Exception as err:  # a damaged or unsafe file: many exception types
        raise HookrunError(
            f"model.path: {weights}: cannot load the weights ({_first(err)})"
        ) from None
    missing = list(info.get("missing_keys") or [])
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        log.warning(
            "model.path: %s has no weights for %s%s of the %s model: they are random (seeded)",
            weights,
            ", ".join(missing[:3]),
            more,
            cfg.class_,
        )
    if not is_placed(cfg):  # a mapped model is in model.dtype already, where the map put it
        model = model.to(dtype)
    return LanguageModel(model.eval(), tokenizer, cfg.class_), weights
