"""Where generation is stored in captures.h5: /generation/tokens (N, steps) int32 (-1 after a
row stopped), /generation/mask (N, steps) bool, /generation/logprobs (N, steps) float32 (the
chosen token's log probability under the hooked model, NaN after a row stopped) and
/generation/text (N,) UTF-8, fixed width; with generate.fluency (the default) the same
tokens under the plain model, and where hooks change values whether they changed nothing
(/generation/unchanged); with generate.captures, each capture's site at every step under
/generation/captures."""

from __future__ import annotations

__all__ = [
    "GENERATION",
    "TOKENS",
    "MASK",
    "LOGPROBS",
    "LOGPROBS_UNHOOKED",
    "UNCHANGED",
    "UNCHANGED_TOLERANCE",
    "TEXT",
    "NO_TOKEN",
    "STEP_CAPTURES",
    "step_capture_key",
]

GENERATION = "generation"
TOKENS = f"{GENERATION}/tokens"
MASK = f"{GENERATION}/mask"
LOGPROBS = f"{GENERATION}/logprobs"
# The same tokens' log probabilities under the model without the run's hooks: how fluent
# the steered text is to the plain model (its mean over a row's tokens, in the summary).
LOGPROBS_UNHOOKED = f"{GENERATION}/logprobs_unhooked"
# (N,) bool, under hooks that change values: true where the model without them gives each
# of the row's tokens the same log probability (to UNCHANGED_TOLERANCE nats) and the same
# most likely token at every step — greedy, it writes the very same text: the hooks changed
# nothing the row shows (a constant added before a LayerNorm is taken out by its mean).
UNCHANGED = f"{GENERATION}/unchanged"
UNCHANGED_TOLERANCE = 1e-4
TEXT = f"{GENERATION}/text"
NO_TOKEN = -1  # /generation/tokens after a row's end token
# generate.captures: what a capture's site saw at each step (N, steps, ...), NaN after a
# row's end: /generation/captures/<module>/<site>, beside the run's own /captures/...
STEP_CAPTURES = f"{GENERATION}/captures"


def step_capture_key(capture: str) -> str:
    """/generation/captures/<module>/<site> of a capture path (captures/<module>/<site>)."""
    return f"{STEP_CAPTURES}/{capture.split('/', 1)[1]}"
