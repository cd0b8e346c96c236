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

One backward pass per step serves every cell of every site kind, layer and position. No
gradient is kept: a hook on each patched output turns its gradient into that module's cells
(N, T) the moment backward reaches it, so beyond the backward graph itself the memory is the
clean and corrupted outputs and the cells — no chunking of layers is needed.
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
    modules = sites.modules
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
            if k == 0:  # the corrupted input itself
                first = Pass(
                    {kind: [t.detach() for t in ts] for kind, ts in seen.items()}, diff.detach()
                )
                corrupted = corrupted or first
            cells = _backward_cells(diff, start, seen, (clean_pass, corrupted), sites.heads)
            if k == 0:
                total, atp = cells, {kind: list(c) for kind, c in cells.items()}
            else:
                total = {
                    kind: [a + b for a, b in zip(total[kind], c, strict=True)]
                    for kind, c in cells.items()
                }
    mean = {kind: torch.stack([c / steps for c in per], 1) for kind, per in total.items()}
    return {
        "atp": {kind: torch.stack(per, 1) for kind, per in atp.items()},
        "atp_ig": mean,
    }, corrupted


def _backward_cells(
    diff: torch.Tensor,
    start: torch.Tensor,
    seen: dict[str, list[torch.Tensor]],
    runs: tuple[Pass, Pass],
    heads: int,
) -> dict[str, list[torch.Tensor]]:
    """One backward pass of the summed logit differences; each seen output's gradient, as
    backward reaches it, becomes its cells (clean − corrupted) · gradient summed over the
    features (a head's slice): {kind: per layer (N, T) or (N, heads, T)}. An output the
    logit difference does not depend on has cells of zero."""
    clean, corrupted = runs
    cells: dict[str, list[torch.Tensor]] = {}
    for kind, outputs in seen.items():
        per_layer = cells[kind] = []
        for layer, output in enumerate(outputs):
            n, t, width = output.shape
            shape = (n, heads, t) if kind == HEADS else (n, t)
            per_layer.append(torch.zeros(shape, device=output.device))

            def to_cells(grad, kind=kind, layer=layer, per_layer=per_layer):
                with torch.no_grad():
                    delta = (
                        clean.outputs[kind][layer].float() - corrupted.outputs[kind][layer].float()
                    )
                    product = delta * grad.float()
                    if kind == HEADS:  # (N, T, heads × head width) → (N, heads, T)
                        n, t, width = product.shape
                        product = product.view(n, t, heads, width // heads).sum(-1).transpose(1, 2)
                        per_layer[layer] = product
                    else:
                        per_layer[layer] = product.sum(-1)

            output.register_hook(to_cells)
    torch.autograd.grad(diff.sum(), start, allow_unused=True)
    return cells
