"""Sparse dictionaries: SAEs and transcoders, read from disk and computed exactly.

The files as SAELens and circuit-tracer save them, their encode/decode, and TransformerLens
hook names placed on Hugging Face modules. The splicing hook action and sparse storage live
elsewhere; this package only reads files and computes.
"""

from hookrun.dictionaries.dictionary import Dictionary
from hookrun.dictionaries.load import load_dictionaries
from hookrun.dictionaries.sites import is_mlp, module_site

__all__ = ["Dictionary", "load_dictionaries", "module_site", "is_mlp"]
