"""Dataset builders. Every dataset yields (tensor, label, index); rows keep dataset order."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import datasets, transforms

from hookrun.config import (
    ConstantDatasetConfig,
    DigitsDatasetConfig,
    FakeDatasetConfig,
    ImageFolderDatasetConfig,
    PhotoTransformConfig,
    SamplesDatasetConfig,
)
from hookrun.errors import HookrunError
from hookrun.provenance import worker_init

__all__ = [
    "NO_LABEL",
    "SAMPLE_PHOTOS",
    "FakeImages",
    "ConstantData",
    "SamplePhotos",
    "Digits",
    "digits_split",
    "build_dataset",
    "make_loader",
    "has_labels",
]

# Label stored for datasets without labels (never written to /samples/label).
NO_LABEL = -1


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


class _IndexedImageFolder(datasets.ImageFolder):
    """ImageFolder that adds the index and names the file it cannot read."""

    has_labels = True

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        path = self.samples[index][0]
        try:
            image, label = super().__getitem__(index)
        except (OSError, ValueError) as err:
            raise HookrunError(f"dataset.root: cannot read image {path} ({err})") from None
        return image, label, index


def _photo_transform(cfg: PhotoTransformConfig) -> transforms.Compose:
    return transforms.Compose(
        [
            transforms.Resize(cfg.resize),
            transforms.CenterCrop(cfg.crop),
            transforms.ToTensor(),
            transforms.Normalize(cfg.mean, cfg.std),
        ]
    )


def _image_folder(cfg: ImageFolderDatasetConfig) -> Dataset:
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


# scikit-image's bundled photos that make sense to an ImageNet model (all CC0 or public
# domain; see skimage.data's docstrings): a cat, as in the seed tutorial, a cup of
# espresso, a Falcon 9 launch, and an astronaut portrait.
SAMPLE_PHOTOS = ("chelsea", "coffee", "rocket", "astronaut")


class SamplePhotos(Dataset):
    """Real photos shipped by scikit-image, preprocessed like ImageNet; no labels."""

    has_labels = False

    def __init__(self, cfg: SamplesDatasetConfig) -> None:
        import skimage.data  # only this dataset needs scikit-image

        for name in cfg.names:
            if name not in SAMPLE_PHOTOS:
                raise HookrunError(
                    f"dataset.names: {name!r} is not a bundled photo; valid: "
                    f"{', '.join(SAMPLE_PHOTOS)}"
                )
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


def build_dataset(cfg: object, seed: int, limit: int | None) -> Dataset:
    """The dataset `cfg` describes, cut to its first `limit` samples."""
    if isinstance(cfg, FakeDatasetConfig):
        data: Dataset = FakeImages(cfg, seed)
    elif isinstance(cfg, ConstantDatasetConfig):
        data = ConstantData(cfg)
    elif isinstance(cfg, ImageFolderDatasetConfig):
        data = _image_folder(cfg)
    elif isinstance(cfg, SamplesDatasetConfig):
        data = SamplePhotos(cfg)
    elif isinstance(cfg, DigitsDatasetConfig):
        data = Digits(cfg)
    else:
        raise TypeError(f"no builder for {type(cfg).__name__}")
    if limit is not None and limit < len(data):
        labelled = has_labels(data)
        data = Subset(data, range(limit))
        data.has_labels = labelled  # type: ignore[attr-defined]
    return data


def has_labels(data: Dataset) -> bool:
    """Whether the dataset's labels mean something (and go to /samples/label)."""
    return bool(getattr(data, "has_labels", False))


def make_loader(
    data: Dataset, batch_size: int, num_workers: int, seed: int, device: torch.device
) -> DataLoader:
    """Sequential batches (rows in dataset order); workers seeded from the run's seed;
    pinned batches on CUDA so the host → device copy can run asynchronously."""
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(
        data,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        generator=gen,
        worker_init_fn=worker_init,
        persistent_workers=False,
    )
