"""Training data: CIFAR-10 from its python-pickle folder, a synthetic CIFAR-shaped source, Fashion-MNIST at 32x32,
and text as bytes for a language model (the quotations of Debian's ``fortunes`` package).

Every dataset holds its images as uint8 tensors in memory and normalises (and, for training, augments) them on
the way out, one sample with ``dataset[i]`` or a whole batch at once with ``get_batch``. ``batch_loader`` draws
the order and the augmentation from (seed, epoch) alone, so every MPI rank sees the same batches. Nothing here
downloads anything.
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import os
import pickle
import re
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from tapp_core.errors import TappError

TEXT_DATASETS: tuple[str, ...] = ("fortunes",)
"""The datasets of text, read as bytes (``ByteText``), for a language model's workload."""
DATASET_NAMES: tuple[str, ...] = ("cifar10", "synthetic", "fashion-mnist", *TEXT_DATASETS)
DATA_DIR_ENV = "TAPP_DATA_DIR"

CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_META_FILE = "batches.meta"
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
# Mean and std of the training images after padding 28x28 to 32x32 with zeros.
FASHION_MNIST_MEAN = 0.2190
FASHION_MNIST_STD = 0.3318
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip

FORTUNES_ROOT = "/usr/share/games/fortunes"
FORTUNES_PACKAGE = "fortunes"
"""Debian's package of the fortune cookies: plain-text files of quotations (literature, science, wisdom, ...), each
quotation ended by a line holding ``%``."""
TEST_SHARE = 10
"""Every this-many-th quotation is held out as the test text."""

IMAGE_SIZE = 32
CROP_PADDING = 4


class DataError(TappError):
    """Data that cannot be used; the message names the file (or folder) and the problem."""


