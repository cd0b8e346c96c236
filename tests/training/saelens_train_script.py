"""Run by the SAELens venv's python (tests/reference_venvs.py), never imported by hookrun or
by a test: SAELens 6.54's SAETrainer trains each case's training SAE on given batches, from
given initial weights, and SAELens loads folders hookrun saved; the results go beside it.

Usage: python saelens_train_script.py SPEC_JSON OUT_DIR. SPEC_JSON holds:

- "data": a safetensors file with "train" (steps * batch, d_in) and "heldout" (n, d_in);
- "cases": name -> {"architecture": SAELens's training name, "sae": the training config's
  keyword arguments, "trainer": SAETrainerConfig's, "init": a safetensors file of initial
  parameters (b_dec, W_dec, W_enc, b_enc[, threshold])}; each is trained the way
  SAETrainer.fit loops (maybe_reset_sparsity, step, n_training_steps += 1), then saved with
  save_inference_model (+ sparsity.safetensors, as the training runner writes them) into
  OUT_DIR/<name>/, and OUT_DIR/<name>.results.safetensors holds each step's loss and lr and
  the held-out latents (z) and reconstruction (out) of the saved SAE, loaded back;
- "load": name -> a folder hookrun saved: SAE.load_from_disk, the held-out latents and
  reconstruction into OUT_DIR/load_<name>.safetensors;
- "bench" (optional): {"repeats": r}: each case trained r times from its init, the seconds
  of each run's steps (after one warm-up step, wall and CPU) into OUT_DIR/bench.json with
  peak memory;
  "only": true skips the training and saving above.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import sae_lens
import torch
from sae_lens.config import SAETrainerConfig
from sae_lens.saes.sae import SAE, SAEMetadata
from sae_lens.training.sae_trainer import SAETrainer
from safetensors.torch import load_file, save_file

TRAINING = {
    "standard": (sae_lens.StandardTrainingSAE, sae_lens.StandardTrainingSAEConfig),
    "topk": (sae_lens.TopKTrainingSAE, sae_lens.TopKTrainingSAEConfig),
    "batchtopk": (sae_lens.BatchTopKTrainingSAE, sae_lens.BatchTopKTrainingSAEConfig),
    "jumprelu": (sae_lens.JumpReLUTrainingSAE, sae_lens.JumpReLUTrainingSAEConfig),
    "matryoshka_batchtopk": (
        sae_lens.MatryoshkaBatchTopKTrainingSAE,
        sae_lens.MatryoshkaBatchTopKTrainingSAEConfig,
    ),
}


def _trainer(case: dict, d_in: int) -> SAETrainer:
    sae_cls, cfg_cls = TRAINING[case["architecture"]]
    cfg = cfg_cls(d_in=d_in, metadata=SAEMetadata(hook_name="hook"), **case["sae"])
    sae = sae_cls(cfg)
    missing, unexpected = sae.load_state_dict(load_file(case["init"]), strict=False)
    assert not unexpected and set(missing) <= {"topk_threshold"}, (missing, unexpected)
    return SAETrainer(SAETrainerConfig(**case["trainer"]), sae, data_provider=iter(()))


def _train(trainer: SAETrainer, batches: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    losses, lrs = [], []
    for batch in batches:
        trainer.maybe_reset_sparsity()
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        out = trainer.step(batch)
        losses.append(out.loss.item())
        trainer.n_training_steps += 1
    return losses, lrs


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    data = load_file(spec["data"])
    train, heldout = data["train"], data["heldout"]
    d_in = train.shape[1]
    bench_only = spec.get("bench", {}).get("only", False)
    for name, case in {} if bench_only else spec.get("cases", {}).items():
        batch = case["trainer"]["train_batch_size_samples"]
        batches = list(train.split(batch))
        trainer = _trainer(case, d_in)
        losses, lrs = _train(trainer, batches)
        trainer.set_final_sae_metadata()
        folder = out_dir / name
        trainer.sae.save_inference_model(folder)
        save_file({"sparsity": trainer.log_feature_sparsity}, folder / "sparsity.safetensors")
        saved = SAE.load_from_disk(folder)
        with torch.no_grad():
            z = saved.encode(heldout)
            save_file(
                {
                    "loss": torch.tensor(losses, dtype=torch.float64),
                    "lr": torch.tensor(lrs, dtype=torch.float64),
                    "z": z.contiguous(),
                    "out": saved.decode(z).contiguous(),
                },
                out_dir / f"{name}.results.safetensors",
            )
    for name, folder in spec.get("load", {}).items():
        sae = SAE.load_from_disk(folder)
        with torch.no_grad():
            z = sae.encode(heldout)
            tensors = {"z": z.contiguous(), "out": sae.decode(z).contiguous()}
        save_file(tensors, out_dir / f"load_{name}.safetensors")
    if "bench" in spec:
        torch.set_num_threads(spec["bench"].get("threads", torch.get_num_threads()))
        seconds: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}  # the process's CPU seconds: readable under load
        for name, case in spec["cases"].items():
            batches = list(train.split(case["trainer"]["train_batch_size_samples"]))
            for _ in range(spec["bench"]["repeats"]):
                trainer = _trainer(case, d_in)
                _train(trainer, batches[:1])  # warm-up
                start, start_cpu = time.perf_counter(), time.process_time()
                _train(trainer, batches[1:])
                seconds.setdefault(name, []).append(time.perf_counter() - start)
                cpu.setdefault(name, []).append(time.process_time() - start_cpu)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        (out_dir / "bench.json").write_text(
            json.dumps({"seconds": seconds, "cpu_seconds": cpu, "peak_rss": peak})
        )


if __name__ == "__main__":
    main()
