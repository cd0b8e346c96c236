"""attach(plan, model): the plan's hooks registered on the model, and removed again.

How each site is hooked, and why:
- `input` / `output`: a forward pre-hook / forward hook that runs the actions and returns
  the changed tensors.
- `grad_output`: in the forward hook, a tensor hook on each output tensor. A tensor hook
  registered before a later in-place op (ReLU(inplace=True) after a conv) still receives
  the gradient w.r.t. the value the module produced (pytorch/pytorch#61519 is why
  `register_full_backward_hook` cannot be used here: it breaks next to in-place ops).
- `grad_input`: in the forward pre-hook, each input is replaced by a clone that only this
  module consumes, and the tensor hook goes on the clone. It therefore sees the gradient
  through this module alone (not through a residual branch that shares the input), and an
  in-place module modifies the clone, never the caller's tensor.
Each call of a module gets its own call index, so a module called twice per forward (the
ReLU of a torchvision BasicBlock) has its own gradient for each call.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from hookrun.io.layout import INPUT_GRAD, capture_key
from hookrun.io.sparse import SparseRows, sparsify
from hookrun.models.adapter import adapt
from hookrun.runtime.functions import CallSites, is_inplace, resolve_words, watch_calls, weights_of
from hookrun.runtime.handles import ModuleHook, hooked
from hookrun.runtime.interrupts import signal_checks
from hookrun.runtime.leaves import leaves, rebuild
from hookrun.runtime.plan import HookPlan, PlannedHook, acts_at_step, acts_on
from hookrun.runtime.positions import act_at
from hookrun.runtime.selectors import INPUT_LAYER
from hookrun.runtime.sites import Site
from hookrun.runtime.transfer import HostCopier
from hookrun.signals import deferred
from hookrun.timing import StageTimer

__all__ = ["Recorder", "attach", "hooks_kept", "prepare_input", "run_mode", "weights_kept"]


class Recorder:
    """Per-batch state the hooks write into: captured tensors, call counts, gradient edges."""

    def __init__(
        self,
        seed: int,
        store_dtype: torch.dtype,
        copier: HostCopier | None = None,
        timer: StageTimer | None = None,
        folds: dict[str, int] | None = None,
    ) -> None:
        self.seed = seed
        # Capture path → rows per sample for tensors not one row per sample (the shape probe,
        # runtime/shape_probe.py): k > 1 folded sample by sample, 0 no batch axis (stored as
        # one row per batch).
        self.folds = folds or {}
        self.store_dtype = store_dtype
        # Captures stored in another float (a hook's args.dtype): path → dtype.
        self.dtypes: dict[str, torch.dtype] = {}
        # Records stored sparse (Output.sparse: a dictionary's latents): their non-zeros only.
        self.sparse: frozenset[str] = frozenset()
        self.copier = copier or HostCopier()
        self.timer = timer or StageTimer(enabled=False)
        # True while a derived method runs passes of its own: every hook stands aside.
        self.paused = False
        # Captures a stage computes from as the run made them (stage.Plan.reads): kept for
        # the batch on their device in their dtype, where the host copy is not the same.
        self.keep: frozenset[str] = frozenset()
        # The decoding step of a generation's pass (0: the prompt's, and every other pass).
        self.step = 0
        self.begin(0)

    def begin(self, batch_start: int) -> None:
        """Start a batch whose first row is dataset position `batch_start`."""
        self.batch_start = batch_start
        self.rows = torch.zeros(0, dtype=torch.int64)  # the batch's dataset indices (runner)
        # Token data: the batch's attention mask (N, T), where `args.positions` count from.
        self.mask: torch.Tensor | None = None
        self.records: dict[str, torch.Tensor] = {}
        self.calls: defaultdict[str, int] = defaultdict(int)
        # Where each backward pass must reach: one edge per hooked gradient tensor.
        self.edges: defaultdict[str, list[GradientEdge]] = defaultdict(list)
        # The backward pass the runner is running; hooks of other passes stand aside.
        self.current_pass: str | None = None
        # Events of device → host copies still in flight (CUDA only).
        self.events: list = []
        self.kept: dict[str, torch.Tensor] = {}  # `keep`'s tensors of this batch

    def record(self, key: str, tensor: torch.Tensor) -> None:
        """Keep a CPU copy of `tensor` (floats in the store dtype) under `key`."""
        if key in self.records:
            raise RuntimeError(f"{key} captured twice in one batch")
        dtype = (
            self.dtypes.get(key, self.store_dtype) if tensor.is_floating_point() else tensor.dtype
        )
        if key in self.sparse:
            with self.timer.stage("copy"):
                self.records[key] = _host_sparse(sparsify(tensor.detach()), dtype)
            return
        fold = self.folds.get(key, 1)
        if fold != 1:
            tensor = tensor[None] if fold == 0 else tensor.reshape(-1, fold, *tensor.shape[1:])
        with self.timer.stage("copy"):
            self.records[key], event = self.copier.copy(tensor, dtype)
            if key in self.keep and (tensor.device.type != "cpu" or dtype != tensor.dtype):
                self.kept[key] = tensor.detach().clone()  # an in-place op after must not reach it
        if event is not None:
            self.events.append(event)

    def generator(self, hook: str, key: str, device: torch.device) -> torch.Generator:
        """A generator seeded by (run seed, hook, tensor, first row of the batch, and the
        decoding step after the first: generation draws anew at each step)."""
        step = f"|step{self.step}" if self.step else ""
        salt = zlib.crc32(f"{hook}|{key}|{self.batch_start}{step}".encode())
        return torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + salt)


def _host_sparse(rows: SparseRows, dtype: torch.dtype) -> SparseRows:
    """A batch's non-zeros on the host, values in the store float. A plain copy, not the
    pinned pool: their count changes every batch (a pool keyed by shape would only grow),
    and finding them already waited for the device."""
    return SparseRows(
        counts=rows.counts.to("cpu", torch.int32),
        values=rows.values.to("cpu", dtype),
        latent=rows.latent.to("cpu", torch.int32),
    )


class _Context:
    """The SiteContext one action sees: where its captures go, which generator it draws."""

    __slots__ = ("recorder", "hook", "key", "inputs")

    def __init__(
        self, recorder: Recorder, hook: str, key: str, inputs: torch.Tensor | None = None
    ) -> None:
        self.recorder, self.hook, self.key, self.inputs = recorder, hook, key, inputs

    def record(self, tensor: torch.Tensor, path: str | None = None) -> None:
        self.recorder.record(self.key if path is None else path, tensor)

    def generator(self, device: torch.device) -> torch.Generator:
        return self.recorder.generator(self.hook, self.key, device)

    def on_gradient(self, tensor: torch.Tensor, fn: Any) -> None:
        if not (torch.is_grad_enabled() and tensor.requires_grad):
            return  # a pass without gradients (a stage's own, a decoding step)
        recorder = self.recorder

        def seen(grad: torch.Tensor) -> None:
            if recorder.current_pass in (None, "main"):
                fn(grad)

        tensor.register_hook(seen)
        recorder.edges["main"].append(get_gradient_edge(tensor))

    @property
    def rows(self) -> torch.Tensor:
        return self.recorder.rows


def _apply(
    hooks: list[PlannedHook],
    tensor: torch.Tensor,
    recorder: Recorder,
    key: str,
    inputs: torch.Tensor | None = None,
) -> torch.Tensor:
    for hook in hooks:
        if acts_at_step(hook, recorder.step):
            ctx = _Context(recorder, hook.name, key, inputs)
            tensor = act_at(hook.action, tensor, ctx, recorder.mask)
    return tensor


def _hook_gradient(
    tensor: torch.Tensor, hooks: list[PlannedHook], recorder: Recorder, key: str
) -> None:
    """Run `hooks` on the gradient w.r.t. `tensor`'s current value during backward; each
    hook only in its own backward pass."""

    def on_gradient(grad: torch.Tensor) -> torch.Tensor:
        now = recorder.current_pass  # None: a plain .backward() outside the runner, all act
        active = [h for h in hooks if now is None or h.backward == now]
        return _apply(active, grad, recorder, key)

    tensor.register_hook(on_gradient)
    edge = get_gradient_edge(tensor)
    for name in dict.fromkeys(h.backward for h in hooks):
        recorder.edges[name].append(edge)


def _forward_site(
    layer: str,
    site: Site,
    hooks: list[PlannedHook],
    recorder: Recorder,
    value: Any,
    call: int,
    args: Any = None,
) -> Any:
    """Each floating-point leaf of `value` through the hooks that act on it (acts_on); at an
    output, `args` is the call's input (its first floating-point tensor: SiteContext.inputs)."""
    found = leaves(value)
    given = leaves(args) if args is not None else []
    inputs = given[0][1] if given else None
    new = {
        leaf: _apply(
            [h for h in hooks if acts_on(h, i)],
            t,
            recorder,
            capture_key(layer, site, call, leaf=leaf),
            inputs,
        )
        for i, (leaf, t) in enumerate(found)
    }
    return rebuild(value, new) if found else value