class InMemoryImages(Dataset[tuple[torch.Tensor, int]]):
    """uint8 images (N, 3, 32, 32) and int labels, normalised per channel and optionally augmented on access."""

    name: str = "images"
    synthetic: bool = False

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        mean: Sequence[float],
        std: Sequence[float],
        classes: Sequence[str],
        augment: bool = False,
    ) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4 or tuple(images.shape[1:]) != (3, IMAGE_SIZE, IMAGE_SIZE):
            raise ValueError(f"images must be uint8 (N, 3, 32, 32), got {images.dtype} {tuple(images.shape)}")
        if labels.shape != (images.shape[0],):
            raise ValueError(f"labels must have shape ({images.shape[0]},), got {tuple(labels.shape)}")
        self.images = images
        self.labels = labels.to(torch.int64)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
        self.classes = tuple(classes)
        self.augment = augment

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return self.images.shape[0]

    def head(self, samples: int | None) -> InMemoryImages:
        """The first ``samples`` images (all of them when None or more than there are), as a dataset of their own."""
        if samples is None or samples >= len(self):
            return self
        if samples < 1:
            raise DataError(f"a subset needs at least one sample, got {samples}")
        part = copy.copy(self)
        part.images, part.labels = self.images[:samples], self.labels[:samples]
        return part

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], int(y[0])

    def get_batch(
        self, indices: torch.Tensor | Sequence[int], generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices`` as float32 (B, 3, 32, 32) and int64 (B,); augmentation draws from ``generator``."""
        index = torch.as_tensor(indices, dtype=torch.int64)
        images = self.images[index]
        if self.augment:
            images = random_crop_and_flip(images, generator)
        x = (images.to(torch.float32) / 255.0 - self.mean) / self.std
        return x.contiguous(), self.labels[index]


def random_crop_and_flip(images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Per image: a random 32x32 crop of the image zero-padded by 4, then a horizontal flip with probability 1/2."""
    n, _, height, width = images.shape
    padded = F.pad(images, (CROP_PADDING,) * 4)
    max_offset = 2 * CROP_PADDING
    top = torch.randint(0, max_offset + 1, (n,), generator=generator)
    left = torch.randint(0, max_offset + 1, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    rows = top[:, None] + torch.arange(height)  # (n, H)
    columns = torch.arange(width).expand(n, width)
    columns = torch.where(flip[:, None], columns.flip(1), columns) + left[:, None]  # (n, W)
    batch_index = torch.arange(n)[:, None, None, None]
    channel_index = torch.arange(images.shape[1])[None, :, None, None]
    return padded[batch_index, channel_index, rows[:, None, :, None], columns[:, None, None, :]]


# --- CIFAR-10 -----------------------------------------------------------------------------------------------


class CIFAR10(InMemoryImages):
    """CIFAR-10 from ``cifar-10-batches-py`` (``data_dir`` may be that folder or the folder holding it)."""

    name = "cifar10"

    def __init__(self, data_dir: str | os.PathLike[str], train: bool, augment: bool = False) -> None:
        folder = find_cifar10_folder(data_dir)
        classes = _read_cifar10_label_names(folder / CIFAR10_META_FILE)
        files = CIFAR10_TRAIN_FILES if train else (CIFAR10_TEST_FILE,)
        batches = [_read_cifar10_batch(folder / file) for file in files]
        images = np.concatenate([data for data, _ in batches]).reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE)
        labels = np.concatenate([labels for _, labels in batches])
        super().__init__(
            torch.from_numpy(images), torch.from_numpy(labels), CIFAR10_MEAN, CIFAR10_STD, classes, augment
        )
        self.folder = folder
        self.train = train


def find_cifar10_folder(data_dir: str | os.PathLike[str]) -> Path:
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise DataError(f"{root}: CIFAR-10 data folder does not exist (expected it to hold {CIFAR10_FOLDER}/)")
    nested = root / CIFAR10_FOLDER
    return nested if nested.is_dir() else root


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles only what CIFAR-10 files contain (dicts, lists, bytes, numpy arrays), never arbitrary code."""

    _ALLOWED = frozenset(
        {
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"),
            ("numpy.core.numeric", "_frombuffer"),
            ("numpy._core.numeric", "_frombuffer"),
            ("_codecs", "encode"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}, which a CIFAR-10 file never holds")
        if module.startswith("numpy.core."):
            module = "numpy._core." + module.removeprefix("numpy.core.")  # numpy 2 moved numpy.core
        return super().find_class(module, name)


def _unpickle(path: Path) -> object:
    if not path.is_file():
        raise DataError(f"{path}: CIFAR-10 file is missing")
    try:
        with path.open("rb") as file:
            return _CifarUnpickler(file, encoding="bytes").load()
    except Exception as exc:  # pickle raises many types on damaged input (UnpicklingError, EOFError, ValueError...)
        raise DataError(f"{path}: corrupt CIFAR-10 file, not a readable pickle ({type(exc).__name__}: {exc})") from exc


def _read_cifar10_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    content = _unpickle(path)
    if not isinstance(content, dict) or b"data" not in content or b"labels" not in content:
        raise DataError(f"{path}: corrupt CIFAR-10 batch, expected a dict with b'data' and b'labels'")
    data, labels = content[b"data"], content[b"labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise DataError(
            f"{path}: corrupt CIFAR-10 batch, b'data' must be a uint8 array of N x 3072, got {type(data).__name__} {shape}"
        )
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{path}: corrupt CIFAR-10 batch, b'labels' are not integers") from exc
    if labels.shape != (data.shape[0],):
        raise DataError(f"{path}: corrupt CIFAR-10 batch, {data.shape[0]} images but {labels.size} labels")
    if labels.size and (labels.min() < 0 or labels.max() >= len(CIFAR10_CLASSES)):
        raise DataError(f"{path}: corrupt CIFAR-10 batch, labels outside 0-9 ({labels.min()}..{labels.max()})")
    return data, labels


def _read_cifar10_label_names(path: Path) -> tuple[str, ...]:
    content = _unpickle(path)
    names = content.get(b"label_names") if isinstance(content, dict) else None
    if not isinstance(names, list) or len(names) != len(CIFAR10_CLASSES):
        raise DataError(f"{path}: corrupt CIFAR-10 meta file, expected b'label_names' with 10 names")
    return tuple(name.decode() if isinstance(name, bytes) else str(name) for name in names)


# --- Synthetic CIFAR-shaped data -----------------------------------------------------------------------------

# Class patterns come from a fixed seed, so synthetic train and test sets (different seeds) share classes.
_SYNTHETIC_PATTERN_SEED = 20240601


class SyntheticCIFAR(InMemoryImages):
    """Deterministic CIFAR-shaped samples: a smooth random pattern per class plus noise. For timing, not accuracy."""

    name = "synthetic"
    synthetic = True

    def __init__(self, n: int = 2048, seed: int = 0, augment: bool = False) -> None:
        if n < 1:
            raise DataError(f"synthetic dataset size must be positive, got n={n}")
        num_classes = len(CIFAR10_CLASSES)
        pattern_generator = torch.Generator().manual_seed(_SYNTHETIC_PATTERN_SEED)
        coarse = torch.rand(num_classes, 3, 4, 4, generator=pattern_generator)
        patterns = F.interpolate(coarse, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
        generator = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, num_classes, (n,), generator=generator)
        noise = torch.rand(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
        images = (255.0 * (0.6 * patterns[labels] + 0.4 * noise)).round().to(torch.uint8)
        super().__init__(images, labels, CIFAR10_MEAN, CIFAR10_STD, CIFAR10_CLASSES, augment)
        self.seed = seed


# --- Fashion-MNIST (Debian's dataset-fashion-mnist) ----------------------------------------------------------

_IDX_UBYTE = 0x08


class FashionMNIST32(InMemoryImages):
    """Fashion-MNIST from idx files (gzipped or not), padded to 32x32 and repeated to 3 channels."""

    name = "fashion-mnist"

    def __init__(
        self, root: str | os.PathLike[str] = FASHION_MNIST_ROOT, train: bool = True, augment: bool = False
    ) -> None:
        folder = Path(root).expanduser()
        if not folder.is_dir():
            raise DataError(
                f"{folder}: Fashion-MNIST folder does not exist; install it with `apt-get install dataset-fashion-mnist` "
                "(Debian/Ubuntu) or give the folder holding train-images-idx3-ubyte(.gz)"
            )
        prefix = "train" if train else "t10k"
        images = _read_idx(folder, f"{prefix}-images-idx3-ubyte", ndim=3)
        labels = _read_idx(folder, f"{prefix}-labels-idx1-ubyte", ndim=1)
        if images.shape[0] != labels.shape[0]:
            raise DataError(
                f"{folder}: Fashion-MNIST {prefix} has {images.shape[0]} images but {labels.shape[0]} labels"
            )
        if labels.size and labels.max() >= len(FASHION_MNIST_CLASSES):
            raise DataError(f"{folder}: Fashion-MNIST {prefix} labels go up to {labels.max()}, expected 0-9")
        pad = (IMAGE_SIZE - images.shape[1]) // 2
        padded = F.pad(torch.from_numpy(images), (pad, pad, pad, pad))
        three_channels = padded.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()
        mean, std = (FASHION_MNIST_MEAN,) * 3, (FASHION_MNIST_STD,) * 3
        super().__init__(three_channels, torch.from_numpy(labels), mean, std, FASHION_MNIST_CLASSES, augment)
        self.folder = folder
        self.train = train


def _read_idx(folder: Path, stem: str, ndim: int) -> np.ndarray:
    """The uint8 array in ``folder/stem.gz`` or ``folder/stem`` (the idx format of MNIST)."""
    candidates = [folder / f"{stem}.gz", folder / stem]
    path = next((candidate for candidate in candidates if candidate.is_file()), None)
    if path is None:
        raise DataError(
            f"{candidates[0]}: Fashion-MNIST file is missing (nor is {candidates[1].name} there); "
            "install it with `apt-get install dataset-fashion-mnist`"
        )
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt Fashion-MNIST file, cannot be read ({type(exc).__name__}: {exc})") from exc
    header_size = 4 + 4 * ndim
    if len(raw) < header_size or raw[0:2] != b"\0\0" or raw[2] != _IDX_UBYTE or raw[3] != ndim:
        raise DataError(f"{path}: corrupt Fashion-MNIST file, not a {ndim}-d uint8 idx file")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(raw) - header_size != int(np.prod(shape)):
        raise DataError(
            f"{path}: corrupt Fashion-MNIST file, header says {shape} but holds {len(raw) - header_size} bytes"
        )
    if ndim == 3 and shape[1:] != (28, 28):
        raise DataError(f"{path}: Fashion-MNIST images must be 28x28, got {shape[1]}x{shape[2]}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header_size).reshape(shape).copy()


# --- Text as bytes (Debian's fortunes) -----------------------------------------------------------------------


class ByteText:
    """Text as byte-valued token ids, cut into samples of ``context`` tokens: sample ``i`` reads bytes
    ``[i * context, (i + 1) * context)`` and its targets are the bytes one further on (the next byte at every
    position)."""

    name = "text"
    synthetic = False

    def __init__(self, text: torch.Tensor, context: int) -> None:
        if text.dtype != torch.uint8 or text.dim() != 1:
            raise ValueError(f"text must be a uint8 vector of bytes, got {text.dtype} {tuple(text.shape)}")
        if context < 1:
            raise DataError(f"a sample needs at least one token, got a context of {context}")
        self.text = text
        self.context = context
        self.samples = max(0, (text.numel() - 1) // context)

    def __len__(self) -> int:
        return self.samples

    def head(self, samples: int | None) -> ByteText:
        """The first ``samples`` samples (all of them when None or more than there are)."""
        if samples is None or samples >= len(self):
            return self
        if samples < 1:
            raise DataError(f"a subset needs at least one sample, got {samples}")
        return ByteText(self.text[: samples * self.context + 1], self.context)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        tokens, targets = self.get_batch(torch.tensor([index % len(self)]))
        return tokens[0], targets[0]

    def get_batch(
        self, indices: torch.Tensor | Sequence[int], generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices`` as int64 (B, context) token ids and their int64 (B, context) next tokens."""
        starts = torch.as_tensor(indices, dtype=torch.int64)[:, None] * self.context
        window = self.text[starts + torch.arange(self.context + 1)].to(torch.int64)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def read_fortunes(root: str | os.PathLike[str] | None, train: bool) -> torch.Tensor:
    """The quotations of the ``fortunes`` package's files in ``root`` (default: where Debian installs them), as
    bytes: each file read as data (never run), split at its ``%`` lines, every ``TEST_SHARE``-th quotation the
    test text and the others the training text, each quotation followed by a blank line."""
    folder = Path(root if root is not None else FORTUNES_ROOT).expanduser()
    files = fortune_files(folder)
    if not files:
        raise DataError(
            f"{folder}: the fortunes text is not there; install it with `apt-get install {FORTUNES_PACKAGE}` "
            "(Debian/Ubuntu) or give the folder holding its files"
        )
    quotations = []
    for path in files:
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise DataError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from exc
        parts = re.split(rb"^%[ \t]*$", raw.replace(b"\r\n", b"\n"), flags=re.MULTILINE)
        quotations += [q.strip(b"\n") for q in parts if q.strip()]
    kept = [q for i, q in enumerate(quotations) if (i % TEST_SHARE == 0) != train]
    return torch.frombuffer(bytearray(b"\n\n".join(kept) + b"\n\n"), dtype=torch.uint8)


def fortune_files(folder: Path) -> list[Path]:
    """The text files of a fortunes folder, by name: its regular files less the ``.dat`` indexes (the ``.u8``
    names are links to the same files)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink() and p.suffix != ".dat")


def fortunes_installed(root: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``root`` (default: where Debian's package installs them) holds fortune files."""
    return bool(fortune_files(Path(root if root is not None else FORTUNES_ROOT).expanduser()))


def open_text(name: str, data_dir: str | os.PathLike[str] | None, train: bool, context: int) -> ByteText:
    """Text dataset ``name`` (one of ``TEXT_DATASETS``) as samples of ``context`` bytes."""
    if name not in TEXT_DATASETS:
        raise DataError(f"unknown text dataset {name!r}; known: {', '.join(TEXT_DATASETS)}")
    text = ByteText(read_fortunes(data_dir, train), context)
    if not len(text):
        raise DataError(f"{data_dir or FORTUNES_ROOT}: the fortunes text holds no sample of {context + 1} bytes")
    return text


# --- Choosing a dataset and batching it ----------------------------------------------------------------------


def open_dataset(
    name: str, data_dir: str | os.PathLike[str] | None, train: bool, augment: bool = False
) -> InMemoryImages:
    """The dataset called ``name`` (one of ``DATASET_NAMES``); ``data_dir`` is where its files are."""
    if name == "cifar10":
        return CIFAR10(_cifar10_dir(data_dir), train=train, augment=augment)
    if name == "synthetic":
        return SyntheticCIFAR(n=2048 if train else 512, seed=0 if train else 1, augment=augment)
    if name == "fashion-mnist":
        return FashionMNIST32(root=data_dir or FASHION_MNIST_ROOT, train=train, augment=augment)
    raise DataError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASET_NAMES)}")


