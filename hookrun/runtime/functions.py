"""Function-level sites: torch functions called inside `forward` (`select: {function: [...]}`),
and modules used only through their weights (nn.MultiheadAttention's out_proj, Swin's qkv).

Both are seen through one `torch.overrides.TorchFunctionMode`, entered by a forward pre-hook
on the root module and left by its forward hook: it is active exactly during forward passes,
and only in runs whose plan has such sites (no mode at all otherwise). A call is named
`<module>/<function>.<k>`: the innermost running module (`model` for the root's own
forward), the selector's word, and the call's index among that module's calls of that word
in one forward. Calls made inside a built-in leaf module (nn.ReLU calls F.relu, nn.Linear
F.linear) are that module's own site, never a function site, so a rule never acts twice.
A call of F.linear / F.conv* with the weight of a selected module that never runs as a
module is that module's call, recorded under its own name.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from hookrun.errors import HookrunError, nearest
from hookrun.runtime.handles import ModuleHook, hooked

__all__ = [
    "FUNCTIONS",
    "RECTIFIER_WORDS",
    "ROOT",
    "resolve_words",
    "weights_of",
    "is_inplace",
    "CallSites",
    "watch_calls",
]

ROOT = "model"

# Selector word → every spelling of that function (functional, torch.*, Tensor methods,
# in-place forms). Rectifiers first: experiment=guided_bp selects these words.
FUNCTIONS: dict[str, tuple[Callable, ...]] = {
    "relu": (F.relu, F.relu_, torch.relu, torch.relu_, Tensor.relu, Tensor.relu_),
    "relu6": (F.relu6,),
    "leaky_relu": (F.leaky_relu, F.leaky_relu_),
    "prelu": (F.prelu, torch.prelu),
    "rrelu": (F.rrelu, F.rrelu_, torch.rrelu),
    "elu": (F.elu, F.elu_),
    "selu": (F.selu, torch.selu, torch.selu_),
    "celu": (F.celu, torch.celu),
    "gelu": (F.gelu,),
    "silu": (F.silu,),
    "mish": (F.mish,),
    "hardswish": (F.hardswish,),
    "softplus": (F.softplus,),
    "sigmoid": (torch.sigmoid, F.sigmoid, Tensor.sigmoid),
    "hardsigmoid": (F.hardsigmoid,),
    "tanh": (torch.tanh, F.tanh, Tensor.tanh),
    "softmax": (F.softmax, torch.softmax, Tensor.softmax),
    "linear": (F.linear,),
    "conv2d": (F.conv2d,),
    "matmul": (torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm),
    "layer_norm": (F.layer_norm,),
    "scaled_dot_product_attention": (F.scaled_dot_product_attention,),
}
RECTIFIER_WORDS = (
    "relu", "relu6", "leaky_relu", "prelu", "rrelu", "elu", "selu", "celu", "gelu", "silu",
    "mish", "hardswish", "softplus",
)  # fmt: skip
_WEIGHTED = (F.linear, F.conv1d, F.conv2d, F.conv3d)
# F.multi_head_attention_forward's positional out_proj_weight (out_proj_bias follows it), as
# nn.MultiheadAttention.forward passes it.
_OUT_PROJ = 11
_INPLACE = {F.relu_, torch.relu_, Tensor.relu_, F.leaky_relu_, F.rrelu_, F.elu_, torch.selu_}


def resolve_words(words: list[str], key: str) -> dict[Callable, str]:
    """Callable → word for the selector's words; HookrunError for an unknown word."""
    out: dict[Callable, str] = {}
    for word in words:
        if word not in FUNCTIONS:
            hint = ", ".join(nearest(word, list(FUNCTIONS))) or ", ".join(FUNCTIONS)
            raise HookrunError(
                f"{key}: {word!r} is not a function hookrun intercepts; did you mean: {hint} "
                f"(valid: {', '.join(FUNCTIONS)})"
            )
        for func in FUNCTIONS[word]:
            out.setdefault(func, word)
    return out


