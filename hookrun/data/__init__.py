"""Data: the dataset kinds (a registry) and the loader that batches them in dataset order.

The token kinds (text, prompts, repeated_tokens, hf_disk) register themselves in their own modules,
imported here so that `hookrun.data.kinds.DATASETS` always lists them."""

from hookrun.data import hf_disk as hf_disk
from hookrun.data import prompts as prompts
from hookrun.data import repeated as repeated
from hookrun.data import text as text
from hookrun.data import tokens as tokens
