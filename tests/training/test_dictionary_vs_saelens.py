"""hookrun's dictionary training against SAELens 6.54's SAETrainer, on the same activations.

Synthetic activations (d_in 64: sparse codes over 128 random unit directions, plus noise)
are made here from a fixed generator; hookrun's Trainer trains each architecture on them
and writes its initial weights, which SAELens's training SAE loads, so both start from the
same dictionary and see the same batches in the same order. SAELens runs in a venv of its
own in a subprocess (tests/reference_venvs.py); nothing of it is imported here.

Asserted: the lr schedule step for step; the first step's loss (the same weights and batch:
every loss term's formula) to rtol 1e-5; after 100 steps, the held-out explained variance
and MSE of the saved dictionaries within 2 % of SAELens's for every architecture (the
summation orders differ, so the runs drift apart by rounding and by the topk choices it
flips); SAELens's load_from_disk of hookrun's folders giving hookrun's latents (max abs
difference <= 1e-5), as hookrun's own loader does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hookrun.dictionaries import load_dictionaries
from hookrun.training.dictionary import Hyper, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_venvs import saelens_python  # noqa: E402

SCRIPT = Path(__file__).with_name("saelens_train_script.py")
D_IN, WIDTH, BATCH, STEPS, HELDOUT = 64, 128, 128, 100, 1024
WINDOW = 20  # dead_feature_window (steps), so AuxK and dead counting take part
COMMON = dict(
    d_in=D_IN,
    d_out=D_IN,
    width=WIDTH,
    lr=8e-3,
    lr_warmup_steps=10,
    lr_decay_steps=20,
    total_steps=STEPS,
    dead_tokens=WINDOW * BATCH,
    feature_sampling_window=60,
)
HYPERS = {
    "relu": Hyper("relu", l1_coefficient=2.0, l1_warmup_steps=30, **COMMON),
    "topk": Hyper("topk", k=8, **COMMON),
    "batchtopk": Hyper("batchtopk", k=8, **COMMON),
    "jumprelu": Hyper("jumprelu", l0_coefficient=0.05, **COMMON),
    "matryoshka_batchtopk": Hyper(
        "matryoshka_batchtopk", k=8, matryoshka_widths=(16, 64, WIDTH), **COMMON
    ),
}


def activations(n: int, seed: int) -> torch.Tensor:
    """x = sparse codes @ 128 random unit directions + noise (about 4 codes per token)."""
    g = torch.Generator().manual_seed(seed)
    directions = torch.randn(128, D_IN, generator=torch.Generator().manual_seed(7))
    directions = directions / directions.norm(dim=-1, keepdim=True)
    on = torch.rand(n, 128, generator=g) < 4 / 128
    magnitude = torch.rand(n, 128, generator=g) * 2 + 0.5
    noise = 0.05 * torch.randn(n, D_IN, generator=g)
    return (on * magnitude) @ directions + noise


def _saelens_case(h: Hyper, init: Path) -> dict:
    sae: dict = {"d_sae": h.width, "decoder_init_norm": h.decoder_init_norm}
    if h.architecture == "relu":
        sae |= {"l1_coefficient": h.l1_coefficient, "l1_warm_up_steps": h.l1_warmup_steps}
    elif h.architecture == "jumprelu":
        sae |= {
            "l0_coefficient": h.l0_coefficient,
            "jumprelu_bandwidth": h.jumprelu_bandwidth,
            "jumprelu_init_threshold": h.jumprelu_init_threshold,
        }
    else:
        sae |= {"k": h.k, "aux_loss_coefficient": h.aux_k_coefficient}
        if h.architecture != "topk":
            sae["topk_threshold_lr"] = h.topk_threshold_lr
        if h.matryoshka_widths:
            sae["matryoshka_widths"] = list(h.matryoshka_widths)
    trainer = {
        "total_training_samples": h.total_steps * BATCH,
        "train_batch_size_samples": BATCH,
        "lr": h.lr,
        "lr_end": h.lr,  # the constant scheduler decays from lr itself
        "lr_warm_up_steps": h.lr_warmup_steps,
        "lr_decay_steps": h.lr_decay_steps,
        "adam_beta1": h.adam_betas[0],
        "adam_beta2": h.adam_betas[1],
        "dead_feature_window": h.dead_tokens // BATCH,
        "feature_sampling_window": h.feature_sampling_window,
    }
    return {
        "architecture": {"relu": "standard"}.get(h.architecture, h.architecture),
        "sae": sae,
        "trainer": trainer,
        "init": str(init),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("vs_saelens")
    train, heldout = activations(STEPS * BATCH, seed=1), activations(HELDOUT, seed=2)
    data = tmp / "data.safetensors"
    save_file({"train": train, "heldout": heldout}, data)
    ours: dict = {}
    spec: dict = {"data": str(data), "cases": {}, "load": {}}
    for name, h in HYPERS.items():
        trainer = Trainer(h, torch.Generator().manual_seed(3))
        init = tmp / f"{name}.init.safetensors"
        save_file({n: p.detach().clone() for n, p in trainer.params.items()}, init)
        history = [trainer.step(batch) for batch in train.split(BATCH)]
        folder = tmp / "hookrun" / name
        trainer.save(folder, "blocks.0.hook_resid_pre", {"model_name": "synthetic"})
        ours[name] = {"trainer": trainer, "history": history, "folder": folder}
        spec["cases"][name] = _saelens_case(h, init)
        spec["load"][name] = str(folder)
    (tmp / "spec.json").write_text(json.dumps(spec))
    out = tmp / "saelens"
    done = subprocess.run(
        [str(saelens_python()), str(SCRIPT), str(tmp / "spec.json"), str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {"ours": ours, "out": out, "heldout": heldout}


def _ev_mse(out: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    l2 = (out - x).pow(2).sum(-1)
    return 1 - (l2.sum() / (x - x.mean(0)).pow(2).sum()).item(), l2.mean().item()


@pytest.mark.parametrize("name", list(HYPERS))
def test_training_matches_saelens(runs: dict, name: str) -> None:
    ours = runs["ours"][name]
    theirs = load_file(runs["out"] / f"{name}.results.safetensors")
    lrs = torch.tensor([m["lr"] for m in ours["history"]], dtype=torch.float64)
    torch.testing.assert_close(lrs, theirs["lr"], rtol=1e-12, atol=0)
    loss0 = ours["history"][0]["loss"]
    assert loss0 == pytest.approx(theirs["loss"][0].item(), rel=1e-5)
    x = runs["heldout"]
    trainer = ours["trainer"]
    ev, mse = _ev_mse(trainer.decode(trainer.encode(x)), x)
    ev_ref, mse_ref = _ev_mse(theirs["out"], x)
    print(f"{name}: EV {ev:.4f} vs SAELens {ev_ref:.4f}; MSE {mse:.5f} vs {mse_ref:.5f}")
    assert ev == pytest.approx(ev_ref, rel=0.02)
    assert mse == pytest.approx(mse_ref, rel=0.02)


@pytest.mark.parametrize("name", list(HYPERS))
def test_saelens_loads_hookruns_folder(runs: dict, name: str) -> None:
    ours = runs["ours"][name]
    x = runs["heldout"]
    theirs = load_file(runs["out"] / f"load_{name}.safetensors")
    z = ours["trainer"].encode(x)
    (loaded,) = load_dictionaries(ours["folder"], "test")
    z_loaded = loaded.encode(x)
    diff = (z - theirs["z"]).abs().max().item()
    print(f"{name}: latents max |hookrun - SAELens| {diff:.2e}")
    assert diff <= 1e-5
    assert (z_loaded - theirs["z"]).abs().max().item() <= 1e-5
    assert (loaded.decode(z_loaded) - theirs["out"]).abs().max().item() <= 1e-5
    assert torch.equal(z != 0, theirs["z"] != 0)
    sparsity = load_file(ours["folder"] / "sparsity.safetensors")["sparsity"]
    assert sparsity.shape == (WIDTH,)