def _builtin_leaf(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.nn.modules") and not any(module.children())


def is_inplace(func: Callable, kwargs: Mapping[str, Any]) -> bool:
    return func in _INPLACE or bool(kwargs.get("inplace", False))


# A call handler: (site name, func, args, kwargs) → the call's result.
Handler = Callable[[str, Callable, tuple, dict], Any]


def weights_of(model: nn.Module, layers: list[str]) -> dict[int, str]:
    """id(weight) → module name for the Linear / Conv modules among `layers`."""
    modules = dict(model.named_modules())
    return {
        id(modules[name].weight): name
        for name in layers
        if isinstance(modules[name], (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
    }


class CallSites(TorchFunctionMode):
    """Names the intercepted calls of one forward pass and hands them to `handler`."""

    def __init__(
        self, words: Mapping[Callable, str], weights: Mapping[int, str], handler: Handler
    ) -> None:
        super().__init__()
        self.words, self.weights, self.handler = words, weights, handler
        self.stack: list[tuple[str, bool]] = []  # (module name, built-in leaf) running now
        self.counts: defaultdict[str, int] = defaultdict(int)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        attention = func is F.multi_head_attention_forward and len(args) > _OUT_PROJ + 1
        if attention and id(args[_OUT_PROJ]) in self.weights:
            return self._attention(func, args, kwargs)
        if func in _WEIGHTED and len(args) > 1 and id(args[1]) in self.weights:
            return self.handler(self.weights[id(args[1])], func, args, kwargs)
        word = self.words.get(func)
        module, leaf = self.stack[-1] if self.stack else (ROOT, False)
        if word is None or leaf:
            return func(*args, **kwargs)
        base = f"{module}/{word}"
        k = self.counts[base]
        self.counts[base] += 1
        return self.handler(f"{base}.{k}", func, args, kwargs)

    def _attention(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """nn.MultiheadAttention whose out_proj is selected: out_proj is applied inside the
        fused F.multi_head_attention_forward, whose inner calls no mode is handed. So the
        fused function runs with an identity projection (x·I + 0 is x, exactly, for finite
        x), and out_proj is applied here as its own F.linear call — the selected site, on
        batch-first tokens (N, L, E) like every other site — then put back seq-first."""
        weight, bias = args[_OUT_PROJ], args[_OUT_PROJ + 1]
        inner = list(args)
        inner[_OUT_PROJ] = torch.eye(weight.shape[1], dtype=weight.dtype, device=weight.device)
        inner[_OUT_PROJ + 1] = None if bias is None else torch.zeros_like(bias)
        heads, attention = func(*inner, **kwargs)  # (L, N, E): the heads, concatenated
        batched = heads.dim() == 3
        tokens = heads.transpose(0, 1) if batched else heads
        out = self.handler(self.weights[id(weight)], F.linear, (tokens, weight, bias), {})
        return (out.transpose(0, 1) if batched else out), attention


@contextmanager
def watch_calls(model: nn.Module, mode: CallSites) -> Iterator[None]:
    """Keep `mode.stack` in step with the running modules, and make `mode` active during
    every forward pass of `model` (entered in the root's pre-hook, left in its hook)."""
    active: list[CallSites] = []

    def enter(name: str, leaf: bool):
        def hook(module: nn.Module, args: tuple) -> None:
            if not name:
                mode.counts.clear()
                mode.__enter__()
                active.append(mode)
            else:
                mode.stack.append((name, leaf))

        return hook

    def leave(name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not name:
                active.pop().__exit__(None, None, None)
            elif mode.stack:
                mode.stack.pop()

        return hook

    hooks = []
    for name, module in model.named_modules():
        hooks.append(ModuleHook(module, enter(name, _builtin_leaf(module)), before=True))
        hooks.append(ModuleHook(module, leave(name)))
    try:
        with hooked(hooks):
            yield
    finally:
        while active:  # a forward that raised never reached the root's forward hook
            active.pop().__exit__(None, None, None)
        mode.stack.clear()
