"""Every class of bad input stops before any work with one message: key, value, choices."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import SEED_MLP, folder_resnet, hook, hookrun_cli, run_config
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException
from PIL import Image

from hookrun.errors import HookrunError

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["dataset.size=2", "dataset.image_size=32"]
CAPTURE_L1 = hook("a", "layer1", "output", "capture")

# (overrides, words the message must contain)
HOOKRUN_ERRORS = [
    (["model.name=resnt18"], ["model.name", "resnt18", "resnet18"]),
    ([*hook("a", "layer1", "output", "captur")], ["hooks.a.action", "captur", "capture, scale"]),
    ([*hook("a", "layer1", "outptu", "capture")], ["hooks.a.at", "outptu", "grad_output"]),
    ([*hook("a", "type=ReLu", "output", "capture")], ["hooks.a.select.type", "ReLu", "ReLU"]),
    (
        ["++hooks.a.select.regex='\"layer[1\"'", "++hooks.a.at=output", "++hooks.a.action=capture"],
        ["hooks.a.select.regex", "layer[1", "not a valid regex"],
    ),
    ([*hook("a", "layer5", "output", "capture")], ["hooks.a.select", "layer5", "layer4"]),
    ([*hook("a", "input", "input", "capture")], ["hooks.a.at", "input", "grad_output"]),
    ([*hook("a", "layer1", "output", "scale", factr=2)], ["hooks.a.args.factr", "factor"]),
    ([*hook("a", "layer1", "output", "scale", factor="abc")], ["hooks.a.args.factor", "abc"]),
    ([*hook("a", "layer1", "output", "clamp")], ["hooks.a.args", "min, max"]),
    (
        [
            "++hooks.a.select.name=layer1",
            "++hooks.a.at=output",
            "++hooks.a.action=capture",
            "++hooks.a.colour=red",
        ],
        ["hooks.a.colour", "unknown key", "select, at, action, args"],
    ),
    ([*CAPTURE_L1, *hook("b", "layer1", "output", "capture")], ["hooks.b", "layer1/output"]),
    (["batch_size=0"], ["batch_size", "0", ">= 1"]),
    (["limit=-1"], ["limit", "-1", ">= 1"]),
    (["dataset.image_size=0"], ["dataset.image_size", "0", ">= 1"]),
    (["dataset.size=0"], ["dataset.size", "0", ">= 1"]),
    (["device.name=gpu"], ["device.name", "gpu", "cpu, cuda, cuda:N, auto"]),
    (["target.kind=index", "target.index=1000"], ["target.index", "1000", "0..999"]),
    (["target.kind=index"], ["target.index", "target.kind=index"]),
    (
        ["target.kind=none", "experiment=guided_bp", "dataset=fake", "model.weights=null"],
        ["target.kind", "none", "predicted"],
    ),
    ([*SEED_MLP, "target.kind=label"], ["target.kind", "label", "no labels"]),
    (["model.weights=/no/such/file.pt"], ["model.weights", "/no/such/file.pt", "IMAGENET1K_V1"]),
    (["model=custom", "model._target_=no.such.Net"], ["model._target_", "no.such.Net"]),
    (["dataset=image_folder", "dataset.root=/no/such/dir"], ["dataset.root", "/no/such/dir"]),
    (["+model.kwargs.colour=1"], ["model.kwargs", "colour"]),
    (
        [*hook("a", "layer1", "output", "capture"), "++hooks.a.backward=guided"],
        ["hooks.a.backward", "guided", "grad_input and grad_output"],
    ),
    (["++derive.gradcam.layer=layer4"], ["derive.gradcam", "grad_cam, cam, guided_grad_cam"]),
    (["++derive.grad_cam.layer=layer4"], ["derive.grad_cam", "/captures/layer4/output"]),
    (["++derive.grad_cam={}"], ["derive.grad_cam.layer", "model.cam_layer"]),
    (["logger=wandb"], ["logger", "wandb", "tensorboard"]),
    (["render_max=0"], ["render_max", "0", ">= 1"]),
    (["resume=true", "sink.overwrite=true"], ["sink.overwrite", "resume=true"]),
    ([*hook("p", "layer1", "output", "capture", pool="mean")], ["hooks.p.args.pool", "avg, max"]),
]


@pytest.mark.parametrize("overrides,words", HOOKRUN_ERRORS, ids=lambda v: str(v)[:40])
@pytest.mark.slow
def test_bad_input_message(tmp_path, overrides, words):
    with pytest.raises(HookrunError) as info:
        run_config(
            tmp_path, [*SMALL, *overrides] if "dataset=" not in str(overrides) else overrides
        )
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert not (tmp_path / "captures.h5").exists()


# Caught by Hydra/OmegaConf while composing: its message names the key and the choices.
HYDRA_ERRORS = [
    (["model=resnt18"], ["model/resnt18", "resnet18"]),
    (["experiment=guided"], ["experiment/guided", "guided_bp"]),
    (["dataset=fak"], ["dataset/fak", "fake"]),
    (["batch_size=abc"], ["abc", "Integer"]),
    (["batch_sise=3"], ["batch_sise"]),
    (["sink.dtype=float64"], ["float64", "float32, float16"]),
    (["sink.compression=zip"], ["zip", "lzf, gzip"]),
    (["target.kind=labl"], ["labl", "predicted"]),
]


@pytest.mark.parametrize("overrides,words", HYDRA_ERRORS, ids=lambda v: str(v)[:40])
def test_bad_input_rejected_by_schema(tmp_path, overrides, words):
    with pytest.raises((HydraException, OmegaConfBaseException)) as info:
        run_config(tmp_path, overrides)
    text = f"{info.value} {getattr(info.value, '__cause__', '')}"
    for word in words:
        assert word in text, f"{word!r} not in {text!r}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only machine")
@pytest.mark.parametrize(
    "overrides,match",
    [
        (["dataset=digits", "dataset.split=val"], r"dataset.split: 'val'; valid: train, test, all"),
        (["dataset=samples", "dataset.names=[cat]"], r"dataset.names: 'cat' .* chelsea, coffee"),
    ],
)
def test_bad_dataset_choice(tmp_path, overrides, match):
    with pytest.raises(HookrunError, match=match):
        run_config(tmp_path, overrides)


def test_cuda_asked_for_but_absent(tmp_path):
    with pytest.raises(HookrunError, match=r"device.name: 'cuda' but CUDA is not available"):
        run_config(tmp_path, ["device=cuda", *SMALL])


def test_corrupt_weights_file(tmp_path):
    bad = tmp_path / "w.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(HookrunError, match=r"model.weights: .*w.pt is not a readable state_dict"):
        run_config(tmp_path, [f"model.weights={bad}", *SMALL])


@pytest.mark.slow
def test_mismatched_weights_file(tmp_path):
    import torchvision

    path = tmp_path / "r50.pt"
    torch.save(torchvision.models.resnet50().state_dict(), path)
    with pytest.raises(HookrunError) as info:
        run_config(tmp_path, [f"model.weights={path}", *SMALL])  # the model is resnet18
    assert "does not fit resnet18" in str(info.value)
    assert "unexpected: " in str(info.value) and "shape: " in str(info.value)


def test_weights_name_without_network_says_where_to_put_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    import torch.hub

    def refuse(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    with pytest.raises(HookrunError) as info:
        run_config(tmp_path, ["model.weights=IMAGENET1K_V1", *SMALL])
    message = str(info.value)
    assert "resnet18-f37072fd.pth" in message
    assert str(tmp_path / "torch_home" / "hub" / "checkpoints") in message


def _folder_with_a_broken_image(tmp_path: Path) -> list[str]:
    """A one-class image folder whose second file is a PNG cut after its header (the
    up-front header check passes it; reading its pixels fails); overrides to read it."""
    (tmp_path / "photos" / "cat").mkdir(parents=True)
    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "photos" / "cat" / "a.png")
    noise = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "b.png")
    whole = (tmp_path / "b.png").read_bytes()
    (tmp_path / "photos" / "cat" / "b.png").write_bytes(whole[: len(whole) // 2])
    root = tmp_path / "photos"
    return [
        "dataset=image_folder",
        f"dataset.root={root}",
        "dataset.resize=32",
        "dataset.crop=32",
        "batch_size=1",
    ]


def test_unreadable_image_names_the_file(tmp_path):
    overrides = _folder_with_a_broken_image(tmp_path)
    with pytest.raises(HookrunError, match=r"dataset.root: cannot read image .*b.png"):
        run_config(tmp_path / "run", overrides)


@pytest.mark.slow
def test_unreadable_image_in_a_worker_is_one_line_on_the_cli(tmp_path):
    args = [
        *_folder_with_a_broken_image(tmp_path),
        "num_workers=1",
        f"sink.path={tmp_path / 'c.h5'}",
    ]
    proc = hookrun_cli(args, tmp_path)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hookrun: error: dataset.root: cannot read image") and "b.png" in last
    assert "Traceback" not in proc.stderr
    with h5py.File(tmp_path / "c.h5") as f:
        assert f.attrs["status"] == "failed"  # one row was written; the file says it is not whole
        assert f.attrs["completed"] == 1


def test_existing_sink_file_is_never_overwritten(tmp_path):
    target = tmp_path / "mine.h5"
    target.write_bytes(b"precious")
    with pytest.raises(HookrunError, match=r"sink.path: .*mine.h5 already exists.*overwrite"):
        run_config(tmp_path, [f"sink.path={target}", *SMALL])
    assert target.read_bytes() == b"precious"


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_sink_path(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(HookrunError, match=r"sink.path: cannot write in .*locked"):
        run_config(tmp_path, [f"sink.path={locked / 'c.h5'}", *SMALL])


def test_sink_path_under_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(HookrunError, match=r"sink.path: cannot create folder .*afile"):
        run_config(tmp_path, [f"sink.path={tmp_path / 'afile' / 'c.h5'}", *SMALL])


@pytest.mark.parametrize(
    "args,words",
    [
        (["batch_size=0"], ["batch_size", ">= 1"]),
        ([*hook("a", "layer9", "output", "capture")], ["hooks.a.select", "layer9"]),
        (["model=resnt18"], ["model/resnt18"]),
    ],
)
@pytest.mark.slow
def test_cli_bad_input_exits_nonzero_without_traceback(tmp_path, args, words):
    proc = hookrun_cli([*args, *SMALL, f"sink.path={tmp_path / 'c.h5'}"], tmp_path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    for word in words:
        assert word in proc.stderr
    assert not (tmp_path / "c.h5").exists()


def test_bad_action_is_caught_before_the_model_is_loaded(tmp_path):
    # The weights path is bad too; the action's message comes first: nothing was loaded.
    overrides = ["model.weights=/no/such/file.pt", *hook("a", "layer1", "output", "scale", fact=2)]
    with pytest.raises(HookrunError, match=r"hooks.a.args.fact: unknown key"):
        run_config(tmp_path, [*overrides, *SMALL])


def _folder_ending_in(tmp_path: Path, last: bytes | None) -> list[str]:
    """Five good 8-bit images, then `last` as the folder's last file (None: a 16-bit PNG)."""
    root = tmp_path / "photos"
    for i in range(5):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 16), (40 * i, 10, 10)).save(root / f"c{i % 2}" / f"{i}.png")
    (root / "z").mkdir()
    if last is None:
        Image.fromarray(np.full((16, 16), 60000, np.uint16)).save(root / "z" / "last.png")
    else:
        (root / "z" / "last.png").write_bytes(last)
    return folder_resnet(root, 16, 2)


