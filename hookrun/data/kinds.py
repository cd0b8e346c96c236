"""Dataset kinds: `dataset.kind` → its config schema and its builder, one registration each.

Every dataset yields (tensor, label, index); rows keep dataset order. A new kind is one
`@_kind(name, ConfigClass)` on its builder here: its config dataclass is what `dataset:`
accepts (with `check()` for what it refuses before any work), and `DATASETS.choices()` is
what error messages and the docs list.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING
from PIL import Image
from torch.utils.data import Dataset

from hookrun.errors import HookrunError
from hookrun.memory import check_fits
from hookrun.registry import Registry
from hookrun.typed import Frozen, check_range

__all__ = [
    "NO_LABEL",
    "SAMPLE_PHOTOS",
    "DatasetKind",
    "DATASETS",
    "FakeDatasetConfig",
    "ConstantDatasetConfig",
    "PhotoTransformConfig",
    "ImageFolderDatasetConfig",
    "SamplesDatasetConfig",
    "DigitsDatasetConfig",
    "FakeImages",
    "ConstantData",
    "SamplePhotos",
    "Digits",
    "digits_split",
    "check_image",
]

# Label stored for datasets without labels (never written to /samples/label).
NO_LABEL = -1

# scikit-image's bundled photos that make sense to an ImageNet model (all CC0 or public
# domain; see skimage.data's docstrings): a cat, as in the seed tutorial, a cup of
# espresso, a Falcon 9 launch, and an astronaut portrait.
SAMPLE_PHOTOS = ("chelsea", "coffee", "rocket", "astronaut")
_RGB = 3  # channels of a photo read by PIL's convert("RGB")
_FLOAT = 4  # bytes of one float32 value


@dataclass(frozen=True)
class DatasetKind:
    """One registered kind: the config dataclass and the function that builds the dataset:
    `build(cfg, seed)`, or `build(cfg, seed, tokenizer)` for a kind of `tokens` (token rows
    for a language model, hookrun/data/tokens.py, tokenized with the model's tokenizer)."""

    schema: type
    build: Callable[..., Dataset]
    tokens: bool = False


DATASETS: Registry[DatasetKind] = Registry("a dataset kind")


def _kind(name: str, schema: type) -> Callable:
    def add(build: Callable[[Any, int], Dataset]) -> Callable[[Any, int], Dataset]:
        DATASETS.register(name)(DatasetKind(schema, build))
        return build

    return add


@dataclass
class FakeDatasetConfig(Frozen):
    kind: str = "fake"
    size: int = 8
    """Number of samples; each is drawn from a generator seeded by (seed, index)."""
    image_size: int = 224
    """Height and width of each random image."""
    channels: int = 3
    """Channels of each random image."""
    num_classes: int = 1000
    """Labels are drawn from 0 to num_classes - 1."""

    def check(self) -> None:
        for name in ("size", "image_size", "channels", "num_classes"):
            check_range(f"dataset.{name}", getattr(self, name), 1)
        # Blame the key that makes one image too large (a wide image or many channels).
        key = "image_size" if self.image_size**2 >= self.channels else "channels"
        shape = list(self.sample_shape())
        check_fits(
            f"dataset.{key}", getattr(self, key), _FLOAT * math.prod(shape), f"one image {shape}"
        )

    def sample_shape(self) -> tuple[int, ...]:
        """One sample's shape (no batch axis)."""
        return (self.channels, self.image_size, self.image_size)


@dataclass
class ConstantDatasetConfig(Frozen):
    kind: str = "constant"
    shape: list[int] = field(default_factory=lambda: [3, 224, 224])
    """Shape of one sample (no batch axis), e.g. [3] for the seed MLP."""
    value: float = 1.0
    """The value of every element of every sample."""
    size: int = 1
    """Number of samples."""

    def check(self) -> None:
        check_range("dataset.size", self.size, 1)
        for i, n in enumerate(self.shape):
            check_range(f"dataset.shape[{i}]", n, 1)
        shape = list(self.shape)
        check_fits("dataset.shape", shape, _FLOAT * math.prod(shape), "one sample")

    def sample_shape(self) -> tuple[int, ...]:
        """One sample's shape (no batch axis)."""
        return tuple(self.shape)


@dataclass
class PhotoTransformConfig(Frozen):
    resize: int = 256
    """Resize the short side, centre-crop, normalize (ImageNet statistics by default)."""
    crop: int = 224
    """Side of the centre crop, after the resize."""
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    """Per-channel mean subtracted after the crop."""
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    """Per-channel standard deviation divided by after the mean."""

    def check(self) -> None:
        check_range("dataset.resize", self.resize, 1)
        check_range("dataset.crop", self.crop, 1)
        for key, values in (("dataset.mean", self.mean), ("dataset.std", self.std)):
            if not all(math.isfinite(v) for v in values):
                raise HookrunError(f"{key}: {list(values)}; valid: finite numbers, one per channel")
            if len(values) not in (1, _RGB):  # photos are read as RGB (convert("RGB"))
                raise HookrunError(
                    f"{key}: {list(values)} has {len(values)} values, the images {_RGB} "
                    f"channels; valid: {_RGB} numbers (one per channel), or 1 for all"
                )
        if len(self.mean) != len(self.std) or any(v <= 0 for v in self.std):
            raise HookrunError(
                f"dataset.std: {list(self.std)} for mean {list(self.mean)}; valid: one "
                "positive number per channel"
            )
        # PIL first resizes the short side to `resize` (one byte per channel and pixel, the
        # long side at least as long), then crops `crop` x `crop` to a float tensor.
        check_fits("dataset.resize", self.resize, _RGB * self.resize**2, "one resized photo")
        shape = list(self.sample_shape())
        check_fits("dataset.crop", self.crop, _FLOAT * math.prod(shape), f"one image {shape}")

    def sample_shape(self) -> tuple[int, ...]:
        """One sample's shape (no batch axis)."""
        return (_RGB, self.crop, self.crop)


@dataclass
class ImageFolderDatasetConfig(PhotoTransformConfig):
    kind: str = "image_folder"
    root: str = MISSING
    """A folder with one sub-folder per class (torchvision.datasets.ImageFolder layout)."""


@dataclass
class SamplesDatasetConfig(PhotoTransformConfig):
    kind: str = "samples"
    names: list[str] = field(default_factory=lambda: ["chelsea", "coffee", "rocket"])
    """Photos bundled with scikit-image (skimage.data), by function name: SAMPLE_PHOTOS."""

    def check(self) -> None:
        super().check()
        for name in self.names:
            if name not in SAMPLE_PHOTOS:
                raise HookrunError(
                    f"dataset.names: {name!r} is not a bundled photo; valid: "
                    f"{', '.join(SAMPLE_PHOTOS)}"
                )


@dataclass
class DigitsDatasetConfig(Frozen):
    kind: str = "digits"
    split: str = "test"
    """scikit-learn's bundled 8x8 handwritten digits; every 5th image is the test split."""

    def check(self) -> None:
        if self.split not in ("train", "test", "all"):
            raise HookrunError(f"dataset.split: {self.split!r}; valid: train, test, all")

    def sample_shape(self) -> tuple[int, ...]:
        """One sample's shape (no batch axis)."""
        return (1, 8, 8)


class FakeImages(Dataset):
    """Seeded random images made directly as tensors; sample i depends only on (seed, i)."""

    has_labels = True

    def __init__(self, cfg: FakeDatasetConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed

    def __len__(self) -> int:
        return self.cfg.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        c, s = self.cfg.channels, self.cfg.image_size
        image = torch.randn((c, s, s), generator=gen)
        label = int(torch.randint(self.cfg.num_classes, (1,), generator=gen))
        return image, label, index


class ConstantData(Dataset):
    """`size` copies of one tensor filled with `value` (the seeds' `ones(1, 1, 4, 4)`)."""

    has_labels = False

    def __init__(self, cfg: ConstantDatasetConfig) -> None:
        self.cfg = cfg

    def __len__(self) -> int:
        return self.cfg.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        return torch.full(tuple(self.cfg.shape), float(self.cfg.value)), NO_LABEL, index


class _IndexedImageFolder(Dataset):
    """torchvision's ImageFolder (imported when a folder is read: a language-model run never
    pays for torchvision), with the index added and the file it cannot read named."""

    has_labels = True

    def __init__(self, root: str, transform: Any) -> None:
        from torchvision import datasets

        self.folder = datasets.ImageFolder(root, transform=transform, loader=_eight_bit_rgb)
        self.samples = self.folder.samples  # (path, class) per row: /samples/path, resume

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        path = self.samples[index][0]
        try:
            image, label = self.folder[index]
        except HookrunError:
            raise
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            raise HookrunError(f"dataset.root: cannot read image {path} ({err})") from None
        return image, label, index


# PIL modes of 8 bits per channel; others (16-bit "I;16", 32-bit "I" and "F") would be
# clipped to 8 bits by convert("RGB") — silently wrong numbers — so they are refused.
_EIGHT_BIT = {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"}


def _refuse_mode(path: str, mode: str) -> None:
    if mode not in _EIGHT_BIT:
        raise HookrunError(
            f"dataset.root: {path} has {mode} pixels (more than 8 bits per channel); "
            "valid: 8-bit images (convert it, e.g. to 8-bit PNG)"
        )


def _eight_bit_rgb(path: str) -> Image.Image:
    with open(path, "rb") as fh:
        image = Image.open(fh)
        _refuse_mode(path, image.mode)
        return image.convert("RGB")


def check_image(path: str) -> None:
    """Refuse, from its header alone (PIL reads no pixels here), an image file the run could
    not read or would read wrong — before the first batch, not when streaming reaches it.
    Damage past the header still shows only when the pixels are read."""
    try:
        with Image.open(path) as image:
            mode = image.mode
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise HookrunError(f"dataset.root: cannot read image {path} ({err})") from None
    _refuse_mode(path, mode)


def _photo_transform(cfg: PhotoTransformConfig) -> Any:
    from torchvision import transforms

    return transforms.Compose(
        [
            transforms.Resize(cfg.resize),
            transforms.CenterCrop(cfg.crop),
            transforms.ToTensor(),
            transforms.Normalize(cfg.mean, cfg.std),
        ]
    )


def _image_folder(cfg: ImageFolderDatasetConfig, seed: int) -> Dataset:
    root = Path(cfg.root).expanduser()
    if not root.is_dir():
        raise HookrunError(
            f"dataset.root: {cfg.root!r} is not a directory; valid: a folder with one "
            "sub-folder of images per class"
        )
    try:
        return _IndexedImageFolder(str(root), transform=_photo_transform(cfg))
    except (FileNotFoundError, OSError) as err:
        raise HookrunError(f"dataset.root: {cfg.root}: {err}") from None


class SamplePhotos(Dataset):
    """Real photos shipped by scikit-image, preprocessed like ImageNet; no labels."""

    has_labels = False

    def __init__(self, cfg: SamplesDatasetConfig) -> None:
        import skimage.data  # only this dataset needs scikit-image

        self.names = list(cfg.names)
        self.photos = [getattr(skimage.data, n)() for n in self.names]
        self.transform = _photo_transform(cfg)

    def __len__(self) -> int:
        return len(self.photos)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        image = Image.fromarray(self.photos[index]).convert("RGB")
        return self.transform(image), NO_LABEL, index


def digits_split(n: int, split: str) -> list[int]:
    """Indices of a split of scikit-learn's digits: every 5th image is a test image."""
    every = range(n)
    if split == "all":
        return list(every)
    return [i for i in every if (i % 5 == 0) == (split == "test")]


class Digits(Dataset):
    """scikit-learn's 8x8 handwritten digits (1797 images, labels 0-9), scaled to [0, 1]."""

    has_labels = True

    def __init__(self, cfg: DigitsDatasetConfig) -> None:
        from sklearn.datasets import load_digits  # only this dataset needs scikit-learn

        bunch = load_digits()
        keep = digits_split(len(bunch.images), cfg.split)
        self.images = torch.tensor(bunch.images[keep], dtype=torch.float32).unsqueeze(1) / 16
        self.labels = [int(t) for t in bunch.target[keep]]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        return self.images[index], self.labels[index], index


@_kind("fake", FakeDatasetConfig)
def _fake(cfg: FakeDatasetConfig, seed: int) -> Dataset:
    return FakeImages(cfg, seed)


@_kind("constant", ConstantDatasetConfig)
def _constant(cfg: ConstantDatasetConfig, seed: int) -> Dataset:
    return ConstantData(cfg)


_kind("image_folder", ImageFolderDatasetConfig)(_image_folder)


@_kind("samples", SamplesDatasetConfig)
def _samples(cfg: SamplesDatasetConfig, seed: int) -> Dataset:
    return SamplePhotos(cfg)


@_kind("digits", DigitsDatasetConfig)
def _digits(cfg: DigitsDatasetConfig, seed: int) -> Dataset:
    return Digits(cfg)
