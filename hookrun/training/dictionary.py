"""The math of training one sparse dictionary, step for step as SAELens 6.54's SAETrainer.

`Trainer` owns one dictionary's parameters, its Adam state, the schedules and the firing
counters, and `Trainer.step` is one SAELens training step on one batch: what SAELens's
`SAETrainer._train_step` does around its training SAE's `training_forward_pass`.

What SAELens 6.54 does, and so what is done here:

- init: W_dec [d_sae, d_out] kaiming-uniform, each row scaled to norm `decoder_init_norm`
  (0.1), W_enc = W_dec^T, b_enc = b_dec = 0 (`TrainingSAE.initialize_weights`); JumpReLU's
  threshold starts at `jumprelu_init_threshold`, kept in float32. SAELens trains no
  transcoders: here a transcoder's W_enc is drawn on its own (its input is another space),
  as SAELens's inference `Transcoder` initialises it, then scaled like the decoder.
- input: x times `scale` (expected_average_only_in's factor), b_dec subtracted where
  `apply_b_dec_to_input` (every SAE; never a transcoder).
- relu ("standard"): loss = mse + l1 * mean over tokens of sum_i z_i ||W_dec_i||, the l1
  coefficient warmed up linearly from 0 over `l1_warmup_steps`.
- topk: pre-activations times each decoder row's norm (`rescale_acts_by_decoder_norm`,
  True in training), the k largest relu'd, decoded divided by that norm; AuxK: when latents
  are dead, the top min(d/2, n_dead) dead pre-activations reconstruct the detached residual
  through W_dec (no bias), weighted by `aux_k_coefficient` * min(n_dead / (d/2), 1).
- batchtopk: the k * B largest relu'd pre-activations of the whole batch; a threshold, the
  running average (rate 0.01, float64) of each batch's smallest positive activation, saved
  as a JumpReLU's threshold.
- matryoshka_batchtopk: batchtopk plus each inner prefix's own reconstruction loss.
- jumprelu: z = pre * (pre > threshold), the threshold clamped at 0 before each step; the
  "step" L0 loss (DeepMind's: l0 * mean count of pre > threshold), both through the
  rectangle straight-through estimator of width `jumprelu_bandwidth` into the threshold
  only (`jumprelu_ste_to_input` False).
- the step: loss backward, gradients clipped to total norm 1.0, Adam (torch's, eps 1e-8),
  then the schedules advance; lr: linear warm-up (step t at (t+1)/warmup of lr), constant,
  linear decay to 0 over the last `lr_decay_steps` (SAELens's "constant" scheduler).
- firing: a latent fires on a token where its activation is non-zero; one not fired for
  more than `dead_tokens` tokens is dead (SAELens counts steps: dead_feature_window * batch
  tokens); the density window restarts every `feature_sampling_window` steps, and
  sparsity.safetensors holds log10(density + 1e-10) over the current window.
- saving (`save_inference_model`): expected_average_only_in's factor folded into the weights,
  a topk-like's decoder norms folded into the encoder, batchtopk's threshold as JumpReLU's.

Where hookrun computes the same quantity another way, for speed (the sums round
differently, the math is equal): b_dec's product with W_enc is subtracted after the big
matmul instead of from every token (no gradient through the tokens), topk's norms are
folded into the encoder and decoder matrices rather than into every activation, topk
decodes from its k (index, value) pairs (`embedding_bag`), relu's L1 is the latents'
column sums times the norms, and a matryoshka's full reconstruction is its last prefix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from hookrun.dictionaries.dictionary import Dictionary
from hookrun.training import gradients

if TYPE_CHECKING:
    from hookrun.training.parallel import Ranks

__all__ = ["ARCHITECTURES", "SAELENS_VERSION", "Hyper", "Trainer"]

ARCHITECTURES = ("relu", "topk", "batchtopk", "jumprelu", "matryoshka_batchtopk")
SAELENS_VERSION = "6.54.0"  # the version whose training this repeats and whose format it writes
_TOPKS = ("topk", "batchtopk", "matryoshka_batchtopk")
_BATCH_TOPKS = ("batchtopk", "matryoshka_batchtopk")
# SAELens's names: the training class's, and the inference class a saved folder loads as.
_TRAINING_NAMES = {"relu": "standard"}
_SAE_NAMES = {
    "relu": "standard",
    "topk": "topk",
    "batchtopk": "jumprelu",
    "jumprelu": "jumprelu",
    "matryoshka_batchtopk": "jumprelu",
}
_EPS_SPARSITY = 1e-10  # SAELens's _log_feature_sparsity


@dataclass(frozen=True)
class Hyper:
    """One dictionary's hyperparameters (validated by the config that builds it).

    Defaults are SAELens 6.54's. `dead_tokens` is SAELens's dead_feature_window (steps)
    times the batch; `feature_sampling_window` stays in steps, as SAELens counts it.
    """

    architecture: str  # one of ARCHITECTURES
    d_in: int
    d_out: int  # d_in for an SAE; a transcoder's target width
    width: int  # d_sae
    k: int | float | None = None  # topk (int), batchtopk / matryoshka (mean per token)
    l1_coefficient: float = 1.0  # StandardTrainingSAEConfig's default
    l1_warmup_steps: int = 0
    l0_coefficient: float = 1.0
    jumprelu_bandwidth: float = 0.05
    jumprelu_init_threshold: float = 0.01
    aux_k_coefficient: float = 1.0  # TopKTrainingSAEConfig.aux_loss_coefficient
    dead_tokens: int = 10_000_000
    feature_sampling_window: int = 2000  # steps
    matryoshka_widths: tuple[int, ...] = ()
    topk_threshold_lr: float = 0.01
    rescale_acts_by_decoder_norm: bool = True  # topk-likes (SAELens's training default)
    lr: float = 3e-4
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 0
    total_steps: int = 1
    adam_betas: tuple[float, float] = (0.9, 0.999)
    decoder_init_norm: float = 0.1
    skip: bool = False
    transcoder: bool = False
    apply_b_dec_to_input: bool | None = None  # None: SAELens's (True; False a transcoder)
    scale: float = 1.0

    @property
    def b_dec_in(self) -> bool:
        """Whether b_dec is subtracted from the input (SAELens's default where None)."""
        if self.apply_b_dec_to_input is None:
            return not self.transcoder
        return self.apply_b_dec_to_input


def _check(h: Hyper) -> None:
    """What the math below relies on; the config refuses these first, with its key names."""
    if h.architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {h.architecture!r}; valid: {', '.join(ARCHITECTURES)}")
    if h.architecture in _TOPKS and not (h.k and 0 < h.k <= h.width):
        raise ValueError(f"{h.architecture}: k is {h.k!r}; valid: 0 < k <= width ({h.width})")
    if h.transcoder and h.b_dec_in:
        raise ValueError("a transcoder subtracts no b_dec from its input (b_dec is d_out wide)")
    if not h.transcoder and (h.skip or h.d_out != h.d_in):
        raise ValueError("an SAE has d_out == d_in and no skip connection")
    if h.transcoder and h.architecture == "topk":
        raise ValueError("SAELens 6.54 has no topk transcoder to save as; valid: relu, jumprelu")
    if h.architecture == "matryoshka_batchtopk":
        w = h.matryoshka_widths
        if not w or w[-1] != h.width or any(b <= a for a, b in zip(w, w[1:], strict=False)):
            raise ValueError(f"matryoshka_widths {w}; valid: increasing, the last == {h.width}")
    if h.lr_warmup_steps + h.lr_decay_steps > h.total_steps:
        raise ValueError("lr_warmup_steps + lr_decay_steps exceed total_steps")


def lr_factor(h: Hyper, step: int) -> float:
    """The lr multiplier of step `step` (0-based), as SAELens's "constant" scheduler gives it.

    SAELens chains torch's LinearLR(1/W -> 1 over W - 1 steps), a constant, and
    LinearLR(1 -> 0 over D steps) from step T - D; the optimizer steps before the scheduler.
    """
    if h.lr_warmup_steps > 0 and step < h.lr_warmup_steps:
        return (step + 1) / h.lr_warmup_steps
    start = h.total_steps - h.lr_decay_steps
    if h.lr_decay_steps > 0 and step >= start:
        return max(0.0, 1.0 - (step - start) / h.lr_decay_steps)
    return 1.0


def warmup_coefficient(value: float, warmup: int, step: int) -> float:
    """SAELens's CoefficientScheduler: `value` * min(step / warmup, 1) at step `step`."""
    return value if warmup <= 0 else value * min(step / warmup, 1.0)


@dataclass
class _Forward:
    """One training forward pass: what the loss, the counters and the metrics need."""

    out: Tensor  # the reconstruction (B, d_out)
    loss: Tensor
    losses: dict[str, Tensor]
    fired: Tensor  # per latent, how many tokens it fired on this batch (S,), int64
    l0: Tensor  # mean active latents per token (a 0-d tensor)


class Trainer:
    """One sparse dictionary in training: its parameters, Adam, schedules and counters.

    Args:
        hyper: its hyperparameters.
        generator: the only randomness: the initial weights are drawn from it (on the CPU,
            then moved), so the same generator state gives the same dictionary anywhere.
        device: where it trains.
        dtype: its parameters' dtype (JumpReLU's threshold stays float32, as SAELens's).
        autocast: the forward's compute dtype under torch.autocast (SAELens's `autocast`:
            bfloat16 or float16 matmuls, the parameters, Adam and the counters in `dtype`);
            None: `dtype` throughout.
        ranks: data parallel under torchrun (training/parallel.py): each step's `x` is this
            rank's slice of the global batch, and the step is the one-process step on the
            whole batch (gradients, firing counts, batchtopk's selection, the metrics
            reduced over the ranks). None: one process.
    """

    def __init__(
        self,
        hyper: Hyper,
        generator: torch.Generator,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        autocast: torch.dtype | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        _check(hyper)
        self.autocast, self.ranks = autocast, ranks
        self.hyper = h = hyper
        self.device = torch.device(device)
        self.dtype = dtype
        self.params = {n: torch.nn.Parameter(t) for n, t in self._init(generator).items()}
        # SAELens's parameter order (b_dec, W_dec, W_enc, b_enc, threshold): the clipped
        # total norm sums them in this order.
        # torch's fused Adam: the same update as SAELens's (the default, one tensor at a
        # time, several passes per tensor on the CPU) in one pass, many times faster there.
        self.optimizer = torch.optim.Adam(
            list(self.params.values()), lr=h.lr, betas=tuple(h.adam_betas), fused=True
        )
        self.n_steps = 0
        self.n_tokens = 0
        s = h.width
        self.tokens_since_fired = torch.zeros(s, dtype=torch.int64, device=self.device)
        self.fired_counts = torch.zeros(s, dtype=torch.int64, device=self.device)
        self.window_tokens = 0  # tokens in the current density window
        # batchtopk's running threshold; float64 as SAELens keeps it
        self.topk_threshold = torch.zeros((), dtype=torch.float64, device=self.device)
        self.scratch = gradients.Scratch()  # relu's B x S buffers, the same every step

    # -- parameters ---------------------------------------------------------------------

    def _init(self, g: torch.Generator) -> dict[str, Tensor]:
        h = self.hyper

        def rows(n: int, d: int) -> Tensor:
            # nn.init.kaiming_uniform_ on [n, d] (fan_in d, gain sqrt(2)), then each row to
            # decoder_init_norm: the same draws as SAELens's from the same generator state.
            bound = math.sqrt(2.0) * math.sqrt(3.0 / d)
            w = torch.empty(n, d).uniform_(-bound, bound, generator=g)
            return w / w.norm(dim=-1, keepdim=True) * h.decoder_init_norm

        w_dec = rows(h.width, h.d_out)
        w_enc = rows(h.width, h.d_in).T if h.transcoder else w_dec.T
        out = {
            "b_dec": torch.zeros(h.d_out),
            "W_dec": w_dec,
            "W_enc": w_enc.contiguous(),
            "b_enc": torch.zeros(h.width),
        }
        out = {n: t.to(self.device, self.dtype) for n, t in out.items()}
        if h.architecture == "jumprelu":
            out["threshold"] = torch.full(
                (h.width,), h.jumprelu_init_threshold, dtype=torch.float32, device=self.device
            )
        if h.skip:
            out["W_skip"] = torch.zeros(h.d_out, h.d_in, dtype=self.dtype, device=self.device)
        return out

    # -- one step -----------------------------------------------------------------------

    def step(
        self, x: Tensor, target: Tensor | None = None, metrics: bool = True
    ) -> dict[str, float]:
        """One optimizer step on the batch `x` (B, d_in); `target` (B, d_out) a transcoder's.

        Args:
            x: the batch, raw (scaled by `hyper.scale` here).
            target: a transcoder's target; None for an SAE (x is its target).
            metrics: compute the step's metrics (False: {} and no host sync beyond AuxK's
                count of dead latents).

        Returns:
            The step's metrics as floats: loss, mse (sum over dims, mean over tokens, as
            SAELens's mse_loss), the architecture's losses (l1, aux, l0_loss, inner_mse_<w>),
            l0, explained_variance (1 - mean l2 / mean variance) and its legacy per-token
            mean, lr, the coefficient in use (l1_coefficient, l0_coefficient), dead (the
            fraction of dead latents), topk_threshold (batchtopk-likes).
        """
        h = self.hyper
        if (self.n_steps + 1) % h.feature_sampling_window == 0:
            # SAELens resets the density window at the top of every window's last step
            self.fired_counts.zero_()
            self.window_tokens = 0
        x = self._scaled(x, h.d_in)
        y = x if not h.transcoder else self._scaled(target, h.d_out)
        dead = self.tokens_since_fired > h.dead_tokens
        if h.architecture == "jumprelu":
            with torch.no_grad():
                self.params["threshold"].clamp_(min=0.0)
        if self.autocast is None:
            fwd = self._forward(x, y, dead)
        else:
            with torch.autocast(self.device.type, dtype=self.autocast):
                fwd = self._forward(x, y, dead)
        ranks, b = self.ranks, x.shape[0]
        total = b if ranks is None else b * ranks.size  # the global batch
        params = list(self.params.values())
        fired = fwd.fired
        if ranks is None:
            fwd.loss.backward()
        else:
            # Every term is a mean over this rank's tokens (batchtopk's selection and AuxK's
            # dead latents are the whole batch's): times b / total, the gradients summed
            # over the ranks are those of the mean over the global batch. The firing
            # counts are summed in the same collective.
            (fwd.loss * (b / total)).backward()
            fired = ranks.sum_grads(params, fired, total)
        with torch.no_grad():
            self.tokens_since_fired += total
            self.tokens_since_fired.masked_fill_(fired > 0, 0)
            self.fired_counts += fired
            self.window_tokens += total
            self.n_tokens += total
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        lr = h.lr * lr_factor(h, self.n_steps)
        self.optimizer.param_groups[0]["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.n_steps += 1
        if not metrics:
            return {}
        return self._metrics(fwd, x, y, lr)

    def _scaled(self, t: Tensor | None, width: int) -> Tensor:
        if t is None:
            raise ValueError("a transcoder's step needs its target")
        if t.ndim != 2 or t.shape[1] != width:
            raise ValueError(f"a batch of shape {tuple(t.shape)}; valid: (B, {width})")
        t = t.to(self.device, self.dtype)
        return t * self.hyper.scale if self.hyper.scale != 1.0 else t

    def _pre(self, x: Tensor, w_enc: Tensor, b_enc: Tensor) -> Tensor:
        """(x - b_dec) W_enc + b_enc, the b_dec product taken once, not per token."""
        if self.hyper.b_dec_in:
            b_enc = b_enc - self.params["b_dec"] @ w_enc
        return torch.addmm(b_enc, x, w_enc)

    def _skip(self, out: Tensor, x: Tensor) -> Tensor:
        return out + x @ self.params["W_skip"].T if self.hyper.skip else out

    def _forward(self, x: Tensor, y: Tensor, dead: Tensor) -> _Forward:
        h, p = self.hyper, self.params
        b = x.shape[0]
        losses: dict[str, Tensor] = {}
        if h.architecture == "relu":
            core, l1, fired = gradients.ReluCode.apply(
                x, p["W_enc"], p["b_enc"], p["W_dec"], p["b_dec"], h.b_dec_in, self.scratch
            )
            out = self._skip(core, x)
            mse = (out - y).pow(2).sum(-1).mean()
            coeff = warmup_coefficient(h.l1_coefficient, h.l1_warmup_steps, self.n_steps)
            # mean over tokens of sum_i z_i ||W_dec_i|| (z >= 0: SAELens's L1 norm)
            losses["l1"] = coeff * l1 / b
            l0 = fired.sum() / b
        elif h.architecture == "jumprelu":
            pre = self._pre(x, p["W_enc"], p["b_enc"])
            z = gradients.JumpReLU.apply(pre, p["threshold"].to(pre.dtype), h.jumprelu_bandwidth)
            out = self._skip(torch.addmm(p["b_dec"], z, p["W_dec"]), x)
            mse = (out - y).pow(2).sum(-1).mean()
            coeff = warmup_coefficient(h.l0_coefficient, 0, self.n_steps)
            gate = gradients.Step.apply(pre, p["threshold"].to(pre.dtype), h.jumprelu_bandwidth)
            losses["l0_loss"] = (coeff * gate.sum(-1)).mean()
            fired = torch.count_nonzero(z, dim=0)
            l0 = fired.sum() / b
        else:
            out, mse, fired, l0 = self._topk_forward(x, y, dead, losses)
        loss = mse
        for value in losses.values():
            loss = loss + value
        return _Forward(out, loss, {"mse": mse, **losses}, fired, l0)

    def _topk_forward(
        self, x: Tensor, y: Tensor, dead: Tensor, losses: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        h, p = self.hyper, self.params
        b, s = x.shape[0], h.width
        w_enc, b_enc, w_dec = p["W_enc"], p["b_enc"], p["W_dec"]
        if h.rescale_acts_by_decoder_norm:
            # pre * ||W_dec_i|| and z / ||W_dec_i||, folded into the matrices (S x d work,
            # not B x S); the gradient reaches W_dec's norms through both, as SAELens's.
            norm = w_dec.norm(dim=-1)
            w_enc, b_enc, w_dec = w_enc * norm, b_enc * norm, w_dec * (1 / norm)[:, None]
        hp = self._pre(x, w_enc, b_enc)
        if h.architecture == "topk":
            values, idx = hp.topk(int(h.k), dim=-1, sorted=False)
            z = values.relu()
            # sum_j z_bj W_dec[idx_bj]: B k d work instead of B S d, both ways
            # (under autocast the latents come in its dtype: the decoder is taken in it too)
            out = F.embedding_bag(idx, w_dec.to(z.dtype), per_sample_weights=z, mode="sum")
            out = out + p["b_dec"]
            live = z != 0
            fired = torch.zeros(s, dtype=torch.int64, device=x.device)
            fired.index_add_(0, idx.flatten(), live.flatten().to(torch.int64))
            l0 = live.sum() / b
        else:
            flat = hp.relu().flatten()
            values, idx = self._batch_topk(flat, int(h.k * b))
            z = torch.zeros_like(flat).scatter(-1, idx, values).view(b, s)
            active = z != 0
            fired = active.sum(0)
            l0 = fired.sum() / b
            with torch.no_grad():
                smallest = self._smallest_positive(values)
                if smallest is not None:
                    lr = h.topk_threshold_lr
                    self.topk_threshold = (1 - lr) * self.topk_threshold + lr * smallest.to(
                        torch.float64
                    )
            if h.architecture == "batchtopk":
                out = torch.addmm(p["b_dec"], z, w_dec)
            else:
                # each prefix's reconstruction adds its block to the one before; the last
                # is the full one (SAELens decodes that once more, whole)
                decoded, start = p["b_dec"], 0
                for width in h.matryoshka_widths:
                    decoded = torch.addmm(decoded, z[:, start:width], w_dec[start:width])
                    if width != h.width:
                        losses[f"inner_mse_{width}"] = (decoded - y).pow(2).sum(-1).mean()
                    start = width
                out = decoded
        out = self._skip(out, x)
        mse = (out - y).pow(2).sum(-1).mean()
        losses["aux"] = self._aux_k(y, out, hp, w_dec, dead)
        return out, mse, fired, l0

    def _batch_topk(self, flat: Tensor, per_rank: int) -> tuple[Tensor, Tensor]:
        """The whole batch's `per_rank` * ranks largest of `flat` that are this rank's:
        their values and indices in `flat` (one process: flat.topk).

        Each rank's largest `count` hold every one of the global `count` largest that are
        its own: gathered, their `count`-th largest is the cut, and a rank keeps its own at
        or above it (a tie at the cut keeps both; between floats, a tie is a rounding's).
        """
        if self.ranks is None:
            return flat.topk(per_rank, dim=-1)
        count = per_rank * self.ranks.size
        values, idx = flat.topk(min(count, flat.numel()), dim=-1)  # sorted, largest first
        every = self.ranks.gather(values)
        cut = every.topk(min(count, every.numel()), dim=-1).values[-1]
        kept = int((values >= cut).sum())
        return values[:kept], idx[:kept]

    def _smallest_positive(self, values: Tensor) -> Tensor | None:
        """The smallest positive of `values`, over every rank's; None where there is none."""
        positive = values[values > 0]
        if self.ranks is None:
            return positive.min() if positive.numel() > 0 else None
        least = positive.min() if positive.numel() > 0 else values.new_tensor(torch.inf)
        least = self.ranks.min_(least.reshape(1).clone())[0]
        return least if torch.isfinite(least) else None

    def _aux_k(self, y: Tensor, out: Tensor, hp: Tensor, w_dec: Tensor, dead: Tensor) -> Tensor:
        """SAELens's AuxK loss (TopKTrainingSAE.calculate_topk_aux_loss)."""
        n_dead = int(dead.sum())  # a host sync, as SAELens's: k_aux depends on it
        if n_dead == 0:
            return out.new_zeros(())
        k_aux = y.shape[-1] // 2
        scale = min(n_dead / k_aux, 1.0)
        k_aux = min(k_aux, n_dead)
        residual = (y - out).detach()
        values, idx = torch.where(dead[None], hp, -torch.inf).topk(k_aux, sorted=False)
        recons = F.embedding_bag(idx, w_dec.to(values.dtype), per_sample_weights=values, mode="sum")
        return self.hyper.aux_k_coefficient * scale * (recons - residual).pow(2).sum(-1).mean()

    @torch.no_grad()
    def _metrics(self, fwd: _Forward, x: Tensor, y: Tensor, lr: float) -> dict[str, float]:
        h = self.hyper
        y = y.to(torch.promote_types(y.dtype, torch.float32))
        l2 = (fwd.out.detach() - y).pow(2).sum(-1)
        names = ["loss", *fwd.losses, "l0", "explained_variance", "explained_variance_legacy"]
        values = [fwd.loss.detach(), *(v.detach() for v in fwd.losses.values()), fwd.l0]
        if self.ranks is None:
            var = (y - y.mean(0)).pow(2).sum(-1)
            values += [1 - l2.mean() / var.mean(), (1 - l2 / var).mean()]
        else:
            values = self._global_means(values, l2, y)
        names.append("dead")
        values.append((self.tokens_since_fired > h.dead_tokens).float().mean())
        if h.architecture in _BATCH_TOPKS:
            names.append("topk_threshold")
            values.append(self.topk_threshold)
        # one transfer for all of them
        floats = torch.stack([v.to(torch.float64) for v in values]).tolist()
        result = dict(zip(names, floats, strict=True))
        result["lr"] = lr
        if h.architecture == "relu":
            result["l1_coefficient"] = warmup_coefficient(
                h.l1_coefficient, h.l1_warmup_steps, self.n_steps - 1
            )
        if h.architecture == "jumprelu":
            result["l0_coefficient"] = h.l0_coefficient
        return result

    def _global_means(self, means: list[Tensor], l2: Tensor, y: Tensor) -> list[Tensor]:
        """This rank's means over its tokens as the whole batch's, and the explained
        variances over the whole batch (the variance about the whole batch's mean)."""
        ranks, b = self.ranks, y.shape[0]
        total = b * ranks.size
        mean_y = ranks.sum_(y.sum(0, dtype=torch.float64)) / total
        var = (y.to(torch.float64) - mean_y).pow(2).sum(-1)
        sums = torch.stack([m.to(torch.float64) * b for m in means])
        sums = torch.cat([sums, torch.stack([l2.sum(dtype=torch.float64), var.sum()])])
        sums = torch.cat([sums, (1 - l2 / var).sum().reshape(1)])
        got = ranks.sum_(sums) / total
        n = len(means)
        return [*got[:n], 1 - got[n] / got[n + 1], got[n + 2]]

    # -- the saved dictionary -----------------------------------------------------------

    @torch.no_grad()
    def inference_tensors(self) -> dict[str, Tensor]:
        """The tensors SAELens's save_inference_model writes after `fit` (copies, on CPU).

        The scale folded in (W_enc * s, W_dec / s, b_dec / s), then for topk-likes the
        decoder norms (b_enc and W_enc times them, W_dec rows to norm 1), batchtopk's
        threshold as a JumpReLU's, a skip transcoder's W_skip [d_out, d_in].
        """
        h = self.hyper
        t = {n: v.detach().clone() for n, v in self.params.items()}
        s = h.scale
        if s != 1.0:
            t["W_enc"], t["W_dec"], t["b_dec"] = t["W_enc"] * s, t["W_dec"] / s, t["b_dec"] / s
        if h.architecture in _TOPKS and h.rescale_acts_by_decoder_norm:
            norm = t["W_dec"].norm(dim=-1).clamp(min=1e-8)
            t["b_enc"], t["W_dec"] = t["b_enc"] * norm, t["W_dec"] / norm[:, None]
            t["W_enc"] = t["W_enc"] * norm[None, :]
        if h.architecture in _BATCH_TOPKS:
            threshold = self.topk_threshold.item()
            if h.rescale_acts_by_decoder_norm:
                # the folded pre-activations are the training ones / s; SAELens 6.54 keeps
                # the training threshold unscaled, which fires other latents when s != 1
                threshold = threshold / s
            t["threshold"] = torch.ones_like(t["b_enc"]) * threshold
        return {n: v.to("cpu").contiguous() for n, v in t.items()}

    def dictionary(self) -> Dictionary:
        """The dictionary as saved, in memory (hookrun's, whose math is SAELens's)."""
        h = self.hyper
        arch = _SAE_NAMES[h.architecture]
        tensors = {n: v.to(self.device) for n, v in self.inference_tensors().items()}
        if "W_skip" in tensors:
            tensors["W_skip"] = tensors["W_skip"].T  # hookrun keeps x @ W_skip's layout
        return Dictionary(
            name="training",
            architecture={"standard": "standard", "topk": "topk"}.get(arch, "jumprelu"),
            d_in=h.d_in,
            d_sae=h.width,
            d_out=h.d_out,
            transcoder=h.transcoder,
            hook_name=None,
            hook_name_out=None,
            k=int(h.k) if h.architecture == "topk" else None,
            apply_b_dec_to_input=h.b_dec_in,
            normalize="none",
            scaling_factor=None,
            tensors=tensors,
            source=Path(),
            sha256="",
            rescale_acts_by_decoder_norm=h.architecture == "topk"
            and h.rescale_acts_by_decoder_norm,
        )

    @torch.no_grad()
    def encode(self, x: Tensor) -> Tensor:
        """The latents of raw `x` as the saved dictionary computes them (batchtopk: its
        threshold, as the JumpReLU it is saved as)."""
        return self.dictionary().encode(x.to(self.device))

    @torch.no_grad()
    def decode(self, z: Tensor, x: Tensor | None = None) -> Tensor:
        """The saved dictionary's reconstruction of latents `z` (x: a skip transcoder's)."""
        return self.dictionary().decode(z, None if x is None else x.to(self.device))

    @property
    def feature_density(self) -> Tensor:
        """Each latent's firing fraction over the current density window (SAELens's)."""
        return self.fired_counts.to(torch.float32) / max(self.window_tokens, 1)

    def _cfg(self, hook_name: str, extra: dict[str, Any]) -> dict[str, Any]:
        h = self.hyper
        arch = _SAE_NAMES[h.architecture]
        if h.transcoder:
            arch = ("jumprelu_" if arch == "jumprelu" else "") + (
                "skip_transcoder" if h.skip else "transcoder"
            )
        training_arch = _TRAINING_NAMES.get(h.architecture, h.architecture)
        details = {
            n: v for n, v in dataclasses.asdict(h).items() if n not in ("d_in", "d_out", "width")
        }
        density = self.feature_density
        metadata = {
            **extra,
            "hook_name": hook_name,
            "sae_lens_training_version": f"hookrun (SAELens {SAELENS_VERSION} semantics)",
            "training_architecture": training_arch,
            "training_architecture_details": details,
            "n_training_steps": self.n_steps,
            "n_training_tokens": self.n_tokens,
        }
        if self.window_tokens > 0:
            metadata["l0"] = density.sum().item()
            metadata["num_dead_features"] = int((self.tokens_since_fired > h.dead_tokens).sum())
        cfg: dict[str, Any] = {
            "architecture": arch,
            "d_in": h.d_in,
            "d_sae": h.width,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": "cpu",
            "apply_b_dec_to_input": h.b_dec_in,
            "normalize_activations": "none",  # the scale is folded into the weights
            "reshape_activations": "none",
            "metadata": metadata,
        }
        if h.transcoder:
            cfg["d_out"] = h.d_out
        if arch == "topk":
            cfg["k"] = int(h.k)
            cfg["rescale_acts_by_decoder_norm"] = h.rescale_acts_by_decoder_norm
        return cfg

    def save(self, folder: Path, hook_name: str, extra_metadata: dict[str, Any]) -> None:
        """Write the dictionary as SAELens 6.54's training writes its final one.

        cfg.json, sae_weights.safetensors and sparsity.safetensors (log10 feature density),
        written into a temporary folder beside `folder`, then renamed to it: `folder` is
        never half written (one that exists is replaced whole).

        Args:
            folder: the folder to write.
            hook_name: the TransformerLens hook it reads (metadata.hook_name).
            extra_metadata: more metadata keys (model_name, hook_name_out, ...).
        """
        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            save_file(self.inference_tensors(), str(tmp / "sae_weights.safetensors"))
            sparsity = torch.log10(self.feature_density + _EPS_SPARSITY).cpu()
            save_file({"sparsity": sparsity}, str(tmp / "sparsity.safetensors"))
            (tmp / "cfg.json").write_text(json.dumps(self._cfg(hook_name, extra_metadata)))
            if folder.exists():
                old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
                os.replace(folder, old)
                os.replace(tmp, folder)
                shutil.rmtree(old)
            else:
                os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # -- resuming -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything to continue bit for bit (copies: training on does not change it)."""
        opt = self.optimizer.state_dict()
        return {
            "hyper": dataclasses.asdict(self.hyper),
            "params": {n: v.detach().clone() for n, v in self.params.items()},
            "optimizer": {
                "state": {
                    i: {n: v.clone() if isinstance(v, Tensor) else v for n, v in s.items()}
                    for i, s in opt["state"].items()
                },
                "param_groups": [dict(g) for g in opt["param_groups"]],
            },
            "n_steps": self.n_steps,
            "n_tokens": self.n_tokens,
            "tokens_since_fired": self.tokens_since_fired.clone(),
            "fired_counts": self.fired_counts.clone(),
            "window_tokens": self.window_tokens,
            "topk_threshold": self.topk_threshold.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a `state_dict` of a Trainer of the same hyperparameters)."""
        mine = dataclasses.asdict(self.hyper)
        theirs = {n: tuple(v) if isinstance(v, list) else v for n, v in state["hyper"].items()}
        if {n: tuple(v) if isinstance(v, list) else v for n, v in mine.items()} != theirs:
            raise ValueError("the state is of a dictionary with other hyperparameters")
        with torch.no_grad():
            for n, v in state["params"].items():
                self.params[n].copy_(v)
        self.optimizer.load_state_dict(state["optimizer"])
        self.n_steps = int(state["n_steps"])
        self.n_tokens = int(state["n_tokens"])
        self.tokens_since_fired = state["tokens_since_fired"].to(self.device).clone()
        self.fired_counts = state["fired_counts"].to(self.device).clone()
        self.window_tokens = int(state["window_tokens"])
        self.topk_threshold = state["topk_threshold"].to(self.device).clone()
