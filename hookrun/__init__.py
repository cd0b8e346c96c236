"""hookrun: a declarative experiment runner for PyTorch hooks.

From Python: `hookrun.run(overrides, model=..., dataset=...)` runs an experiment and returns
a `Result`; `hookrun.compose(overrides)` returns the validated spec without running;
`hookrun.open(path)` reads a captures.h5. From the shell: `python -m hookrun`.
"""

import os

# MKL's numbers depend on memory alignment unless its Conditional Numerical Reproducibility
# is on: without it, the same run gave input gradients that differed in the last bit from
# one run to the next. Set before torch first calls MKL; a user's own setting wins.
os.environ.setdefault("MKL_CBWR", "AUTO")

from hookrun.api import compose, run  # noqa: E402
from hookrun.errors import HookrunError  # noqa: E402
from hookrun.io.results import open_results as open  # noqa: A001, E402  (the documented name)
from hookrun.pipeline.finish import Result  # noqa: E402
from hookrun.version import __version__  # noqa: E402

__all__ = ["__version__", "HookrunError", "Result", "compose", "open", "run"]
