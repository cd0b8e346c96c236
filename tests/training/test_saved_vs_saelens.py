"""SAELens 6.54 loads what hookrun trains (SAE.load_from_disk, in its own venv) and gets the
latents and reconstructions hookrun's trainer gives, every architecture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hookrun.training.dictionary import Hyper, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_venvs import saelens_python  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("saelens_load_script.py")
CASES = {
    "relu": {"l1_coefficient": 0.05},
    "topk": {"k": 4},
    "batchtopk": {"k": 4},
    "jumprelu": {"jumprelu_init_threshold": 0.05, "l0_coefficient": 0.01},
    "matryoshka_batchtopk": {"k": 4, "matryoshka_widths": (8, 16, 32)},
    "relu_scaled": {"l1_coefficient": 0.05, "scale": 0.4},
}


def _data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.rand(n, 40, generator=g) * (torch.rand(n, 40, generator=g) < 0.1)
    return codes @ torch.randn(40, 12, generator=g)


def test_saelens_loads_every_architecture_and_gets_the_same_latents(tmp_path: Path):
    trainers, folders = [], []
    for name, extra in CASES.items():
        arch = name.removesuffix("_scaled")
        hyper = Hyper(arch, d_in=12, d_out=12, width=32, lr=1e-2, total_steps=30, **extra)
        trainer = Trainer(hyper, torch.Generator().manual_seed(0))
        for s in range(30):
            trainer.step(_data(64, s))
        trainer.save(tmp_path / name, "blocks.0.hook_resid_post", {"model_name": "tiny"})
        trainers.append(trainer)
        folders.append(str(tmp_path / name))
    x = _data(50, 999)
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    (tmp_path / "folders.json").write_text(json.dumps(folders))
    done = subprocess.run(
        [
            str(saelens_python()),
            str(SCRIPT),
            str(tmp_path / "folders.json"),
            str(tmp_path / "x.safetensors"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "saelens 6.54.0" in done.stdout
    for i, trainer in enumerate(trainers):
        theirs = load_file(str(tmp_path / f"{i}.safetensors"))
        ours = trainer.encode(x)
        assert (ours != 0).any(), list(CASES)[i]
        torch.testing.assert_close(theirs["latents"], ours, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            theirs["reconstruction"], trainer.decode(ours), atol=1e-5, rtol=1e-5
        )