def _grad_input_clones(
    layer: str, call: int, args: Any, hooks: list[PlannedHook], recorder: Recorder
) -> Any:
    """`args` with each input that requires grad replaced by a clone only this site consumes,
    its gradient hooked: the gradient through this module (or call) alone, and an in-place
    op changes the clone, never the caller's tensor."""
    clones = {}
    for leaf, t in leaves(args):
        if t.requires_grad:
            clones[leaf] = t.clone()
            key = capture_key(layer, Site.grad_input, call, leaf=leaf)
            _hook_gradient(clones[leaf], hooks, recorder, key)
    return rebuild(args, clones)


def _hook_grad_outputs(
    layer: str, call: int, output: Any, hooks: list[PlannedHook], recorder: Recorder
) -> None:
    """Hook the gradient w.r.t. every output tensor that requires grad."""
    for leaf, t in leaves(output):
        if t.requires_grad:
            _hook_gradient(
                t, hooks, recorder, capture_key(layer, Site.grad_output, call, leaf=leaf)
            )


def _pre_hook(layer: str, plan: HookPlan, recorder: Recorder):
    on_input, on_grad = plan.at(layer, Site.input), plan.at(layer, Site.grad_input)

    def hook(module: nn.Module, args: tuple) -> tuple | None:
        if recorder.paused:
            return None
        call = recorder.calls[layer]
        recorder.calls[layer] += 1
        if on_input:
            args = _forward_site(layer, Site.input, on_input, recorder, args, call)
        if on_grad and torch.is_grad_enabled():
            args = _grad_input_clones(layer, call, args, on_grad, recorder)
        return args if (on_input or on_grad) else None

    return hook


