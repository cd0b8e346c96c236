"""One sparse dictionary (an SAE or a transcoder) as loaded from disk, and its exact math.

`Dictionary` holds the tensors and the few settings that change the numbers; `encode` and
`decode` repeat SAELens 6.54's inference classes operation for operation (the same products
in the same order, so float32 results match SAELens's to rounding), because a splice that
differs from the library the dictionary was trained with changes what every latent means.
What SAELens does per architecture:

- every architecture: the input cast to the weights' dtype, then normalised in
  (`normalize`), then `b_dec` subtracted where `apply_b_dec_to_input` (never a transcoder);
- standard: relu(x W_enc + b_enc);
- topk: the k largest of x W_enc + b_enc (times each decoder row's norm where
  `rescale_acts_by_decoder_norm`), relu'd, every other latent 0;
- jumprelu: relu(pre) * (pre > threshold) (BatchTopK SAEs are saved as jumprelu);
- gated: (x W_enc + b_gate > 0) * relu(x (W_enc * exp(r_mag)) + b_mag);
- decode: z W_dec + b_dec, normalised out (an SAE; SAELens's transcoders skip that step),
  plus x W_skip for a skip transcoder (SAELens adds it in forward; hookrun's decode does,
  given x).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ARCHITECTURES", "NORMALIZE", "Dictionary"]

ARCHITECTURES = ("standard", "topk", "jumprelu", "gated")
# "expected_average_only_in": x times a constant the trainer estimated (sqrt(d_in) over the
# mean norm); "constant_norm_rescale": each token to norm sqrt(d_in), undone on the way out.
NORMALIZE = ("none", "expected_average_only_in", "constant_norm_rescale")


@dataclass(frozen=True)
class Dictionary:
    """A sparse autoencoder or transcoder: its tensors and what its math depends on.

    `tensors` holds W_enc [d_in, d_sae], W_dec [d_sae, d_out], b_dec [d_out], and b_enc
    [d_sae] (not gated), threshold [d_sae] (jumprelu), b_gate, r_mag, b_mag [d_sae]
    (gated), W_skip [d_in, d_out] (a skip transcoder), in the weights file's dtype.
    """

    name: str  # the folder's name, or the file's stem ("layer_3") for circuit-tracer's
    architecture: str  # one of ARCHITECTURES
    d_in: int
    d_sae: int
    d_out: int  # d_in except a transcoder
    transcoder: bool  # reads one site, writes in place of another
    hook_name: str | None  # the TransformerLens hook it reads (None: not known)
    hook_name_out: str | None  # a transcoder's output hook (None: not known, or an SAE)
    k: int | None  # topk's k
    apply_b_dec_to_input: bool
    normalize: str  # one of NORMALIZE
    # expected_average_only_in's factor where the folder keeps it (activation_scaler.json,
    # a training checkpoint); None: SAELens's SAE class applies no factor at all.
    scaling_factor: float | None
    tensors: Mapping[str, torch.Tensor]
    source: Path  # the weights file
    sha256: str  # of the weights file
    # topk only: SAELens's rescale_acts_by_decoder_norm (pre-activations times each decoder
    # row's norm before the top k, activations divided by it before decoding).
    rescale_acts_by_decoder_norm: bool = False

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Dictionary:
        """The same dictionary with its tensors on `device` in `dtype`.

        Args:
            device: where the tensors go (None: where they are).
            dtype: their dtype (None: theirs, the file's).

        Returns:
            A new Dictionary; this one is unchanged.
        """
        moved = {n: t.to(device=device, dtype=dtype) for n, t in self.tensors.items()}
        return dataclasses.replace(self, tensors=moved)

    def _norm_in(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalize == "constant_norm_rescale":
            return x * ((self.d_in**0.5) / x.norm(dim=-1, keepdim=True))
        if self.normalize == "expected_average_only_in" and self.scaling_factor is not None:
            return x * self.scaling_factor
        return x

    def _norm_out(self, out: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        if self.normalize == "constant_norm_rescale":
            if x is None:
                raise ValueError(f"{self.name}: constant_norm_rescale decodes with the input x")
            # SAELens keeps this coefficient from the encode just before; it is recomputed
            # from x here, in the same dtype and by the same expression.
            x = x.to(self.tensors["W_dec"].dtype)
            return out / ((self.d_in**0.5) / x.norm(dim=-1, keepdim=True))
        if self.normalize == "expected_average_only_in" and self.scaling_factor is not None:
            return out / self.scaling_factor
        return out

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The latents of `x`, as SAELens's `SAE.encode` computes them (differentiable).

        Args:
            x: activations (..., d_in), cast to the weights' dtype first.

        Returns:
            The latents (..., d_sae), in the weights' dtype.
        """
        t = self.tensors
        sae_in = self._norm_in(x.to(t["W_enc"].dtype))
        if self.apply_b_dec_to_input:
            sae_in = sae_in - t["b_dec"]
        if self.architecture == "gated":
            active = (sae_in @ t["W_enc"] + t["b_gate"] > 0).to(t["W_enc"].dtype)
            magnitude = sae_in @ (t["W_enc"] * t["r_mag"].exp()) + t["b_mag"]
            return active * torch.relu(magnitude)
        pre = sae_in @ t["W_enc"] + t["b_enc"]
        if self.architecture == "standard":
            return torch.relu(pre)
        if self.architecture == "jumprelu":
            acts = torch.relu(pre)
            return acts * (pre > t["threshold"]).to(acts.dtype)
        if self.rescale_acts_by_decoder_norm:
            pre = pre * t["W_dec"].norm(dim=-1)
        values, indices = torch.topk(pre, k=int(self.k or 0), dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter(-1, indices, values.relu())

    def decode(self, z: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """What the dictionary writes for latents `z`, as SAELens computes it.

        Args:
            z: latents (..., d_sae).
            x: the input `z` was encoded from (..., d_in): needed by a skip transcoder
                (x W_skip added) and by constant_norm_rescale (its per-token norm undone).

        Returns:
            The reconstruction (..., d_out), in the weights' dtype.

        Raises:
            ValueError: `x` is None where it is needed.
        """
        t = self.tensors
        if self.rescale_acts_by_decoder_norm:
            z = z * (1 / t["W_dec"].norm(dim=-1))
        out = z @ t["W_dec"] + t["b_dec"]
        if not self.transcoder:
            out = self._norm_out(out, x)
        if "W_skip" in t:
            if x is None:
                raise ValueError(f"{self.name}: a skip transcoder decodes with the input x")
            # The raw input, as SAELens's SkipTranscoder.forward adds x @ W_skip.T.
            out = out + x @ t["W_skip"]
        return out

    def decoder_direction(self, latent: int) -> torch.Tensor:
        """What one unit of `latent` adds to the model's activations: its decoder row.

        The row is divided by `scaling_factor` (expected_average_only_in with a factor) and
        by its norm (topk's rescale_acts_by_decoder_norm), as decode divides it. Under
        constant_norm_rescale decode also multiplies it by each token's ||x|| / sqrt(d_in),
        which depends on the token: that factor is not in the returned row.

        Args:
            latent: the latent's index, 0 <= latent < d_sae.

        Returns:
            The direction (d_out,), in the weights' dtype.

        Raises:
            IndexError: `latent` is out of range.
        """
        if not 0 <= latent < self.d_sae:
            raise IndexError(f"{self.name}: latent {latent}; valid: 0 to {self.d_sae - 1}")
        row = self.tensors["W_dec"][latent]
        if self.rescale_acts_by_decoder_norm:
            row = row * (1 / row.norm())
        if self.normalize == "expected_average_only_in" and self.scaling_factor is not None:
            row = row / self.scaling_factor
        return row