@pytest.mark.parametrize(
    "last,words",
    [
        (None, "has I;16 pixels (more than 8 bits per channel); valid: 8-bit images"),
        (b"\x89PNG\r\n\x1a\n cut inside its header", "cannot read image"),
    ],
    ids=["16-bit", "broken-header"],
)
def test_a_bad_last_image_stops_before_any_file_exists(tmp_path, last, words):
    """Every file's header is read before the first batch: the last file of the folder
    (row 6, the third batch) stops the run before captures.h5 is created."""
    overrides = _folder_ending_in(tmp_path, last)
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", overrides)
    message = str(err.value)
    assert message.startswith("dataset.root: ") and "last.png" in message and words in message
    assert "\n" not in message
    assert not (tmp_path / "run" / "captures.h5").exists()


@pytest.mark.slow
def test_a_bad_image_past_limit_is_not_read(tmp_path):
    """Only the rows the run reads are checked: limit=4 never reaches the bad last file."""
    result = run_config(tmp_path / "run", [*_folder_ending_in(tmp_path, None), "limit=4"])
    with h5py.File(result.path) as f:
        assert f.attrs["status"] == "complete" and f.attrs["completed"] == 4


@pytest.mark.parametrize(
    "experiment,reader",
    [
        ("grad_cam", "hooks.cam_activation.select.name"),
        ("cam", "hooks.cam_activation.select.name"),
        ("layer_cam", "hooks.cam_activation.select.name"),
        ("patch", "hooks.ablate.select.name"),
    ],
)
def test_cam_layer_null_where_the_experiment_reads_it(tmp_path, experiment, reader):
    overrides = [f"experiment={experiment}", "model=resnet18", "model.cam_layer=null"]
    if experiment == "patch":
        overrides.append(f"hooks.ablate.args.file={tmp_path / 'x.h5'}")
    with pytest.raises(HookrunError) as err:
        run_config(tmp_path / "run", overrides, experiment)
    assert str(err.value) == (
        f"model.cam_layer: null, but {reader} reads it; valid: auto (a probe picks the layer) "
        "or a module name of the model, e.g. layer4 (see dry_run=true)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cam_layer_null_on_the_cli_is_one_line(tmp_path):
    proc = hookrun_cli(["experiment=grad_cam", "model.cam_layer=null"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hookrun: error: model.cam_layer: null, but hooks.")


@pytest.mark.slow
def test_cam_layer_null_where_nothing_reads_it_is_fine(tmp_path):
    overrides = ["model=resnet18", "model.weights=null", "model.cam_layer=null", "render=false"]
    overrides += ["dataset=fake", "dataset.size=1", "dataset.image_size=32"]
    result = run_config(tmp_path / "run", [*overrides, *hook("o", "fc", "output", "capture")])
    assert result.rows == 1