def _post_hook(layer: str, plan: HookPlan, recorder: Recorder):
    on_output, on_grad = plan.at(layer, Site.output), plan.at(layer, Site.grad_output)

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if recorder.paused:
            return None
        call = recorder.calls[layer] - 1
        if on_output:
            output = _forward_site(layer, Site.output, on_output, recorder, output, call, args)
        if on_grad and torch.is_grad_enabled():
            _hook_grad_outputs(layer, call, output, on_grad, recorder)
        return output if on_output else None

    return hook


def _call_site(plan: HookPlan, recorder: Recorder):
    """The handler of intercepted calls: the plan's sites on one call, as a module's hooks
    would act (grad_input on clones of the inputs; an in-place call writes its result back
    into the caller's tensor, which then holds the hooked value)."""

    def handle(layer: str, func, args: tuple, kwargs: dict) -> Any:
        on_input, on_grad_in = plan.at(layer, Site.input), plan.at(layer, Site.grad_input)
        on_output, on_grad_out = plan.at(layer, Site.output), plan.at(layer, Site.grad_output)
        on_pattern = plan.at(layer, Site.pattern)  # an attention module's softmax call
        if recorder.paused or not (
            on_input or on_grad_in or on_output or on_grad_out or on_pattern
        ):
            return func(*args, **kwargs)  # paused: a derived method's own passes
        call = recorder.calls[layer]
        recorder.calls[layer] += 1
        original = args[0] if args else None
        if on_input:
            args = _forward_site(layer, Site.input, on_input, recorder, args, call)
        if on_grad_in and torch.is_grad_enabled():
            args = _grad_input_clones(layer, call, args, on_grad_in, recorder)
        output = func(*args, **kwargs)
        if on_output:
            output = _forward_site(layer, Site.output, on_output, recorder, output, call, args)
        if on_pattern:
            output = _forward_site(layer, Site.pattern, on_pattern, recorder, output, call)
        if on_grad_out and torch.is_grad_enabled():
            _hook_grad_outputs(layer, call, output, on_grad_out, recorder)
        if (
            is_inplace(func, kwargs)
            and isinstance(original, torch.Tensor)
            and output is not original
        ):
            return original.copy_(output)
        return output

    return handle


