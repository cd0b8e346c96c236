"""The per-batch step of the hook runtime: one batch through the hooked model — a forward
pass, the backward passes its gradient hooks need — and the batch's records keyed by their
captures.h5 paths; and `BatchContext`, the same batch as a stage that runs passes of its own
sees it (the run's hooks standing aside)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hookrun.data.batch import Batch
from hookrun.data.loader import SourceFiles
from hookrun.io import layout
from hookrun.io.encoding import path_rows
from hookrun.models.adapter import adapt
from hookrun.runtime.hooks import Recorder, prepare_input
from hookrun.runtime.leaves import model_logits
from hookrun.runtime.plan import HookPlan
from hookrun.runtime.selectors import INPUT_LAYER
from hookrun.runtime.sites import Site
from hookrun.runtime.targets import TargetConfig, backward_seed, choose_targets, target_scores

__all__ = ["RowFacts", "BatchStep", "BatchContext"]


@dataclass(frozen=True)
class BatchContext:
    """One batch as a method with passes of its own sees it (the run's hooks stand aside)."""

    model: nn.Module  # eval mode, parameters frozen
    batch: Batch  # on the run's device, as the data loader gave it
    # (N,) int64 on the device: the class each sample is explained for; None where the step
    # made no forward (Plan.gives_output): the method's own forward gives them, by `choose`.
    targets: torch.Tensor | None
    # (output, targets) → (N,): each sample's score whose gradient is explained (the target
    # logit, or the sum of the outputs for target.kind=sum).
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # name → a generator seeded by (run seed, name, the batch's first row).
    generator: Callable[[str], torch.Generator]
    # What the gradient methods explain, when not `inputs`: a language model's input
    # embeddings (N, T, D), whose rows `forward` runs (token ids have no gradient).
    points: torch.Tensor | None = None
    # (points, sample) → the model's output for rows of points, row i being a copy or a
    # perturbation of batch row sample[i] (a language model reads that row's mask and read
    # marker); None: model(points).
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Where `targets` is None: the batch's output (N, ...) from the method's unperturbed
    # forward → the targets on the device, stored with that output as the step's would be.
    choose: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def inputs(self) -> torch.Tensor:
        """The model's input (N, ...), as the data loader gave it."""
        return self.batch.inputs

    def explained(self) -> torch.Tensor:
        """The input the gradient methods explain (N, ...): the batch, or its embeddings."""
        return self.inputs if self.points is None else self.points

    def run(self, points: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """The model on `points`, row i standing for batch row sample[i]."""
        return self.model(points) if self.forward is None else self.forward(points, sample)


@dataclass(frozen=True)
class RowFacts:
    """What the dataset says about each row beyond its tensor: whether its labels mean
    something (/samples/label) and, for file datasets, its source file (/samples/path)."""

    labelled: bool = False
    files: SourceFiles | None = None
    # Token data (data/tokens.py): the batch's token parts (data/batch.py); ids to
    # /samples/tokens, the attention mask to the hooks' `args.positions` and, where rows are
    # padded, to /samples/mask.
    tokens: bool = False
    padded: bool = False
    # target.kind=logit_diff: each dataset row's counterfactual answer token (by index).
    against: torch.Tensor | None = None


class BatchStep:
    """One batch through the hooked model: a forward pass, the backward passes gradient
    hooks need, and the batch's records keyed by their captures.h5 paths."""

    def __init__(
        self,
        model: nn.Module,
        plan: HookPlan,
        recorder: Recorder,
        target: TargetConfig,
        device: torch.device,
        facts: RowFacts,
        stage_forward: bool = False,
    ) -> None:
        self.model, self.plan, self.recorder = model, plan, recorder
        self.target, self.device, self.facts = target, device, facts
        # The run's first stage forwards each batch as the model does (Plan.gives_output):
        # where the run's hooks act on no forward, the batch's output is that pass's.
        self.stage_forward = stage_forward
        self.targets: torch.Tensor | None = None

    def _hooks_act(self, inputs: torch.Tensor) -> bool:
        """Whether the run's hooks act in a forward of `inputs`: a module or function site,
        a gradient, or the input pseudo-layer on a floating-point input (token ids have no
        value a hook acts on)."""
        plan = self.plan
        return bool(
            plan.layers
            or plan.needs_calls
            or plan.needs_backward
            or (inputs.is_floating_point() and plan.at(INPUT_LAYER, Site.output))
        )

    def __call__(self, loaded: Batch) -> dict[str, torch.Tensor | np.ndarray]:
        """The batch's records; the target class comes from this same forward pass (or from
        the first stage's, `stage_forward`)."""
        labels, index = loaded.labels, loaded.index
        recorder, plan = self.recorder, self.plan
        recorder.begin(int(index[0]))
        recorder.rows = index
        timer = recorder.timer
        batch = loaded.to(self.device)
        # Before any hook changed it: what a stage's passes start from.
        self.batch = batch
        inputs = batch.inputs
        recorder.mask = batch.mask
        self._labels, self._index = labels, index
        later = self.stage_forward and not self._hooks_act(inputs)
        if later:  # the output and the targets come with the stage's pass (`_chosen`)
            output = targets = None
        elif plan.needs_backward:
            with torch.enable_grad():
                with timer.stage("forward"):
                    inputs = prepare_input(plan, recorder, inputs)
                    output = model_logits(self.model(inputs))
                    targets = choose_targets(output, self.target, labels, self._against(index))
                    seed = backward_seed(output, targets, self.target.kind)
                with timer.stage("backward"):
                    self._backward(seed)
        else:
            with torch.inference_mode(), timer.stage("forward"):
                inputs = prepare_input(plan, recorder, inputs)
                output = model_logits(self.model(inputs))
                targets = choose_targets(output, self.target, labels, self._against(index))
        if output is not None:
            recorder.record(layout.MODEL_OUTPUT, output)
        self.targets = targets
        self.records = records = dict(recorder.records)
        records[layout.SAMPLES_INDEX] = index.to(torch.int64)
        if targets is not None:
            records.update(_target_records(targets))
        if self.facts.labelled:
            records[layout.SAMPLES_LABEL] = labels.to(torch.int64)
        files = self.facts.files
        if files is not None:
            records[layout.SAMPLES_PATH] = path_rows(files.of(index), files.width)
            if files.lines is not None:
                records[layout.SAMPLES_LINE] = files.lines_of(index)
        if loaded.tokens is not None:
            records[layout.SAMPLES_TOKENS] = loaded.tokens.to(torch.int32)
            if self.facts.padded:
                records[layout.SAMPLES_MASK] = loaded.mask.to(torch.bool)
        return records

    @property
    def inputs(self) -> torch.Tensor:
        """The last batch's input on the device, before any hook changed it."""
        return self.batch.inputs

    def _against(self, index: torch.Tensor) -> torch.Tensor | None:
        """The batch's counterfactual answers (target.kind=logit_diff), None otherwise."""
        against = self.facts.against
        return None if against is None else against[index.cpu()]

    def _chosen(self, output: torch.Tensor) -> torch.Tensor:
        """The targets of the last batch from its output, made by the first stage's forward
        (`stage_forward`); that output and the targets into the batch's records, as a
        forward of the step's own would have put them."""
        output = output.detach()
        targets = choose_targets(output, self.target, self._labels, self._against(self._index))
        self.recorder.record(layout.MODEL_OUTPUT, output)
        self.records[layout.MODEL_OUTPUT] = self.recorder.records[layout.MODEL_OUTPUT]
        self.records.update(_target_records(targets))
        self.targets = targets
        return targets.clone().to(self.device)

    def context(self) -> BatchContext:
        """The last batch, as a stage with passes of its own sees it (a language model's:
        its input embeddings, which the gradient methods explain)."""
        kind, recorder, device = self.target.kind, self.recorder, self.device
        points, forward = adapt(self.model).explained(self.batch)
        targets = self.targets
        return BatchContext(
            model=self.model,
            batch=self.batch,
            # A clone: targets chosen under inference_mode cannot take part in autograd.
            targets=None if targets is None else targets.clone().to(device),
            score=lambda output, targets: target_scores(output, targets, kind),
            generator=lambda name: recorder.generator(name, "input", device),
            points=points,
            forward=forward,
            choose=self._chosen if targets is None else None,
        )

    def _backward(self, seed: torch.Tensor) -> None:
        passes = self.plan.backward_passes
        recorder = self.recorder
        for i, name in enumerate(passes):
            recorder.current_pass = name
            if recorder.edges[name]:
                # Only the subgraph between the target and the hooked tensors runs.
                torch.autograd.grad(
                    seed, recorder.edges[name], allow_unused=True, retain_graph=i < len(passes) - 1
                )
        recorder.current_pass = None


def _target_records(targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch's targets as stored: (N,), and for logit_diff the token subtracted."""
    records = {layout.SAMPLES_TARGET: targets if targets.dim() == 1 else targets[:, 0]}
    if targets.dim() == 2:  # logit_diff: the token whose logit is subtracted
        records[layout.SAMPLES_COUNTER_TARGET] = targets[:, 1]
    return records
