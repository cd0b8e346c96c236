"""A small hand-made features file (the layout the features job writes, docs/reference/
layout.md), for the viewer's tests: two text sites and one image site, k = 5, a window of
4 + 1 + 3 tokens, a vocabulary of hostile strings, padding for units that fired fewer than k
times, and one unit that never fired.

VOCAB pairs each token's text with what a page must show for it, written by hand (the
golden values the tests compare the pages with): a space is `·`, a newline `⏎`, a tab `⇥`,
an invisible character `⟨U+XXXX⟩`, the empty text `∅`, markup as its characters.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from hookrun.io.layout import JOB_ATTR, set_attrs

# (text, as a page shows it)
VOCAB: list[tuple[str, str]] = [
    ("<script>window.pwned=1</script>", "<script>window.pwned=1</script>"),  # 0
    ("<img src=x onerror=window.pwned=2>", "<img·src=x·onerror=window.pwned=2>"),  # 1
    ("&amp;", "&amp;"),  # 2
    ('"', '"'),  # 3
    ("'", "'"),  # 4
    (" the", "·the"),  # 5
    ("\n", "⏎"),  # 6
    ("\n\n", "⏎⏎"),  # 7
    ("  ", "··"),  # 8
    ("\t", "⇥"),  # 9
    ("</span>", "</span>"),  # 10
    ("a b", "a·b"),  # 11
    ("", "∅"),  # 12
    ("\u200b", "⟨U+200B⟩"),  # 13
    ("café", "café"),  # 14
    ("日本", "日本"),  # 15
    ('" onmouseover="window.pwned=3', '"·onmouseover="window.pwned=3'),  # 16
    ("<!--", "<!--"),  # 17
    ("Hello", "Hello"),  # 18
    (" world", "·world"),  # 19
    ("·", "·"),  # 20: a middle dot the text holds
    ("\r\n", "␍⏎"),  # 21
    (" cat", "·cat"),  # 22
    (" dog", "·dog"),  # 23
    (" sat", "·sat"),  # 24
    (" on", "·on"),  # 25
    (" mat", "·mat"),  # 26
    (".", "."),  # 27
    (",", ","),  # 28
    (" and", "·and"),  # 29
    (" of", "·of"),  # 30
    (" to", "·to"),  # 31
    (" in", "·in"),  # 32
    ("ing", "ing"),  # 33
    ("ed", "ed"),  # 34
    (" zebra", "·zebra"),  # 35
    (" quantum", "·quantum"),  # 36
    ("{", "{"),  # 37
    ("}", "}"),  # 38
    ("\\", "\\"),  # 39
    ("%", "%"),  # 40
    ("$", "$"),  # 41
    (" 42", "·42"),  # 42
    (" x", "·x"),  # 43
    ("=", "="),  # 44
    ("<", "<"),  # 45
    (">", ">"),  # 46
    (" </script>", "·</script>"),  # 47
    (" π", "·π"),  # 48
    (" end", "·end"),  # 49
    ("\x00", "⟨U+0000⟩"),  # 50: a byte-level BPE's NUL token
    ("a\x00", "a⟨U+0000⟩"),  # 51: a trailing NUL, which a fixed-length string drops
]
SHOWN = [shown for _, shown in VOCAB]
TEXT_SITES = [("transformer.h.0", "output", "units", 30), ("transformer.h.1", "output", "sae", 24)]
IMAGE_SITE = ("features.3", "output", "units", 6)
K, BEFORE, AFTER = 5, 4, 3
W = BEFORE + 1 + AFTER
GROUPS, PER_GROUP, BINS, LOGITS = 3, 2, 8, 4
ROWS, ROW_TOKENS = 40, 16
TOKENS = ROWS * ROW_TOKENS
PATCH = 8
# The hand-made units of the dictionary's site (transformer.h.1): unit 0 fired twice, unit 1
# never, unit 2's top context holds the script tag at its maximum, unit 3 hostile strings
# around ` the`, unit 4 the only one whose top context holds ` zebra`.
PARTIAL, NEVER, SCRIPT, HOSTILE, ZEBRA = 0, 1, 2, 3, 4
HAND_CONTEXTS = {
    SCRIPT: [-1, 18, 19, 6, 0, 2, 3, 49],  # Hello·world⏎<script>…&amp;"·end
    HOSTILE: [1, 16, 8, 9, 5, 10, 17, 51],
    ZEBRA: [22, 24, 25, 5, 35, 27, 6, 7],
}
COMMON = [22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 43, 44, 14, 48]


def _window(rng: np.random.Generator, token: int) -> np.ndarray:
    """Token ids around position `token` of a row of ROW_TOKENS (-1 outside the row)."""
    ids = rng.choice(COMMON, size=W)
    positions = token - BEFORE + np.arange(W)
    ids[(positions < 0) | (positions >= ROW_TOKENS)] = -1
    return ids


def _samples(rng: np.random.Generator, values: np.ndarray, text: bool) -> dict[str, np.ndarray]:
    """Rows, tokens and (text) windows for samples of activations `values` (NaN: padding)."""
    n = len(values)
    rows = np.full(n, -1, np.int64)
    tokens = np.full(n, -1, np.int64)
    context = np.full((n, W), -1, np.int64)
    context_value = np.full((n, W), np.nan, np.float32)
    for i, value in enumerate(values):
        if np.isnan(value):
            continue
        rows[i], tokens[i] = rng.integers(ROWS), rng.integers(ROW_TOKENS)
        context[i] = _window(rng, int(tokens[i]))
        context_value[i] = rng.uniform(0, value * 0.8, W) * (rng.random(W) < 0.6)
        context_value[i, BEFORE] = value
        context[i, BEFORE] = max(context[i, BEFORE], 22)  # the maximum is inside the row
    out = {"row": rows, "token": tokens}
    if text:
        out |= {"context": context, "context_value": context_value}
    return out


def _site(
    f: h5py.File, rng: np.random.Generator, module: str, site: str, kind: str, units: int, *,
    image: bool = False, logits: bool = False,
) -> None:  # fmt: skip
    k = 3 if image else K
    g = f.create_group(f"features/{module}/{site}")
    top = np.full((units, k), np.nan, np.float32)
    fired = np.zeros(units, np.int64)
    for u in range(units):
        n = k
        if not image and kind == "sae" and u == PARTIAL:
            n = 2
        if (not image and kind == "sae" and u == NEVER) or (image and u == units - 1):
            n = 0 if not image else 1
        top[u, :n] = np.sort(rng.uniform(0.2, 3.0, n))[::-1]
        fired[u] = 0 if n == 0 else int(rng.integers(n, 60))
    fired[5:8] = fired[5]  # ties of density, which sorting breaks by unit
    unit_max = np.where(np.isnan(top[:, 0]), 0.0, top[:, 0]).astype(np.float32)
    g["max"] = unit_max
    g["density"] = fired / TOKENS
    g["top/value"] = top
    parts = [_samples(rng, top[u], not image) for u in range(units)]
    for name in parts[0]:
        g[f"top/{name}"] = np.stack([p[name] for p in parts])
    if not image and kind == "sae":
        for u, ids in HAND_CONTEXTS.items():
            g["top/context"][u, 0] = ids
            g["top/token"][u, 0] = BEFORE if ids[0] >= 0 else BEFORE - 1
    if image:
        patch = np.zeros((units, k, 3, PATCH, PATCH), np.uint8)
        y, x = np.mgrid[0:PATCH, 0:PATCH]
        for u in range(units):
            for r in range(k):
                for c in range(3):
                    patch[u, r, c] = (u * 40 + r * 10 + c * 90 + y * 16 + x * 3) % 256
        g["top/patch"] = patch
        box = np.stack([np.arange(units * k) % 4, np.arange(units * k) % 3], -1).reshape(
            units, k, 2
        )
        g["top/box"] = np.concatenate([box, box + PATCH], -1).astype(np.int64)
    edges = np.stack([np.linspace(0, m, GROUPS + 1) for m in unit_max]).astype(np.float32)
    g["quantiles/edges"] = edges
    qvalues = np.full((units, GROUPS, PER_GROUP), np.nan, np.float32)
    for u in range(units):
        if unit_max[u] > 0:
            for q in range(GROUPS):
                qvalues[u, q] = rng.uniform(edges[u, q], edges[u, q + 1], PER_GROUP)
    qvalues[0, 0, 1] = np.nan  # a group with fewer samples than per_group
    g["quantiles/value"] = qvalues
    qparts = [
        [_samples(rng, qvalues[u, q], not image) for q in range(GROUPS)] for u in range(units)
    ]
    for name in qparts[0][0]:
        g[f"quantiles/{name}"] = np.stack([np.stack([p[name] for p in qs]) for qs in qparts])
    g["histogram/edges"] = np.stack(
        [np.linspace(0, max(m, 1e-3), BINS + 1) for m in unit_max]
    ).astype(np.float32)
    counts = rng.integers(0, 50, (units, BINS))
    counts[fired == 0] = 0
    g["histogram/counts"] = counts
    if logits:
        g["logits/top_token"] = rng.choice(COMMON, (units, LOGITS))
        g["logits/top_value"] = np.sort(rng.uniform(0.1, 2, (units, LOGITS)))[:, ::-1].astype(
            np.float32
        )
        bottom = rng.choice(COMMON, (units, LOGITS))
        bottom[HOSTILE] = [0, 1, 16, 15]
        bottom[SCRIPT] = [50, 51, 12, 13]
        g["logits/bottom_token"] = bottom
        g["logits/bottom_value"] = -np.sort(rng.uniform(0.1, 2, (units, LOGITS)))[:, ::-1].astype(
            np.float32
        )
    set_attrs(g, {
        "kind": kind, "units": units, "modality": "image" if image else "text",
        "hook_name": f"{module}.hook_out", "k": k, "window_before": 0 if image else BEFORE,
        "window_after": 0 if image else AFTER, "tokens": TOKENS, "rows": ROWS,
        "groups": GROUPS, "per_group": PER_GROUP,
    } | ({"dictionary": "tiny_sae"} if kind == "sae" else {}))  # fmt: skip
    # A dimension's scale inside the group, as hookrun names axes: not a site, not a part.
    g["unit"] = np.arange(units)
    g["unit"].make_scale("unit")
    g["max"].dims[0].attach_scale(g["unit"])


def write_features_file(
    run_dir: Path, *, status: str = "complete", features: bool = True, seed: int = 44
) -> Path:
    """Write `run_dir/captures.h5` as a features job would (see the module's docstring).

    Args:
        run_dir: The run folder (made).
        status: The file's status attribute.
        features: False writes a file with no /features group (another job's file).
        seed: The random parts' seed.

    Returns:
        The file's path.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "captures.h5"
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        set_attrs(f, {JOB_ATTR: "features" if features else "train_sae", "status": status})
        set_attrs(f, {"completed": ROWS, "experiment": "features"})
        if not features:
            f["model/output"] = np.zeros((2, 3), np.float32)
            return path
        # As the job stores it (and /model/vocabulary): fixed-length UTF-8 and each text's
        # bytes, since a fixed-length string loses its trailing NULs.
        encoded = [t.encode("utf-8") for t, _ in VOCAB]
        f["features/vocab"] = np.array(encoded, dtype=f"S{max(map(len, encoded))}")
        f["features/vocab_length"] = np.array([len(e) for e in encoded], np.int32)
        f["features/window"] = np.arange(W)  # a scale beside the modules
        for module, site, kind, units in TEXT_SITES:
            _site(f, rng, module, site, kind, units, logits=kind == "sae")
        module, site, kind, units = IMAGE_SITE
        _site(f, rng, module, site, kind, units, image=True)
    return path