@contextmanager
def attach(plan: HookPlan, model: nn.Module, recorder: Recorder) -> Iterator[None]:
    """Register the plan's hooks on `model` (and, only when the plan has function or
    weight-used sites, the function mode); every handle is removed on exit, error or not."""
    modules = dict(model.named_modules())
    hooks: list[ModuleHook] = []
    start = adapt(model).graph_start() if plan.needs_backward else None
    if start is not None:
        # Token ids have no gradient: the graph starts at the embeddings' output (first, so
        # the plan's own hooks there see a tensor that has one).
        hooks.append(ModuleHook(start, _graph_start, prepend=True))
    for layer in plan.layers:
        if layer not in modules:
            continue  # a function call site, hooked through the mode
        module = modules[layer]
        hooks.append(ModuleHook(module, _pre_hook(layer, plan, recorder), before=True))
        if plan.at(layer, Site.output) or plan.at(layer, Site.grad_output):
            hooks.append(ModuleHook(module, _post_hook(layer, plan, recorder)))
    with ExitStack() as stack:
        if plan.needs_calls:
            words = resolve_words(list(plan.words), "select.function")
            weights = weights_of(model, list(plan.weighted))
            mode = CallSites(words, weights, _call_site(plan, recorder))
            stack.enter_context(watch_calls(model, mode))
        stack.enter_context(hooked(hooks))
        yield


# The hook tables of a module (torch keeps a hook in one, and flags about it in the others,
# all under the handle's id).
_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


@contextmanager
def hooks_kept(model: nn.Module | None) -> Iterator[None]:
    """The caller's `model` leaves with exactly the module hooks it came with: a safety net
    under every registration of the run (attach, and each stage's passes of its own),
    whatever path the run ended by."""
    if model is None:
        yield
        return
    before = {
        name: {table: set(getattr(m, table, {})) for table in _HOOK_TABLES}
        for name, m in model.named_modules()
    }
    marked = {name: vars(m).get(_INSTALLED, _ABSENT) for name, m in model.named_modules()}
    try:
        yield
    finally:
        with deferred():
            for name, m in model.named_modules():
                for table in _HOOK_TABLES:
                    hooks = getattr(m, table, None)
                    kept = before.get(name, {}).get(table, set())
                    for key in [k for k in hooks or {} if k not in kept]:
                        del hooks[key]
                _unmark(m, marked.get(name, _ABSENT))


# transformers (5.x) installs its own output-recording hooks the first time a model is asked
# for `output_attentions` (attention rollout's pass) and marks the model so it never installs
# them again: with the hooks removed above, the mark goes too, or the caller's model would
# return no attentions ever after.
_INSTALLED = "_output_capturing_hooks_installed"
_ABSENT = object()


def _unmark(module: nn.Module, was: object) -> None:
    if was is _ABSENT:
        vars(module).pop(_INSTALLED, None)
    else:
        vars(module)[_INSTALLED] = was


def _graph_start(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """The embeddings' output as a leaf that requires grad: parameters are frozen for the
    run, so this is what makes a graph exist on token data."""
    return output.detach().requires_grad_(True) if torch.is_grad_enabled() else output


def prepare_input(plan: HookPlan, recorder: Recorder, batch: torch.Tensor) -> torch.Tensor:
    """The model-input pseudo-layer: its `output` actions, and its gradient hook."""
    batch = _forward_site(
        INPUT_LAYER, Site.output, plan.at(INPUT_LAYER, Site.output), recorder, batch, 0
    )
    if plan.needs_backward and batch.is_floating_point():  # token ids: _graph_start
        # Parameters are frozen for the run, so the input is what makes a graph exist.
        batch = batch.detach().requires_grad_(True)
        on_grad = plan.at(INPUT_LAYER, Site.grad_output)
        if on_grad:
            _hook_gradient(batch, on_grad, recorder, INPUT_GRAD)
    return batch


@contextmanager
def run_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode with frozen parameters for the run, and a signal's check in every backward
    pass (runtime/interrupts.py); each module's and parameter's flag is put back on exit
    exactly as it was."""
    training = {name: m.training for name, m in model.named_modules()}
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    # A language model's wrapped root is not one of its modules (its children are), but
    # eval() reaches it: its flag is kept beside theirs.
    roots = {root: root.training for root in adapt(model).roots()}
    try:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)  # backward then computes no parameter gradients
        with signal_checks(model):  # every pass of the run's model is under run_mode
            yield
    finally:
        with deferred():
            for name, m in model.named_modules():
                m.training = training[name]
            for root, flag in roots.items():
                root.training = flag
            for name, p in model.named_parameters():
                # A mapped model's offloaded weights are remade by Accelerate at each
                # forward (under inference mode in a no-gradient pass): flags are set there.
                with torch.inference_mode() if p.is_inference() else nullcontext():
                    p.requires_grad_(grads.get(name, p.requires_grad))


@contextmanager
def weights_kept(model: nn.Module) -> Iterator[None]:
    """The model's parameters and buffers exactly as they came in when the block ends, by
    any exit (a copy of the state dict, loaded back)."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        yield
    finally:
        with deferred(), torch.no_grad():  # a signal waits until the weights are back
            model.load_state_dict(saved)
