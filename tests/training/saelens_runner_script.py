"""Run by the SAELens venv's python (tests/reference_venvs.py), never imported by hookrun or
by a test: SAELens 6.54's `LanguageModelSAETrainingRunner` trains one topk SAE on
activations streamed from the tiny GPT-2 through its `ActivationsStore`, for
tests/benchmarks/train_sae_streamed.py.

Usage: python saelens_runner_script.py SPEC_JSON OUT_JSON. SPEC_JSON holds "model_dir" (the
HF checkpoint, built offline as a TransformerLens HookedTransformer by
tests/dictionaries/saelens_evals_script.py's `hooked_gpt2`), "tokens" (a safetensors file of
pre-tokenised rows, (N, context) int64, given to the runner as a HF `datasets.Dataset`
through `override_dataset`), "hook" (TransformerLens hook name), "output" (the folder the
runner saves its SAE into) and "runner" (LanguageModelSAERunnerConfig's keyword arguments,
less `sae`) and "sae" (TopKTrainingSAEConfig's). OUT_JSON gets the seconds of the runner's
`run()` and of its trainer's `fit()` (the training loop: every LLM batch and SAE step), the
samples trained on, torch's thread count and versions. No wandb, no evals, no checkpoints.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import datasets
import sae_lens
import torch
from sae_lens import (
    LanguageModelSAERunnerConfig,
    LanguageModelSAETrainingRunner,
    TopKTrainingSAEConfig,
)
from sae_lens.config import LoggingConfig
from sae_lens.training.sae_trainer import SAETrainer
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dictionaries"))
from saelens_evals_script import hooked_gpt2  # noqa: E402

_FIT: dict[str, float] = {}
_fit = SAETrainer.fit


def _timed_fit(self: SAETrainer):
    """SAETrainer.fit, timed: the runner calls it once (the training loop)."""
    start = time.perf_counter()
    out = _fit(self)
    _FIT["seconds"] = time.perf_counter() - start
    _FIT["samples"] = self.n_training_samples
    return out


SAETrainer.fit = _timed_fit


def main(spec_file: Path, out: Path) -> None:
    spec = json.loads(spec_file.read_text())
    model, hf = hooked_gpt2(Path(spec["model_dir"]))
    del hf  # only its weights were needed
    tokens = load_file(spec["tokens"])["tokens"].long()
    dataset = datasets.Dataset.from_dict({"tokens": tokens.tolist()})
    cfg = LanguageModelSAERunnerConfig(
        sae=TopKTrainingSAEConfig(**spec["sae"]),
        hook_name=spec["hook"],
        logger=LoggingConfig(log_to_wandb=False),
        output_path=spec["output"],
        **spec["runner"],
    )
    start = time.perf_counter()
    runner = LanguageModelSAETrainingRunner(cfg, override_dataset=dataset, override_model=model)
    runner.run()
    run_seconds = time.perf_counter() - start
    result = {
        "run_seconds": run_seconds,
        "fit_seconds": _FIT["seconds"],
        "samples": _FIT["samples"],
        "threads": torch.get_num_threads(),
        "saelens": sae_lens.__version__,
        "torch": torch.__version__,
    }
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
