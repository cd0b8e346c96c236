"""Run by the SAELens venv's python (tests/reference_venvs.py), never imported by hookrun:
SAELens's own `SAE.load_from_disk` of each folder hookrun trained, its latents and
reconstruction of the given inputs saved beside it.

Usage: python saelens_load_script.py FOLDERS_JSON INPUTS.safetensors OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import sae_lens
import torch
from safetensors.torch import load_file, save_file


def main(folders: list[str], inputs: Path, out: Path) -> None:
    x = load_file(str(inputs))["x"]
    for i, folder in enumerate(folders):
        sae = sae_lens.SAE.load_from_disk(folder, device="cpu").eval()
        with torch.no_grad():
            z = sae.encode(x)
            recon = sae.decode(z)
        save_file(
            {"latents": z.contiguous(), "reconstruction": recon.contiguous()},
            str(out / f"{i}.safetensors"),
        )
        print(f"{folder}: {type(sae).__name__}")
    print(f"saelens {sae_lens.__version__}")


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]), Path(sys.argv[3]))
