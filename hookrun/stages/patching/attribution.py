"""Attribution patching (Nanda 2023; AtP, Kramár et al. 2024): the exact grid's cells
estimated to first order from gradients, instead of a patched pass per cell.

A cell (site kind, layer, position p) of a row is estimated as

    (a_clean − a_corrupted)[p] · ∂ logit_diff / ∂a [p]

— the change of the logit difference that replacing the module's output a at p by its
clean value would make, were the model linear from a to the logits — with the gradient
taken on the corrupted run (`atp`), or averaged over `ig_steps` runs whose input embeddings
lie between the corrupted and the clean prompt's, at (k / ig_steps) of the way for
k = 0 … ig_steps − 1 (`atp_ig`; Riemann, as integrated gradients; one step is `atp`).
A `heads` cell takes its head's slice of the output projection's input, summed over the
slice. The grid divides the estimates by clean − corrupted, as it divides the exact cells.

One backward pass per step serves every cell of every site kind, layer and position: the
gradients are kept for the patched modules only, one batch at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from hookrun.runtime.handles import ModuleHook, hooked
from hookrun.stages.patching.resume import HEADS, Pass, Rows, Sites, first_tensor

__all__ = ["attribution_grids"]


def attribution_grids(
    hf: nn.Module,
    sites: Sites,
    rows: Rows,
    clean: tuple[torch.Tensor, Pass],
    corrupted: Pass | None,
    steps: int,
) -> tuple[dict[str, dict[str, torch.Tensor]], Pass]:
    """Each site kind's estimated (patched − corrupted) logit difference at every cell,
    (N, layers, T) and (N, layers, heads, T) for `heads`, by atp (the first run's gradient)
    and by atp_ig (the mean over the `steps` runs): {method: {kind: cells}}; and the
    corrupted pass. `clean`: the clean ids (N, T) and the clean pass's outputs; `corrupted`:
    the corrupted pass, or None to take it from the first gradient run (it is the corrupted
    run: no forward of its own)."""
    clean_ids, clean_pass = clean
    grads, first = _gradients(hf, sites.modules, rows, clean_ids, steps)
    corrupted = corrupted or first
    with torch.no_grad():
        deltas = {
            kind: [c.float() - r.float() for c, r in zip(clean_pass.outputs[kind], ts, strict=True)]
            for kind, ts in corrupted.outputs.items()
        }
        out = {method: _cells(deltas, found, sites.heads) for method, found in grads.items()}
    return out, corrupted


def _cells(
    deltas: dict[str, list[torch.Tensor]], grads: dict[str, list[torch.Tensor]], heads: int
) -> dict[str, torch.Tensor]:
    """Each site kind's cells: Δ · gradient summed over the features (a head's slice)."""
    out = {}
    for kind, per_layer in deltas.items():
        cells = []
        for delta, grad in zip(per_layer, grads[kind], strict=True):
            product = delta * grad
            if kind == HEADS:  # (N, T, heads × head width) → (N, heads, T)
                n, t, width = product.shape
                cells.append(product.view(n, t, heads, width // heads).sum(-1).transpose(1, 2))
            else:
                cells.append(product.sum(-1))
        out[kind] = torch.stack(cells, dim=1)
    return out


def _gradients(
    hf: nn.Module, modules: dict[str, list[str]], rows: Rows, clean_ids: torch.Tensor, steps: int
) -> tuple[dict[str, dict[str, list[torch.Tensor]]], Pass]:
    """∂ logit_diff / ∂ (each patched module's output; the output projection's input for
    heads), float32 (N, T, D) each: the first run's (atp) and the mean over the `steps`
    interpolated runs (atp_ig); and the first run (k = 0: the corrupted input itself) as a
    Pass."""
    embed = hf.get_input_embeddings()
    named = dict(hf.named_modules())
    total: dict[str, list[torch.Tensor]] = {}
    with torch.inference_mode(False), torch.enable_grad():
        corrupt_emb = embed(rows.ids).detach()
        shift = embed(clean_ids).detach() - corrupt_emb
        for k in range(steps):
            start = (corrupt_emb + (k / steps) * shift).requires_grad_(True)
            seen: dict[str, list[torch.Tensor]] = {kind: [] for kind in modules}
            hooks = [ModuleHook(embed, lambda m, a, o, start=start: start)]
            for kind, names in modules.items():
                into = seen[kind]
                for name in names:
                    if kind == HEADS:
                        keep = lambda m, a, into=into: into.append(first_tensor(a))  # noqa: E731
                        hooks.append(ModuleHook(named[name], keep, before=True))
                    else:
                        keep = lambda m, a, o, into=into: into.append(first_tensor(o))  # noqa: E731
                        hooks.append(ModuleHook(named[name], keep))
            with hooked(hooks):
                out = hf(
                    input_ids=rows.ids, attention_mask=rows.mask, use_cache=False, return_dict=True
                )
            every = torch.arange(len(rows.ids), device=rows.ids.device)
            diff = rows.diff(out.logits[every, rows.read], every)
            if k == 0:
                first = Pass(
                    {kind: [t.detach() for t in ts] for kind, ts in seen.items()}, diff.detach()
                )
            flat = [t for kind in modules for t in seen[kind]]
            found = torch.autograd.grad(diff.sum(), flat, allow_unused=True)
            at = 0
            for kind in modules:
                got = [
                    (g if g is not None else torch.zeros_like(t)).float().detach()
                    for g, t in zip(found[at : at + len(seen[kind])], seen[kind], strict=True)
                ]
                at += len(seen[kind])
                if kind not in total:
                    total[kind] = got
                else:
                    total[kind] = [a + b for a, b in zip(total[kind], got, strict=True)]
            if k == 0:
                atp = {kind: list(grads) for kind, grads in total.items()}
    mean = {kind: [g / steps for g in grads] for kind, grads in total.items()}
    return {"atp": atp, "atp_ig": mean}, first
