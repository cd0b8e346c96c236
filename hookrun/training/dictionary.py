"""One sparse dictionary's training math and optimiser, as SAELens 6.54's trainer does it.

Per architecture (x the input, y the target: x for an SAE, the output site for a
transcoder; pre = (x − b_dec) W_enc + b_enc, b_dec subtracted for an SAE only):

- relu (SAELens's "standard"): z = relu(pre); loss = MSE + λ · mean_t Σ_i z_i ‖W_dec,i‖,
  λ warmed up linearly over `l1_warmup_steps`;
- topk: z = the k largest of pre, relu'd; loss = MSE + `aux_k_coefficient` · AuxK, where
  AuxK reconstructs the residual y − ŷ (held fixed) from the k_aux = d_in / 2 largest
  pre-activations of the dead latents (scaled by min(dead / k_aux, 1));
- batchtopk: z = the k · B largest relu'd pre-activations of the whole batch; the threshold
  saved (as jumprelu) is the running mean of each batch's smallest kept activation
  (SAELens's topk_threshold, rate 0.01);
- jumprelu: z = pre · [pre > θ], θ = exp(log θ) learned through the straight-through
  estimator with a rectangle kernel of `jumprelu_bandwidth`; loss = MSE +
  `l0_coefficient` · mean_t Σ_i [pre_i > θ_i];
- matryoshka_batchtopk: batchtopk's latents; the loss is the mean of the MSEs of the
  reconstructions from each nested prefix of latents (`matryoshka_widths`) plus AuxK.

MSE is the squared error summed over features, averaged over tokens. Initialisation:
W_dec rows of norm `decoder_init_norm` in random directions, W_enc = W_dec transposed, biases
zero. Adam (β 0.9, 0.999), the gradient's norm clipped to 1, the learning rate warmed up
linearly over `lr_warmup_steps` and decayed linearly to 0 over the last `lr_decay_steps`.
A latent is dead when it has not fired for `dead_steps` steps.

Everything draws from the generator given at construction and nothing else, so the same
inputs give the same weights bit for bit on the CPU, and `state_dict()` holds all a resumed
job needs to go on as if never stopped.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["Hyper", "Trainer"]

# SAELens's names of what it saves, per architecture trained (an SAE, a transcoder).
_SAVED = {
    "relu": ("standard", "transcoder"),
    "topk": ("topk", "transcoder"),
    "batchtopk": ("jumprelu", "jumprelu_transcoder"),
    "jumprelu": ("jumprelu", "jumprelu_transcoder"),
    "matryoshka_batchtopk": ("jumprelu", "jumprelu_transcoder"),
}
_THRESHOLD_RATE = 0.01  # SAELens's topk_threshold_lr


@dataclass(frozen=True)
class Hyper:
    """One dictionary's hyperparameters (checked by the job's config)."""

    architecture: str
    d_in: int
    d_out: int
    width: int
    k: int | None = None
    l1_coefficient: float = 5.0
    l1_warmup_steps: int = 0
    l0_coefficient: float = 1.0
    jumprelu_bandwidth: float = 0.05
    jumprelu_init_threshold: float = 0.01
    aux_k_coefficient: float = 1 / 32
    dead_steps: int = 1000  # SAELens's dead_feature_window
    matryoshka_widths: tuple[int, ...] = ()
    lr: float = 3e-4
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 0
    total_steps: int = 1
    adam_betas: tuple[float, float] = (0.9, 0.999)
    decoder_init_norm: float = 0.1
    skip: bool = False
    transcoder: bool = False
    scale: float = 1.0  # expected_average_only_in: x and y times this; folded out on saving


class _JumpReLU(torch.autograd.Function):
    """pre · [pre > θ]; θ's gradient through a rectangle kernel (straight-through)."""

    @staticmethod
    def forward(ctx, pre, threshold, bandwidth):  # noqa: ANN001, ANN205
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre > threshold)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        pre, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        near = ((pre - threshold).abs() < bw / 2).to(pre.dtype)
        grad_pre = (pre > threshold).to(pre.dtype) * grad
        grad_threshold = (-(threshold / bw) * near * grad).sum(0)
        return grad_pre, grad_threshold, None


