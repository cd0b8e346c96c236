"""hookrun: a declarative experiment runner for PyTorch hooks.

`hookrun.open(path)` reads a captures.h5 (see hookrun/results.py); the runner itself is
`python -m hookrun`.
"""

from hookrun.results import open_results as open  # noqa: A001  (the documented name)

__version__ = "0.1.0"

__all__ = ["__version__", "open"]
