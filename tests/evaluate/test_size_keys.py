"""Keys that size what the evaluation computes are refused before any work when they ask for
more than the input can give: a deletion or insertion step perturbs at least one pixel, a
ROAD fraction removes a count of pixels, so more of them than pixels only repeats columns
(and 10^8 steps once sat at 0 % with 6 GB resident, not stoppable)."""

from __future__ import annotations

import pytest
from conftest import run_config

from hookrun.errors import HookrunError
from hookrun.stages.evaluate.curves import DeletionArgs, InsertionArgs
from hookrun.stages.evaluate.registry import FAITHFULNESS_METRICS
from hookrun.stages.evaluate.road import RoadArgs

SMALL = [
    "experiment=grad_cam",
    "model=resnet18",
    "model.weights=null",
    "model.cam_layer=layer3",
    "dataset=fake",
    "dataset.image_size=32",
    "dataset.size=2",
    "evaluate=faithfulness",
    "render=false",
    "progress=false",
]


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "evaluate.deletion.steps=100000000",
            "evaluate.deletion.steps: 100000000 is more than the 1024 pixels of a 32x32 input "
            "(a step perturbs at least one); valid: 1 to 1024",
        ),
        (
            "evaluate.insertion.steps=1025",
            "evaluate.insertion.steps: 1025 is more than the 1024 pixels of a 32x32 input "
            "(a step perturbs at least one); valid: 1 to 1024",
        ),
        (
            "evaluate.road.fractions=[" + ",".join(["0.5"] * 1025) + "]",
            "evaluate.road.fractions: 1025 fractions, more than the 1024 pixels of a 32x32 "
            "input; valid: at most 1024 fractions",
        ),
    ],
)
def test_more_steps_than_pixels_stop_before_the_file(tmp_path, override, message):
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path, [*SMALL, override])
    assert str(err.value) == message
    assert not (tmp_path / "captures.h5").exists()


@pytest.mark.parametrize(
    "name,args",
    [("deletion", DeletionArgs), ("insertion", InsertionArgs)],
)
def test_one_step_per_pixel_is_the_most(name, args):
    metric = FAITHFULNESS_METRICS.get(name, "evaluate.metrics")
    metric.check_image(args(steps=12), f"evaluate.{name}", (3, 4))  # accepted
    with pytest.raises(HookrunError, match=rf"^evaluate.{name}.steps: 13 is more than the 12 "):
        metric.check_image(args(steps=13), f"evaluate.{name}", (3, 4))


def test_one_road_fraction_per_pixel_is_the_most():
    road = FAITHFULNESS_METRICS.get("road", "evaluate.metrics")
    road.check_image(RoadArgs(fractions=[0.5] * 12), "evaluate.road", (3, 4))
    with pytest.raises(HookrunError, match=r"^evaluate.road.fractions: 13 fractions"):
        road.check_image(RoadArgs(fractions=[0.5] * 13), "evaluate.road", (3, 4))
