"""The training steps' autograd functions whose gradients are written out by hand rather
than traced: JumpReLU's and its L0 step's straight-through estimators (SAELens's rectangle
kernel, into the threshold only), and relu's encode/decode with its L1 term (half the
passes over the B x S latents that autograd's graph would take)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["JumpReLU", "ReluCode", "Scratch", "Step"]


class Scratch:
    """Buffers a trainer keeps from one step to the next, by name.

    Why: a step of relu makes B x S tensors (16 MiB at B 4096, S 1024) that live for one
    step. On the CPU, glibc hands blocks that large back to the system when they are freed,
    so each new one is page-faulted in afresh: about an eighth of relu's step on this
    machine. Written into with `out=` instead, they are faulted in once.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, like: Tensor, shape: tuple[int, ...]) -> Tensor:
        """The buffer `name` of `shape` in `like`'s dtype and device, made anew only when
        one of those changed (whatever it held is overwritten by the caller)."""
        t = self._buffers.get(name)
        if t is None or t.shape != shape or t.dtype != like.dtype or t.device != like.device:
            t = self._buffers[name] = like.new_empty(shape)
        return t


class JumpReLU(torch.autograd.Function):
    """pre * (pre > threshold); the threshold's gradient through the rectangle STE."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre > threshold)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        pre, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        window = ((pre - threshold) / bw).abs() < 0.5  # SAELens's rectangle: -0.5 < u < 0.5
        ste = (threshold / bw) * window * grad
        return (pre > threshold) * grad, -ste.sum(0), None


class Step(torch.autograd.Function):
    """(pre > threshold); no gradient to pre, the threshold's through the rectangle STE."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None]:
        pre, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        window = ((pre - threshold) / bw).abs() < 0.5
        return None, -((1.0 / bw) * window * grad).sum(0), None


class ReluCode(torch.autograd.Function):
    """relu's encode and decode with its L1 term, the gradients written out.

    Forward: pre = x W_enc + (b_enc - b_dec W_enc), z = relu(pre), core = z W_dec + b_dec,
    l1 = sum_i (sum_b z_bi) ||W_dec_i||; it returns (core, l1, fired per latent). The
    autograd graph would take about twice the passes over the B x S latents that these
    gradients need (the L1's broadcast, its column sums, a bool copy for the firing count);
    here the L1's gradient into z rides in the decoder's backward matmul as its bias, z
    overwrites pre, the column sums are taken once, as matrix-vector products. With a
    `Scratch`, z and one more B x S buffer (the firing signs, then dL/dz, then dL/dpre in
    place) are the same memory every step.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        w_enc: Tensor,
        b_enc: Tensor,
        w_dec: Tensor,
        b_dec: Tensor,
        b_dec_in: bool,
        scratch: Scratch | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            # autocast's choice made here once, so that the backward computes in it too
            low = torch.get_autocast_dtype(kind)
            x, w_enc, b_enc, w_dec, b_dec = (t.to(low) for t in (x, w_enc, b_enc, w_dec, b_dec))
        with torch.autocast(kind, enabled=False):
            bias = b_enc - b_dec @ w_enc if b_dec_in else b_enc
            shape = (x.shape[0], w_enc.shape[1])
            z = _buffer(scratch, "z", x, shape)
            z = torch.addmm(bias, x, w_enc, out=z).relu_()
            core = torch.addmm(b_dec, z, w_dec)
            norm = w_dec.norm(dim=1)
            # column sums as products with ones: BLAS's gemv, several times faster on the
            # CPU than a reduction over dim 0 (and count_nonzero) of a B x S matrix
            ones = z.new_ones(z.shape[0])
            z_sum = ones @ z
            signs = torch.sign(z, out=_buffer(scratch, "work", z, shape))  # z >= 0: 0 or 1
            fired = (ones @ signs).to(torch.int64)
        ctx.save_for_backward(x, w_enc, w_dec, b_dec, z, norm, z_sum)
        ctx.b_dec_in, ctx.scratch = b_dec_in, scratch
        ctx.mark_non_differentiable(fired)
        return core, z_sum @ norm, fired

    @staticmethod
    def backward(ctx: Any, d_core: Tensor, d_l1: Tensor, _: Any) -> tuple[Any, ...]:
        x, w_enc, w_dec, b_dec, z, norm, z_sum = ctx.saved_tensors
        d_core, d_l1 = d_core.to(z.dtype), d_l1.to(z.dtype)
        d_w_dec = z.T @ d_core + (d_l1 * z_sum / norm)[:, None] * w_dec
        d_b_dec = d_core.sum(0)
        # dL/dz = d_core W_dec^T + d_l1 ||W_dec_i||, zero where relu cut
        d_z = torch.addmm(
            d_l1 * norm, d_core, w_dec.T, out=_buffer(ctx.scratch, "work", z, z.shape)
        )
        # one pass, in place: d_z where z > 0
        d_pre = torch.ops.aten.threshold_backward.grad_input(d_z, z, 0, grad_input=d_z)
        d_b_enc = z.new_ones(z.shape[0]) @ d_pre
        d_w_enc = x.T @ d_pre
        if ctx.b_dec_in:
            d_w_enc -= b_dec[:, None] * d_b_enc[None]
            d_b_dec = d_b_dec - w_enc @ d_b_enc
        return None, d_w_enc, d_b_enc, d_w_dec, d_b_dec, None, None


def _buffer(scratch: Scratch | None, name: str, like: Tensor, shape: tuple[int, ...]) -> Tensor:
    return like.new_empty(shape) if scratch is None else scratch.get(name, like, shape)
