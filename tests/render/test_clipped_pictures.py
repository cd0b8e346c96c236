"""Attribution pictures people can read: a map's channels are summed and its 1 % of pixels
of largest |value| saturate (Adebayo et al.'s 99th percentile; numpy by hand), signed or by
magnitude; the drawn picture is no longer nearly black where
a few large values used to set the scale; render_style=seed keeps the seeds' normalize for
the guided-backprop pictures, and a bad style is refused."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import read, run_config
from PIL import Image

from hookrun.errors import HookrunError
from hookrun.render.pictures import attribution_overlay, clipped, seed_normalize


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("outliers", [2.0, 1.0, 10.0])
def test_clipping_is_the_percentile_by_hand(signed, outliers):
    rng = np.random.default_rng(0)
    value = rng.standard_cauchy((3, 20, 24))  # heavy tails: a few values set any max
    summed = value.sum(0)
    shown = summed if signed else np.abs(summed)
    top = np.percentile(np.abs(summed), 100 - outliers)
    want = np.clip(shown / top, -1 if signed else 0, 1)
    np.testing.assert_allclose(clipped(value, signed, outliers), want, atol=1e-12)
    saturated = np.isclose(np.abs(want), 1.0).mean()
    assert abs(saturated - outliers / 100) <= 1 / want.size + 1e-9


def test_a_few_large_values_no_longer_leave_the_picture_black():
    rng = np.random.default_rng(1)
    value = rng.normal(size=(3, 32, 32))
    value[:, 3, 4] = 1e4  # one pixel far above the rest
    photo = np.full((3, 32, 32), 0.5)
    drawn = attribution_overlay(photo, value, signed=True)
    plain = np.abs(value.sum(0)) / np.abs(value.sum(0)).max()  # max scaling: all but one ~0
    assert np.median(plain) < 1e-3
    assert np.median(np.abs(clipped(value, True))) > 0.2  # the rest visible once clipped
    assert drawn.shape == (3, 32, 32) and drawn.min() >= 0 and drawn.max() <= 1
    assert np.abs(drawn - photo.mean()).max() > 0.3  # colour where the map is large


def _sheet(result) -> np.ndarray:
    return np.asarray(Image.open(result.images / "00000_gradient.png").convert("RGB"))


def test_the_seeds_pictures_keep_their_normalize_and_the_style_is_chosen(tmp_path):
    args = [
        "model=seed_convnet",
        "dataset=fake",
        "dataset.size=2",
        "dataset.image_size=16",
        "dataset.channels=1",
        "dataset.num_classes=2",
        "limit=2",
        "target.kind=index",
        "target.index=0",
        "+hooks.g.select.name=input",
        "+hooks.g.at=grad_output",
        "+hooks.g.action=capture",
        "+hooks.p.select.name=input",
        "+hooks.p.at=output",
        "+hooks.p.action=capture",
    ]
    seed = run_config(tmp_path / "seed", [*args, "render_style=seed"])
    clip = run_config(tmp_path / "clip", [*args, "render_style=clipped"])
    grad = read(seed.path)["captures/input/grad_output"][0]
    want = (np.clip(seed_normalize(grad.astype(np.float32)), 0, 1) * 255).round()
    got = _sheet(seed).astype(np.float64)
    factor = got.shape[0] // grad.shape[-1]
    np.testing.assert_array_equal(got[::factor, ::factor], np.repeat(want[0][..., None], 3, -1))
    assert not np.array_equal(_sheet(clip), _sheet(seed))
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "bad", [*args, "render_style=pretty"])
    assert "render_style: 'pretty'; valid: auto, clipped, seed" in str(err.value)
