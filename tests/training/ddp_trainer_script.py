"""Every architecture's `Trainer` stepped data parallel: run under torchrun by
tests/training/test_train_ddp.py, which steps the same trainers in one process on the same
whole batches and compares.

    torchrun --standalone --nproc_per_node 2 tests/training/ddp_trainer_script.py OUT_DIR

Each rank steps on its contiguous slice of every batch; rank 0 writes OUT_DIR/<case>.pt:
the trainer's state after the last step and every step's metrics.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from hookrun.training.dictionary import Hyper, Trainer

D, WIDTH, BATCH, STEPS = 16, 64, 64, 30


def cases() -> dict[str, Hyper]:
    """Each architecture, with a dead window short enough that AuxK's dead latents (counted
    over the whole batch) change the loss after a few steps."""
    common = dict(d_in=D, d_out=D, width=WIDTH, total_steps=STEPS, lr=3e-3)
    dead = dict(dead_tokens=4 * BATCH, feature_sampling_window=12)
    return {
        "topk": Hyper("topk", k=4, **common, **dead),
        "batchtopk": Hyper("batchtopk", k=4, **common, **dead),
        "matryoshka_batchtopk": Hyper(
            "matryoshka_batchtopk", k=4, matryoshka_widths=(16, 40, WIDTH), **common, **dead
        ),
        "relu": Hyper("relu", l1_coefficient=0.5, l1_warmup_steps=10, **common),
        "jumprelu": Hyper("jumprelu", l0_coefficient=0.1, **common),
    }


def data() -> torch.Tensor:
    """STEPS batches of BATCH tokens: sparse codes of random directions, with noise."""
    g = torch.Generator().manual_seed(3)
    directions = torch.randn(4 * D, D, generator=g)
    on = torch.rand(STEPS * BATCH, 4 * D, generator=g) < 0.08
    codes = on * (torch.rand(STEPS * BATCH, 4 * D, generator=g) * 2 + 0.5)
    return codes @ directions + 0.05 * torch.randn(STEPS * BATCH, D, generator=g)


def train(h: Hyper, ranks=None) -> tuple[Trainer, list[dict[str, float]]]:
    """The trainer stepped on every batch (with `ranks`: on this rank's slice of each)."""
    trainer = Trainer(h, torch.Generator().manual_seed(1), ranks=ranks)
    logged = []
    for batch in data().split(BATCH):
        logged.append(trainer.step(batch if ranks is None else batch[ranks.part(BATCH)]))
    return trainer, logged


def main() -> None:
    import torch.distributed as dist

    from hookrun.training.parallel import joined

    dist.init_process_group("gloo")
    ranks = joined()
    out = Path(sys.argv[1])
    for name, h in cases().items():
        trainer, logged = train(h, ranks)
        if ranks.main:
            torch.save({"state": trainer.state_dict(), "metrics": logged}, out / f"{name}.pt")
    dist.destroy_process_group()
    # Out without the interpreter's teardown, as the CLI's QuickExit leaves: gloo's worker
    # thread drops its last reference to a finished collective (and so to the tensors it
    # held, each with a Python object) after the call returned here; where that happens
    # during Py_FinalizeEx, the thread's GIL acquire ends it with pthread_exit inside a C++
    # destructor, and std::terminate aborts the rank (a core's backtrace under load:
    # ~AsyncAllreduceWork -> decref_pyobject -> take_gil -> PyThread_exit_thread).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
