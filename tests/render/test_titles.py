"""Contact-sheet column titles fit their column (long module names used to run into the
next column's title)."""

from __future__ import annotations

from hookrun.render.draw import _wrapped


def test_long_titles_wrap_after_dots_and_keep_every_character():
    title = "guided_grad_cam @ encoder.layers.encoder_layer_11.ln_1"
    lines = _wrapped(title).split("\n")
    assert len(lines) == 2 and all(len(line) <= 32 for line in lines)
    assert lines[0].endswith(".")  # broken after a dot, not inside a name
    assert "".join(lines) == title
    assert _wrapped("grad_cam @ features.18") == "grad_cam @ features.18"