class _Step(torch.autograd.Function):
    """[pre > θ]; θ's gradient through a rectangle kernel (the L0 penalty's)."""

    @staticmethod
    def forward(ctx, pre, threshold, bandwidth):  # noqa: ANN001, ANN205
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        pre, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        near = ((pre - threshold).abs() < bw / 2).to(pre.dtype)
        return None, (-(1.0 / bw) * near * grad).sum(0), None


class Trainer:
    """One dictionary being trained: its parameters, optimiser, schedule and counters."""

    def __init__(
        self,
        hyper: Hyper,
        generator: torch.Generator,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.hyper, self.device = hyper, torch.device(device)
        h = hyper
        direction = torch.randn(h.width, h.d_out, generator=generator, dtype=torch.float32)
        w_dec = direction / direction.norm(dim=1, keepdim=True) * h.decoder_init_norm
        if h.transcoder and h.d_in != h.d_out:
            w_enc = torch.randn(h.d_in, h.width, generator=generator)
            w_enc = w_enc / w_enc.norm(dim=0, keepdim=True) * h.decoder_init_norm
        else:
            w_enc = w_dec.T.clone()
        params = {
            "W_enc": w_enc,
            "b_enc": torch.zeros(h.width),
            "W_dec": w_dec,
            "b_dec": torch.zeros(h.d_out),
        }
        if h.architecture == "jumprelu":
            params["log_threshold"] = torch.full((h.width,), math.log(h.jumprelu_init_threshold))
        if h.skip:
            params["W_skip"] = torch.zeros(h.d_in, h.d_out)
        self.params = {
            k: v.to(self.device, dtype).contiguous().requires_grad_(True) for k, v in params.items()
        }
        self.optimizer = torch.optim.Adam(self.params.values(), lr=h.lr, betas=h.adam_betas)
        self.steps = 0
        self.since_fired = torch.zeros(h.width, dtype=torch.long, device=self.device)
        self.fired = torch.zeros(h.width, dtype=torch.float64, device=self.device)  # tokens
        self.tokens = 0
        self.threshold = torch.zeros((), dtype=torch.float64, device=self.device)

    # ------------------------------------------------------------------ the math
    def _pre(self, x: torch.Tensor) -> torch.Tensor:
        p = self.params
        shifted = x if self.hyper.transcoder else x - p["b_dec"]
        return shifted @ p["W_enc"] + p["b_enc"]

    def _latents(self, pre: torch.Tensor, training: bool) -> torch.Tensor:
        h, arch = self.hyper, self.hyper.architecture
        if arch == "relu":
            return torch.relu(pre)
        if arch == "topk":
            top = pre.topk(h.k, dim=-1)
            return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))
        if arch == "jumprelu":
            threshold = self.params["log_threshold"].exp()
            return _JumpReLU.apply(pre, threshold, h.jumprelu_bandwidth)
        # batchtopk and matryoshka: the batch's k · B largest while training, the learned
        # threshold afterwards (what the saved jumprelu computes).
        if not training:
            return pre * (pre > self.threshold.to(pre.dtype))
        acts = torch.relu(pre)
        flat = acts.flatten()
        keep = min(h.k * acts.shape[0], flat.numel())
        top = flat.topk(keep)
        return torch.zeros_like(flat).scatter(0, top.indices, top.values).view_as(acts)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The latents as the saved dictionary computes them (x in the input's own units)."""
        with torch.no_grad():
            return self._latents(self._pre(x.to(self.device) * self.hyper.scale), False)

    def decode(self, z: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction of latents `z` in the target's own units (x: a skip
        transcoder's input)."""
        with torch.no_grad():
            out = z @ self.params["W_dec"] + self.params["b_dec"]
            if self.hyper.skip and x is not None:
                out = out + (x * self.hyper.scale) @ self.params["W_skip"]
            return out / self.hyper.scale

    def _rate(self) -> float:
        h, step = self.hyper, self.steps
        factor = 1.0
        if h.lr_warmup_steps and step < h.lr_warmup_steps:
            factor = (step + 1) / h.lr_warmup_steps
        left = h.total_steps - step
        if h.lr_decay_steps and left <= h.lr_decay_steps:
            factor = min(factor, left / h.lr_decay_steps)
        return h.lr * factor

    def _l1(self) -> float:
        h = self.hyper
        if h.l1_warmup_steps and self.steps < h.l1_warmup_steps:
            return h.l1_coefficient * (self.steps + 1) / h.l1_warmup_steps
        return h.l1_coefficient

    def _aux_k(self, pre: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """AuxK: the residual from the dead latents' largest pre-activations."""
        h = self.hyper
        dead = self.since_fired > h.dead_steps
        count = int(dead.sum())
        if count == 0:
            return pre.new_zeros(())
        k_aux = h.d_in // 2
        scale = min(count / k_aux, 1.0)
        k_aux = min(k_aux, count)
        masked = torch.where(dead, pre, torch.full_like(pre, -math.inf))
        top = masked.topk(k_aux, dim=-1)
        acts = torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))
        recon = acts @ self.params["W_dec"]
        return scale * (recon - residual).pow(2).sum(-1).mean()

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
        h, p, arch = self.hyper, self.params, self.hyper.architecture
        pre = self._pre(x)
        z = self._latents(pre, True)
        skip = x @ p["W_skip"] if h.skip else 0.0
        out = z @ p["W_dec"] + p["b_dec"] + skip
        mse = (out - y).pow(2).sum(-1).mean()
        parts: dict[str, torch.Tensor] = {"mse": mse}
        loss = mse
        if arch == "relu":
            l1 = (z * p["W_dec"].norm(dim=1)).sum(-1).mean()
            parts["l1"] = l1
            loss = loss + self._l1() * l1
        elif arch == "jumprelu":
            threshold = p["log_threshold"].exp()
            l0 = _Step.apply(pre, threshold, h.jumprelu_bandwidth).sum(-1).mean()
            parts["l0_loss"] = l0
            loss = loss + h.l0_coefficient * l0
        else:
            if arch == "matryoshka_batchtopk":
                inner = []
                for width in h.matryoshka_widths:
                    part = z[:, :width] @ p["W_dec"][:width] + p["b_dec"] + skip
                    inner.append((part - y).pow(2).sum(-1).mean())
                loss = torch.stack(inner).mean()
            aux = self._aux_k(pre, (y - out).detach())
            parts["aux"] = aux
            loss = loss + h.aux_k_coefficient * aux
        return loss, parts, z

    # ------------------------------------------------------------------ one step
    def step(self, x: torch.Tensor, target: torch.Tensor | None = None) -> dict[str, float]:
        """One optimiser step on a batch x (B, d_in) (target (B, d_out) for a transcoder);
        that step's loss, MSE, explained variance, L0, dead fraction and learning rate."""
        h = self.hyper
        x = x.to(self.device, torch.float32) * h.scale
        y = x if target is None else target.to(self.device, torch.float32) * h.scale
        rate = self._rate()
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        with torch.enable_grad():
            loss, parts, z = self._loss(x, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), 1.0)
        self.optimizer.step()
        with torch.no_grad():
            active = z.detach() > 0
            fired = active.any(0)
            self.since_fired = torch.where(fired, 0, self.since_fired + 1)
            self.fired += active.sum(0).double()
            self.tokens += x.shape[0]
            if h.architecture in ("batchtopk", "matryoshka_batchtopk"):
                kept = z.detach()[active]
                if kept.numel():
                    smallest = kept.min().double()
                    first = self.steps == 0
                    self.threshold = (
                        smallest
                        if first
                        else (1 - _THRESHOLD_RATE) * self.threshold + _THRESHOLD_RATE * smallest
                    )
            total = (y - y.mean(0)).pow(2).sum()
            mse = parts["mse"].detach()
            ev = 1 - mse * y.shape[0] / total if total > 0 else torch.tensor(math.nan)
        self.steps += 1
        metrics = {
            "loss": float(loss.detach()),
            "mse": float(mse) / h.scale**2,
            "explained_variance": float(ev),
            "l0": float(active.sum(-1).double().mean()),
            "dead": float((self.since_fired > h.dead_steps).double().mean()),
            "lr": rate,
        }
        metrics.update({k: float(v.detach()) for k, v in parts.items() if k != "mse"})
        return metrics

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed job goes on from (tensors and numbers only)."""
        return {
            "params": {k: v.detach().clone() for k, v in self.params.items()},
            # A copy: the optimiser's own state_dict holds its live moment tensors.
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "steps": self.steps,
            "since_fired": self.since_fired.clone(),
            "fired": self.fired.clone(),
            "tokens": self.tokens,
            "threshold": self.threshold.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for k, v in state["params"].items():
                self.params[k].copy_(v)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps, self.tokens = int(state["steps"]), int(state["tokens"])
        self.since_fired = state["since_fired"].to(self.device)
        self.fired = state["fired"].to(self.device)
        self.threshold = state["threshold"].to(self.device)

    # ------------------------------------------------------------------ saving
    def saved_tensors(self) -> dict[str, torch.Tensor]:
        """The weights as SAELens's inference class reads them, in the input's own units
        (expected_average_only_in folded in as SAELens folds it when training ends)."""
        h, p = self.hyper, {k: v.detach().float().cpu() for k, v in self.params.items()}
        s = h.scale
        out = {
            "W_enc": p["W_enc"] * s,
            "b_enc": p["b_enc"],
            "W_dec": p["W_dec"] / s,
            "b_dec": p["b_dec"] / s,
        }
        if h.architecture == "jumprelu":
            out["threshold"] = p["log_threshold"].exp()
        elif h.architecture in ("batchtopk", "matryoshka_batchtopk"):
            out["threshold"] = torch.full((h.width,), float(self.threshold))
        if h.skip:
            out["W_skip"] = p["W_skip"]
        return {k: v.contiguous() for k, v in out.items()}

    def save(self, folder: Path, hook_name: str, extra_metadata: dict[str, Any]) -> None:
        """SAELens 6.54's folder: cfg.json, sae_weights.safetensors, sparsity.safetensors
        (log10 of each latent's firing frequency), written under a temporary name and
        renamed into place: never a half folder under the final name."""
        h = self.hyper
        saelens = _SAVED[h.architecture][1 if h.transcoder else 0]
        if h.transcoder and h.skip:
            saelens = saelens.replace("transcoder", "skip_transcoder")
        cfg: dict[str, Any] = {
            "architecture": saelens,
            "d_in": h.d_in,
            "d_sae": h.width,
            "dtype": "float32",
            "device": "cpu",
            "apply_b_dec_to_input": not h.transcoder,
            "normalize_activations": "none",
            "reshape_activations": "none",
            "metadata": {
                "hook_name": hook_name,
                "sae_lens_training_version": None,
                "hookrun_training": asdict(h),
                **extra_metadata,
            },
        }
        if h.transcoder:
            cfg["d_out"] = h.d_out
        if h.architecture == "topk":
            cfg["k"] = h.k
            cfg["rescale_acts_by_decoder_norm"] = False
        frequency = (self.fired / max(self.tokens, 1)).float().cpu()
        folder.parent.mkdir(parents=True, exist_ok=True)
        temp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
        try:
            save_file(self.saved_tensors(), str(temp / "sae_weights.safetensors"))
            save_file(
                {"sparsity": torch.log10(frequency + 1e-10)}, str(temp / "sparsity.safetensors")
            )
            (temp / "cfg.json").write_text(json.dumps(cfg, indent=1, default=str) + "\n")
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(temp, folder)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
