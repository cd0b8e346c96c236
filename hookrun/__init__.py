"""hookrun: a declarative experiment runner for PyTorch hooks."""

__version__ = "0.1.0"

__all__ = ["__version__"]
