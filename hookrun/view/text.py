"""Token texts as a page shows them: HTML-escaped, whitespace and invisible characters made
visible (a space `·`, a newline `⏎`, a tab `⇥`, others `⟨U+XXXX⟩`, the empty text `∅`), and a
window of tokens shaded by one unit's activation.
"""

from __future__ import annotations

import html
import math
import re

import numpy as np

__all__ = ["visible", "plain", "shade", "context_html", "context_text", "number", "TokenTexts"]

_MARKS = {" ": "·", "\n": "⏎", "\t": "⇥", "\r": "␍"}
# Whitespace, control and format characters: what would be invisible or move the text.
_HIDDEN = re.compile(r"[\s\x00-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u2028-\u202e\u2060-\u2064\ufeff]")
EMPTY = "∅"


def _mark(char: str) -> str:
    return _MARKS.get(char) or f"⟨U+{ord(char):04X}⟩"


def plain(text: str) -> str:
    """A token's text with its whitespace made visible, HTML-escaped, no markup added (the
    index's compact form)."""
    if not text:
        return EMPTY
    return html.escape(_HIDDEN.sub(lambda m: _mark(m.group(0)), text), quote=True)


def visible(text: str) -> str:
    """A token's text HTML-escaped, each visible mark of whitespace in a `ws` span (dimmed
    by the CSS), so that a page shows a space as `·` and a newline as `⏎` but a `·` the text
    holds as itself."""
    if not text:
        return f'<span class="ws">{EMPTY}</span>'
    parts, last = [], 0
    for found in _HIDDEN.finditer(text):
        parts.append(html.escape(text[last : found.start()], quote=True))
        parts.append(f'<span class="ws">{html.escape(_mark(found.group(0)))}</span>')
        last = found.end()
    parts.append(html.escape(text[last:], quote=True))
    return "".join(parts)


def number(value: float, digits: int = 4) -> str:
    """A float as the pages print it: `digits` significant digits, `—` for NaN."""
    value = float(value)
    if math.isnan(value):
        return "—"
    if math.isinf(value):
        return "∞" if value > 0 else "−∞"
    return f"{value:.{digits}g}"


def shade(value: float, scale: float) -> str:
    """The inline style of a token whose activation is `value`: an orange background of
    opacity value / scale (the unit's max), blue for a negative value, none for NaN or an
    opacity under 1/255 (as #rrggbbaa: a page holds thousands of tokens, every byte counts)."""
    if not math.isfinite(value) or not scale > 0:
        return ""
    alpha = round(min(abs(value) / scale, 1.0) * 255)
    if alpha == 0:
        return ""
    colour = "ff6a00" if value > 0 else "1f77ff"
    return f' style="background:#{colour}{alpha:02x}"'


class TokenTexts:
    """The vocabulary's texts, each made visible once (a page shows thousands of tokens)."""

    def __init__(self, vocab: list[str]) -> None:
        self.vocab = vocab
        self._visible: dict[int, str] = {}
        self._plain: dict[int, str] = {}

    def text(self, token: int) -> str:
        """The raw text of a token id (`⟨id N⟩` for one outside the vocabulary)."""
        return self.vocab[token] if 0 <= token < len(self.vocab) else f"⟨id {token}⟩"

    def visible(self, token: int) -> str:
        """`visible` of the token's text, remembered."""
        if token not in self._visible:
            self._visible[token] = visible(self.text(token))
        return self._visible[token]

    def plain(self, token: int) -> str:
        """`plain` of the token's text, remembered."""
        if token not in self._plain:
            self._plain[token] = plain(self.text(token))
        return self._plain[token]


def context_html(
    texts: TokenTexts, ids: np.ndarray, values: np.ndarray, centre: int, scale: float
) -> str:
    """A window of tokens as spans shaded by activation, the window's maximum (index
    `centre`, class `max`) outlined, each span's title its activation and token id; ids -1
    (outside the row) left out.

    Args:
        texts: The vocabulary.
        ids: (W,) token ids, -1 outside the row.
        values: (W,) the unit's activation at each.
        centre: The index of the window's maximum.
        scale: The unit's max, the activation of full opacity.

    Returns:
        The spans, joined.
    """
    spans = []
    for i, (token, value) in enumerate(zip(ids.tolist(), values.tolist(), strict=True)):
        if token < 0:
            continue
        cls = ' class="max"' if i == centre else ""
        spans.append(
            f'<span{cls}{shade(value, scale)} title="{number(value)} (id {token})">'
            f"{texts.visible(token)}</span>"
        )
    return "".join(spans)


def context_text(texts: TokenTexts, ids: np.ndarray) -> str:
    """The raw text of a window (ids -1 left out): what the index's search box searches."""
    return "".join(texts.text(t) for t in ids.tolist() if t >= 0)
