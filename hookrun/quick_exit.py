"""Ending a successful CLI run without the interpreter's teardown of every module.

After torch and torchvision that teardown takes about 0.6 s of CPU, spent freeing what the
operating system frees anyway — a third of hookrun's fixed cost per process. It is skipped
only when nothing can need it: the exit handlers have run, no profiler or tracer is waiting
to write its report, no non-daemon thread is still working, no HDF5 file is open, and the
run imported no code but hookrun's own libraries. A user's module (a custom model, a class
named in a type selector, a logger) may hold open files or finalisers that only the
ordinary exit flushes, so its presence keeps the ordinary exit. Every doubt costs only time.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

import h5py

__all__ = ["QuickExit"]

# Libraries hookrun itself imports during a run (renderers, dataset kinds, model sources,
# Hydra's plugin discovery) whose objects need nothing at exit. tensorboard is not among
# them: its event writer flushes when the interpreter tears down.
OWN_LIBRARIES = frozenset(
    {
        "hookrun",
        "torch",
        # torch's own dependencies, which torch._dynamo imports when torchvision's ops load
        # (now when a run needs torchvision, no longer at `import hookrun`).
        "sympy",
        "mpmath",
        "triton",
        # torch._inductor imports colorama where it is installed (every torchvision run);
        # its one exit handler, reset_all, is registered with atexit, which leave() runs.
        "colorama",
        "torchvision",
        "timm",
        "huggingface_hub",
        "safetensors",
        "numpy",
        "h5py",
        "hydra",
        "hydra_plugins",
        "omegaconf",
        "yaml",
        "tqdm",
        "PIL",
        "matplotlib",
        "mpl_toolkits",
        "cycler",
        "dateutil",
        "fontTools",
        "kiwisolver",
        "pyparsing",
        "contourpy",
        "scipy",
        "skimage",
        "imageio",
        "tifffile",
        "lazy_loader",
        "sklearn",
        "joblib",
        "threadpoolctl",
        "cloudpickle",
        "narwhals",
        # model=hf / tiny_lm: transformers and what it and huggingface_hub import (nothing
        # is downloaded: the HTTP stack is loaded, never used). Its teardown was 1.3 s a run.
        "transformers",
        "tokenizers",
        "regex",
        "filelock",
        "jinja2",
        "markupsafe",
        "httpx",
        "httpx2",
        "httpcore",
        "httpcore2",
        "h11",
        "anyio",
        "sniffio",
        "idna",
        "certifi",
        "truststore",
        # What transformers imports when it finds them installed: accelerate (hookrun[hf]'s,
        # for model.device_map), psutil, sentencepiece, protobuf (`google`) and requests'
        # charset_normalizer; none of them writes anything at exit.
        "accelerate",
        "psutil",
        "sentencepiece",
        "google",
        "charset_normalizer",
        # dataset=hf_disk: datasets reads memory-mapped Arrow files and writes nothing.
        "datasets",
        "pyarrow",
        "pandas",
        "fsspec",
        "multiprocess",
        "dill",
        "xxhash",
    }
)


def _packages() -> set[str]:
    return {name.partition(".")[0] for name in list(sys.modules)}


class QuickExit:
    """Made before the run (what is loaded then is hookrun's start-up); `leave()` after a
    successful run ends the process at once when nothing needs the ordinary exit, and
    returns otherwise."""

    def __init__(self) -> None:
        self.loaded = _packages()

    def foreign(self) -> list[str]:
        """Packages the run imported that are neither the standard library's, nor loaded at
        start-up, nor hookrun's own libraries (C helpers named `_x` count as their owner's)."""
        new = _packages() - self.loaded - set(sys.stdlib_module_names) - OWN_LIBRARIES
        return sorted(name for name in new if not name.startswith("_"))

    def blocked(self) -> str:
        """Why the ordinary exit is needed ('' when it is not)."""
        if sys.gettrace() is not None or sys.getprofile() is not None:
            return "a tracer or profiler writes its report at exit"
        main = threading.main_thread()
        if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not main):
            return "a thread is still running"
        if h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE) > 0:
            return "an HDF5 file is open"
        foreign = self.foreign()
        if foreign:
            return f"the run imported {', '.join(foreign)}"
        return ""

    def leave(self, status: int = 0) -> None:
        """Run the exit handlers, flush, and end the process with `status` (0: a successful
        run; 143 / 130: one a signal stopped) — unless `blocked()`, or the output cannot be
        flushed; then return to the ordinary exit."""
        if self.blocked():
            return
        atexit._run_exitfuncs()  # logging's flush, and any handler a library registered
        try:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:  # None when started with the descriptor closed
                    stream.flush()
        except (OSError, ValueError):  # a closed pipe or file: Python's exit reports it
            return
        os._exit(status)