def find_dataset(data_dir: str | os.PathLike[str] | None = None) -> tuple[str, str | None] | None:
    """The real dataset to train on when none is named, as (name, folder): CIFAR-10 when a data folder is given
    (``data_dir``, else ``$TAPP_DATA_DIR``: what else would it hold; ``check_dataset`` then names any file that is
    missing or corrupt), else Fashion-MNIST where Debian's ``dataset-fashion-mnist`` installs it; None when there is
    neither. Only looks: nothing is read or downloaded."""
    folder = data_dir or os.environ.get(DATA_DIR_ENV)
    if folder:
        return "cifar10", str(folder)
    if fashion_mnist_installed():
        return "fashion-mnist", None
    return None


def fashion_mnist_installed(root: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``root`` (default: where Debian's package installs it) holds Fashion-MNIST's four idx files, gzipped
    or not."""
    folder = Path(root if root is not None else FASHION_MNIST_ROOT)
    stems = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    return all((folder / f"{stem}.gz").is_file() or (folder / stem).is_file() for stem in stems)


def check_dataset(name: str, data_dir: str | os.PathLike[str] | None) -> None:
    """Read every file of dataset ``name`` (training and test) and check its format, then let it go: what a command
    runs before any worker starts, so that missing, corrupt or malicious data fails at once with ``DataError``
    naming the file, not on a worker."""
    if name == "cifar10":
        folder = find_cifar10_folder(_cifar10_dir(data_dir))
        _read_cifar10_label_names(folder / CIFAR10_META_FILE)
        for file in (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE):
            _read_cifar10_batch(folder / file)
    elif name == "fashion-mnist":
        for train in (True, False):
            FashionMNIST32(root=data_dir or FASHION_MNIST_ROOT, train=train)
    elif name in TEXT_DATASETS:
        for train in (True, False):
            read_fortunes(data_dir, train)
    else:
        open_dataset(name, data_dir, train=False)  # synthetic data is made, not read; an unknown name fails


def check_dataset_present(name: str, data_dir: str | os.PathLike[str] | None) -> None:
    """That the folder of a named real dataset is there, without reading it: what a run that trains nothing (the
    data only names the experiment) checks, so that a dataset that is not there is a ``DataError``, not a tag."""
    if name == "cifar10":
        folder = find_cifar10_folder(_cifar10_dir(data_dir))
        missing = [
            f for f in (CIFAR10_META_FILE, *CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE) if not (folder / f).is_file()
        ]
        if missing:
            raise DataError(f"{folder}: not a CIFAR-10 folder (no {', '.join(missing)})")
    elif name == "fashion-mnist" and not fashion_mnist_installed(data_dir):
        raise DataError(
            f"{data_dir or FASHION_MNIST_ROOT}: Fashion-MNIST is not there (apt-get install dataset-fashion-mnist)"
        )
    elif name in TEXT_DATASETS and not fortunes_installed(data_dir):
        raise DataError(f"{data_dir or FORTUNES_ROOT}: {missing_data_reason(name)}")


def data_installed(name: str, data_dir: str | os.PathLike[str] | None) -> bool:
    """Whether dataset ``name`` can be read without being asked for by name: synthetic data always, text where its
    package put it (or in ``data_dir``), the others where ``find_dataset`` finds them."""
    if name == "synthetic":
        return True
    if name in TEXT_DATASETS:
        return fortunes_installed(data_dir)
    found = find_dataset(data_dir)
    return found is not None and found[0] == name


def missing_data_reason(name: str) -> str:
    """What to install (or give) for dataset ``name``, in one phrase."""
    if name in TEXT_DATASETS:
        return f"the {name} text is not in {FORTUNES_ROOT} (apt-get install {FORTUNES_PACKAGE})"
    if name == "fashion-mnist":
        return f"Fashion-MNIST is not in {FASHION_MNIST_ROOT} (apt-get install dataset-fashion-mnist)"
    return f"{name} is not there (give its folder with --data-dir)"


def _cifar10_dir(data_dir: str | os.PathLike[str] | None) -> str | os.PathLike[str]:
    folder = data_dir or os.environ.get(DATA_DIR_ENV)
    if not folder:
        raise DataError(
            f"CIFAR-10 needs its data folder: pass --data-dir or set {DATA_DIR_ENV} to the folder holding "
            f"{CIFAR10_FOLDER}/ (or use the 'synthetic' dataset for timing only)"
        )
    return folder


class Samples(Protocol):
    """What ``BatchLoader`` reads: a torch map-style dataset with a length, of (image, label) samples. One with a
    ``get_batch(indices, generator=...)`` method (``InMemoryImages``) is read a batch at a time."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]: ...


class BatchLoader:
    """Batches of a dataset in an order (and with augmentation) fixed by (seed, epoch); iterating again repeats them."""

    def __init__(
        self, dataset: Samples, batch_size: int, seed: int, epoch: int = 0, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        if batch_size < 1:
            raise DataError(f"batch size must be positive, got {batch_size}")
        size = len(dataset)
        if drop_last and size < batch_size:
            raise DataError(f"dataset of {size} samples has no full batch of {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = epoch
        self.shuffle = shuffle
        self.drop_last = drop_last

    def __len__(self) -> int:
        size = len(self.dataset)
        return size // self.batch_size if self.drop_last else -(-size // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.cursor()

    def cursor(self, start: int = 0, augment_state: torch.Tensor | None = None) -> BatchCursor:
        """The batches from batch ``start`` on; ``augment_state``: the augmentation's random state there (a
        ``BatchCursor.augment_state`` saved at ``start``), else its state at the epoch's start."""
        return BatchCursor(self, start, augment_state)

    def batch(self, indices: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        get_batch = getattr(self.dataset, "get_batch", None)
        if get_batch is not None:
            batch: tuple[torch.Tensor, torch.Tensor] = get_batch(indices, generator=generator)
            return batch
        # A plain torch Dataset: its own augmentation, if any, is outside our control.
        samples = [self.dataset[int(i)] for i in indices]
        return torch.stack([x for x, _ in samples]), torch.as_tensor([int(y) for _, y in samples], dtype=torch.int64)


class BatchCursor:
    """An iterator over a ``BatchLoader``'s batches whose place (``position``, ``augment_state``) can be saved
    between batches and given back to ``BatchLoader.cursor`` to go on from there."""

    def __init__(self, loader: BatchLoader, start: int, augment_state: torch.Tensor | None) -> None:
        self.loader = loader
        self.position = start
        """The next batch's number in the epoch."""
        size = len(loader.dataset)
        order_generator = torch.Generator().manual_seed(mixed_seed(loader.seed, loader.epoch, "order"))
        self._order = torch.randperm(size, generator=order_generator) if loader.shuffle else torch.arange(size)
        self._augment = torch.Generator().manual_seed(mixed_seed(loader.seed, loader.epoch, "augment"))
        if augment_state is not None:
            self._augment.set_state(augment_state)

    def augment_state(self) -> torch.Tensor:
        return self._augment.get_state()

    def __iter__(self) -> BatchCursor:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position >= len(self.loader):
            raise StopIteration
        size = self.loader.batch_size
        indices = self._order[self.position * size : (self.position + 1) * size]
        self.position += 1
        return self.loader.batch(indices, self._augment)


def batch_loader(
    dataset: Samples, batch_size: int, seed: int, epoch: int = 0, shuffle: bool = True, drop_last: bool = True
) -> BatchLoader:
    """(x, y) batches that are the same on every process given the same dataset, seed and epoch."""
    return BatchLoader(dataset, batch_size, seed, epoch=epoch, shuffle=shuffle, drop_last=drop_last)


def mixed_seed(*parts: object) -> int:
    """One seed for torch from several (a run's seed, an epoch, a purpose, a place): a stable hash of them (Python's
    ``hash`` of a str is salted per process), folded into torch's 63-bit seed range."""
    digest = hashlib.sha256(":".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)
