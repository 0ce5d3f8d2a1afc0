"""Data: CIFAR-10 files in the real pickle format, errors that name the file, synthetic data, Fashion-MNIST, batching."""

from __future__ import annotations

import gzip
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from tapp_core.model.data import (
    CIFAR10,
    CIFAR10_CLASSES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    DATA_DIR_ENV,
    DataError,
    FashionMNIST32,
    SyntheticCIFAR,
    batch_loader,
    check_dataset,
    find_dataset,
    open_dataset,
    random_crop_and_flip,
)

IMAGES_PER_BATCH = 6
CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _write_pickle(path: Path, content: object) -> None:
    # Protocol 2 with bytes keys, as the files from the CIFAR-10 site are; those were written before numpy 2
    # renamed numpy.core, so name the array constructor the way they do.
    raw = pickle.dumps(content, protocol=2)
    path.write_bytes(raw.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n"))


def write_cifar_folder(root: Path) -> dict[str, tuple[np.ndarray, list[int]]]:
    """A cifar-10-batches-py folder under ``root`` with small batches; returns each file's data and labels."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for number, name in enumerate(CIFAR_FILES):
        data = rng.integers(0, 256, size=(IMAGES_PER_BATCH, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=IMAGES_PER_BATCH)]
        _write_pickle(
            folder / name,
            {
                b"batch_label": f"batch {number + 1}".encode(),
                b"labels": labels,
                b"data": data,
                b"filenames": [f"img_{number}_{i}.png".encode() for i in range(IMAGES_PER_BATCH)],
            },
        )
        written[name] = (data, labels)
    meta = {
        b"num_cases_per_batch": IMAGES_PER_BATCH,
        b"label_names": [n.encode() for n in CIFAR10_CLASSES],
        b"num_vis": 3072,
    }
    _write_pickle(folder / "batches.meta", meta)
    return written


def _normalised(data_row: np.ndarray) -> torch.Tensor:
    image = torch.from_numpy(data_row.reshape(3, 32, 32).astype(np.float32)) / 255.0
    return (image - torch.tensor(CIFAR10_MEAN).view(3, 1, 1)) / torch.tensor(CIFAR10_STD).view(3, 1, 1)


# --- CIFAR-10 ---------------------------------------------------------------------------------------------------


def test_cifar10_train_reads_the_five_batches_in_order_with_values_and_labels(tmp_path: Path) -> None:
    written = write_cifar_folder(tmp_path)
    dataset = CIFAR10(tmp_path, train=True)
    assert len(dataset) == 5 * IMAGES_PER_BATCH
    assert dataset.classes == CIFAR10_CLASSES
    assert dataset.synthetic is False
    expected_labels = [label for name in CIFAR_FILES[:5] for label in written[name][1]]
    x, y = dataset.get_batch(torch.arange(len(dataset)))
    assert y.tolist() == expected_labels
    assert x.dtype == torch.float32 and x.shape == (len(dataset), 3, 32, 32)
    data_batch_3 = written["data_batch_3"][0]
    for i in range(IMAGES_PER_BATCH):
        sample, label = dataset[2 * IMAGES_PER_BATCH + i]
        assert torch.allclose(sample, _normalised(data_batch_3[i]), atol=1e-6)
        assert label == written["data_batch_3"][1][i]


def test_cifar10_rows_are_channel_major(tmp_path: Path) -> None:
    written = write_cifar_folder(tmp_path)
    data = written["test_batch"][0]
    sample, _ = CIFAR10(tmp_path, train=False)[0]
    # Green channel (second 1024 bytes), row 5, column 7.
    green = data[0, 1024 + 32 * 5 + 7] / 255.0
    assert sample[1, 5, 7].item() == pytest.approx((green - CIFAR10_MEAN[1]) / CIFAR10_STD[1], abs=1e-6)


def test_cifar10_normalisation_maps_black_and_white_to_the_usual_values(tmp_path: Path) -> None:
    write_cifar_folder(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    data = np.zeros((2, 3072), dtype=np.uint8)
    data[1] = 255
    _write_pickle(folder / "test_batch", {b"data": data, b"labels": [3, 4]})
    x, y = CIFAR10(folder, train=False).get_batch([0, 1])
    for channel in range(3):
        black = -CIFAR10_MEAN[channel] / CIFAR10_STD[channel]
        white = (1 - CIFAR10_MEAN[channel]) / CIFAR10_STD[channel]
        assert torch.allclose(x[0, channel], torch.full((32, 32), black), atol=1e-6)
        assert torch.allclose(x[1, channel], torch.full((32, 32), white), atol=1e-6)
    assert y.tolist() == [3, 4]


def test_cifar10_accepts_the_batches_folder_itself_or_its_parent(tmp_path: Path) -> None:
    write_cifar_folder(tmp_path)
    from_parent = CIFAR10(tmp_path, train=False)
    from_folder = CIFAR10(tmp_path / "cifar-10-batches-py", train=False)
    assert torch.equal(from_parent.images, from_folder.images)
    assert len(from_folder) == IMAGES_PER_BATCH


@pytest.mark.parametrize("missing", ["data_batch_3", "batches.meta"])
def test_missing_cifar10_file_is_named(tmp_path: Path, missing: str) -> None:
    write_cifar_folder(tmp_path)
    (tmp_path / "cifar-10-batches-py" / missing).unlink()
    with pytest.raises(DataError, match=rf"cifar-10-batches-py/{missing}: CIFAR-10 file is missing"):
        CIFAR10(tmp_path, train=True)


def test_missing_cifar10_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nowhere: CIFAR-10 data folder does not exist"):
        CIFAR10(tmp_path / "nowhere", train=True)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("truncate", r"test_batch: corrupt CIFAR-10 file, not a readable pickle"),
        ("not_a_dict", r"test_batch: corrupt CIFAR-10 batch, expected a dict"),
        ("wrong_width", r"test_batch: corrupt CIFAR-10 batch, b'data' must be a uint8 array of N x 3072"),
        ("float_data", r"test_batch: corrupt CIFAR-10 batch, b'data' must be a uint8 array"),
        ("label_count", r"test_batch: corrupt CIFAR-10 batch, 6 images but 5 labels"),
        ("label_range", r"test_batch: corrupt CIFAR-10 batch, labels outside 0-9"),
        ("code", r"test_batch: corrupt CIFAR-10 file.*refusing to load (posix|os)\.system"),
    ],
)
def test_corrupt_cifar10_batch_is_named_with_the_problem(tmp_path: Path, damage: str, expected: str) -> None:
    written = write_cifar_folder(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    data, labels = written["test_batch"]
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "not_a_dict":
        _write_pickle(path, [data, labels])
    elif damage == "wrong_width":
        _write_pickle(path, {b"data": data[:, :1000], b"labels": labels})
    elif damage == "float_data":
        _write_pickle(path, {b"data": data.astype(np.float32), b"labels": labels})
    elif damage == "label_count":
        _write_pickle(path, {b"data": data, b"labels": labels[:5]})
    elif damage == "label_range":
        _write_pickle(path, {b"data": data, b"labels": [*labels[:5], 10]})
    elif damage == "code":
        marker = tmp_path / "was_run"

        class RunsACommand:
            def __reduce__(self) -> tuple[object, tuple[str]]:
                return (os.system, (f"touch {marker}",))

        _write_pickle(path, {b"data": RunsACommand(), b"labels": labels})
    with pytest.raises(DataError, match=expected):
        CIFAR10(tmp_path, train=False)
    assert not (tmp_path / "was_run").exists()


# --- Augmentation -----------------------------------------------------------------------------------------------


def _candidate_crops(image: torch.Tensor) -> list[torch.Tensor]:
    padded = torch.nn.functional.pad(image, (4, 4, 4, 4))
    crops = [padded[:, top : top + 32, left : left + 32] for top in range(9) for left in range(9)]
    return crops + [crop.flip(-1) for crop in crops]


def test_augmentation_is_a_padded_random_crop_with_random_flip() -> None:
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    augmented = random_crop_and_flip(images, torch.Generator().manual_seed(0))
    assert augmented.shape == images.shape and augmented.dtype == torch.uint8
    chosen = set()
    for image, result in zip(images, augmented, strict=True):
        matches = [i for i, crop in enumerate(_candidate_crops(image)) if torch.equal(crop, result)]
        assert matches, "every augmented image is one crop of the padded image, maybe flipped"
        chosen.add(matches[0])
    assert len(chosen) > 1
    again = random_crop_and_flip(images, torch.Generator().manual_seed(0))
    assert torch.equal(augmented, again)


def test_augmentation_flips_about_half_and_uses_every_offset() -> None:
    image = torch.arange(3 * 32 * 32, dtype=torch.int32).remainder(251).to(torch.uint8).view(1, 3, 32, 32)
    images = image.expand(400, -1, -1, -1).contiguous()
    augmented = random_crop_and_flip(images, torch.Generator().manual_seed(1))
    candidates = _candidate_crops(image[0])
    indices = [next(i for i, c in enumerate(candidates) if torch.equal(c, a)) for a in augmented]
    flipped = sum(i >= 81 for i in indices)
    assert 140 < flipped < 260
    assert {i % 81 // 9 for i in indices} == set(range(9))  # every vertical offset 0..8
    assert {i % 9 for i in indices} == set(range(9))


def test_augmented_dataset_differs_from_plain_but_keeps_labels() -> None:
    plain = SyntheticCIFAR(n=16, seed=0)
    augmented = SyntheticCIFAR(n=16, seed=0, augment=True)
    x_plain, y_plain = plain.get_batch(range(16))
    x_augmented, y_augmented = augmented.get_batch(range(16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(y_plain, y_augmented)
    assert not torch.equal(x_plain, x_augmented)


# --- Synthetic --------------------------------------------------------------------------------------------------


def test_synthetic_is_deterministic_cifar_shaped_and_tagged() -> None:
    first, second, other = SyntheticCIFAR(n=64, seed=0), SyntheticCIFAR(n=64, seed=0), SyntheticCIFAR(n=64, seed=1)
    assert first.synthetic is True and first.name == "synthetic"
    assert len(first) == 64
    x, y = first[5]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert isinstance(y, int) and 0 <= y < 10
    assert torch.equal(first.images, second.images) and torch.equal(first.labels, second.labels)
    assert not torch.equal(first.images, other.images)
    assert len(set(first.labels.tolist())) == 10


def test_synthetic_classes_are_separable_by_their_mean_image() -> None:
    # Not needed for timing, but it keeps a loss curve on synthetic data meaningful.
    train, test = SyntheticCIFAR(n=500, seed=0), SyntheticCIFAR(n=100, seed=1)
    x_train, y_train = train.get_batch(range(len(train)))
    centroids = torch.stack([x_train[y_train == c].mean(0) for c in range(10)]).flatten(1)
    x_test, y_test = test.get_batch(range(len(test)))
    predicted = torch.cdist(x_test.flatten(1), centroids).argmin(1)
    assert (predicted == y_test).float().mean() > 0.9


def test_index_out_of_range_raises_index_error() -> None:
    with pytest.raises(IndexError):
        SyntheticCIFAR(n=4)[4]


# --- Fashion-MNIST ----------------------------------------------------------------------------------------------


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_fashion_mnist_idx_files_are_padded_to_32_and_repeated_to_3_channels(tmp_path: Path, suffix: str) -> None:
    images = np.random.default_rng(0).integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    labels = np.array([0, 9, 3, 3, 1], dtype=np.uint8)
    _write_idx(tmp_path / f"t10k-images-idx3-ubyte{suffix}", images)
    _write_idx(tmp_path / f"t10k-labels-idx1-ubyte{suffix}", labels)
    dataset = FashionMNIST32(tmp_path, train=False)
    assert len(dataset) == 5 and dataset.synthetic is False
    x, y = dataset.get_batch(range(5))
    assert y.tolist() == labels.tolist()
    assert x.shape == (5, 3, 32, 32)
    assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 0], x[:, 2])
    assert torch.equal(dataset.images[:, 0, 2:30, 2:30], torch.from_numpy(images))
    border = x[:, :, :2, :]
    assert torch.allclose(border, torch.full_like(border, border.flatten()[0].item()))


def test_fashion_mnist_missing_folder_says_to_install_the_package(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nowhere: .*apt-get install dataset-fashion-mnist"):
        FashionMNIST32(tmp_path / "nowhere")


def test_fashion_mnist_missing_or_corrupt_file_is_named(tmp_path: Path) -> None:
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((2, 28, 28), dtype=np.uint8))
    with pytest.raises(
        DataError, match=r"train-labels-idx1-ubyte\.gz: Fashion-MNIST file is missing.*dataset-fashion-mnist"
    ):
        FashionMNIST32(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte\.gz: corrupt Fashion-MNIST file"):
        FashionMNIST32(tmp_path)
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros((3,), dtype=np.uint8))
    with pytest.raises(DataError, match=r"2 images but 3 labels"):
        FashionMNIST32(tmp_path)


def test_installed_fashion_mnist_test_set(fashion_mnist: Path) -> None:
    dataset = FashionMNIST32(train=False)
    assert len(dataset) == 10_000
    assert sorted(set(dataset.labels.tolist())) == list(range(10))
    x, _ = dataset.get_batch(range(1000))
    assert abs(x.mean().item()) < 0.1 and 0.9 < x.std().item() < 1.1
    head = dataset.head(100)  # the test subset an experiment's accuracy is measured on: the first images
    assert len(head) == 100 and head.labels.tolist() == dataset.labels[:100].tolist()
    assert dataset.head(None) is dataset and dataset.head(20_000) is dataset


def test_the_real_data_found_when_none_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fashion_mnist: Path
) -> None:
    """CIFAR-10 where a data folder is given, else Fashion-MNIST where Debian installs it, else none."""
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert find_dataset(None) == ("fashion-mnist", None)
    assert find_dataset(str(tmp_path)) == ("cifar10", str(tmp_path))  # checked when read: a missing file is named
    with pytest.raises(DataError, match=r"batches\.meta: CIFAR-10 file is missing"):
        check_dataset("cifar10", str(tmp_path))
    write_cifar_folder(tmp_path)
    assert find_dataset(str(tmp_path)) == ("cifar10", str(tmp_path))
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert find_dataset(None) == ("cifar10", str(tmp_path))
    monkeypatch.delenv(DATA_DIR_ENV)
    monkeypatch.setattr("tapp_core.model.data.FASHION_MNIST_ROOT", str(tmp_path / "nowhere"))
    assert find_dataset(None) is None


# --- open_dataset -----------------------------------------------------------------------------------------------


def test_open_dataset_cifar10_uses_the_environment_when_no_folder_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_cifar_folder(tmp_path)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    dataset = open_dataset("cifar10", None, train=False)
    assert isinstance(dataset, CIFAR10) and len(dataset) == IMAGES_PER_BATCH


def test_open_dataset_cifar10_without_a_folder_says_how_to_give_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    with pytest.raises(DataError, match=rf"--data-dir or set {DATA_DIR_ENV}"):
        open_dataset("cifar10", None, train=True)


def test_open_dataset_synthetic_and_unknown_names() -> None:
    train, test = open_dataset("synthetic", None, train=True), open_dataset("synthetic", None, train=False)
    assert train.synthetic and len(train) == 2048 and len(test) == 512
    assert not torch.equal(train.images[:512], test.images)
    with pytest.raises(
        DataError, match=r"unknown dataset 'imagenet'; known datasets: cifar10, synthetic, fashion-mnist"
    ):
        open_dataset("imagenet", None, train=True)


def test_open_dataset_fashion_mnist_reads_the_given_folder(tmp_path: Path) -> None:
    _write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((4, 28, 28), dtype=np.uint8))
    _write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(4, dtype=np.uint8))
    assert len(open_dataset("fashion-mnist", str(tmp_path), train=True, augment=True)) == 4


# --- batch_loader -----------------------------------------------------------------------------------------------


def _all_batches(loader: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(loader)  # type: ignore[call-overload]


def test_batch_loader_repeats_exactly_for_the_same_seed_and_epoch() -> None:
    dataset = SyntheticCIFAR(n=100, seed=0, augment=True)
    first = _all_batches(batch_loader(dataset, 16, seed=5, epoch=2))
    second = _all_batches(batch_loader(dataset, 16, seed=5, epoch=2))
    assert len(first) == 6  # 100 // 16, the last partial batch dropped
    for (x1, y1), (x2, y2) in zip(first, second, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    loader = batch_loader(dataset, 16, seed=5, epoch=2)
    assert torch.equal(next(iter(loader))[0], next(iter(loader))[0])  # iterating again repeats


def test_batch_loader_order_changes_with_epoch_and_seed() -> None:
    dataset = SyntheticCIFAR(n=64, seed=0)
    base = next(iter(batch_loader(dataset, 64, seed=0, epoch=0)))[1]
    next_epoch = next(iter(batch_loader(dataset, 64, seed=0, epoch=1)))[1]
    other_seed = next(iter(batch_loader(dataset, 64, seed=1, epoch=0)))[1]
    assert not torch.equal(base, next_epoch) and not torch.equal(base, other_seed)
    assert sorted(base.tolist()) == sorted(dataset.labels.tolist())  # a permutation of the whole set


def test_batch_loader_without_shuffle_or_drop_last() -> None:
    dataset = SyntheticCIFAR(n=10, seed=0)
    loader = batch_loader(dataset, 4, seed=0, shuffle=False, drop_last=False)
    batches = _all_batches(loader)
    assert len(loader) == 3 and [len(y) for _, y in batches] == [4, 4, 2]
    assert torch.equal(torch.cat([y for _, y in batches]), dataset.labels)
    assert torch.equal(batches[0][0], dataset.get_batch(range(4))[0])


def test_batch_loader_takes_a_plain_torch_dataset() -> None:
    plain = TensorDataset(torch.arange(12.0).view(12, 1), torch.arange(12))
    batches = _all_batches(batch_loader(plain, 5, seed=0))
    assert len(batches) == 2 and batches[0][0].shape == (5, 1)
    assert torch.equal(batches[0][0].view(-1).long(), batches[0][1])


def test_batch_loader_rejects_a_dataset_without_one_full_batch() -> None:
    with pytest.raises(DataError, match="dataset of 8 samples has no full batch of 16"):
        batch_loader(SyntheticCIFAR(n=8), 16, seed=0)
    with pytest.raises(DataError, match="batch size must be positive"):
        batch_loader(SyntheticCIFAR(n=8), 0, seed=0)


def test_batch_loader_gives_the_same_batches_in_another_process() -> None:
    program = (
        "import torch\n"
        "from tapp_core.model.data import SyntheticCIFAR, batch_loader\n"
        "x, y = list(batch_loader(SyntheticCIFAR(n=64, seed=0, augment=True), 8, seed=3, epoch=1))[-1]\n"
        "print(float(x.double().sum()), y.tolist())\n"
    )
    x, y = list(batch_loader(SyntheticCIFAR(n=64, seed=0, augment=True), 8, seed=3, epoch=1))[-1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "random"}
    output = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=Path(__file__).parent.parent,
    ).stdout.split(" ", 1)
    assert float(output[0]) == float(x.double().sum())
    assert output[1].strip() == str(y.tolist())
