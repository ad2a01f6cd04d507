"""The images a training job learns from: Fashion-MNIST IDX files, or a synthetic set of that shape.

Both come out as a ``Dataset``: images kept as uint8 ``[N, 1, 28, 28]`` (a quarter of the memory of
floats) and labels as int64 ``[N]``; ``batches`` turns a shuffled slice into float images in [0, 1],
the way d2l's ``ToTensor`` does.
"""

from __future__ import annotations

import gzip
import io
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gpuq.workers.owner_files import OwnerFiles

# The four files of Fashion-MNIST (and MNIST), each found plain or with .gz appended.
TRAIN_IMAGES = "train-images-idx3-ubyte"
TRAIN_LABELS = "train-labels-idx1-ubyte"
TEST_IMAGES = "t10k-images-idx3-ubyte"
TEST_LABELS = "t10k-labels-idx1-ubyte"
IDX_FILES = (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS)

CLASSES = 10
SIDE = 28
# Pixels a synthetic image's pattern is moved by, at most, in each direction.
_SHIFT = 3

# IDX type byte -> (torch dtype, bytes per element); all big-endian in the file.
# The most an IDX file may hold once unpacked (Fashion-MNIST's largest: 45 MiB): a small .gz that
# unpacks to many GiB (a gzip bomb) stops there instead of filling the warm worker's memory.
MAX_IDX_BYTES = 256 << 20

_IDX_TYPES = {0x08: (torch.uint8, 1), 0x09: (torch.int8, 1), 0x0B: (torch.int16, 2),
              0x0C: (torch.int32, 4), 0x0D: (torch.float32, 4), 0x0E: (torch.float64, 8)}


@dataclass
class Dataset:
    """Images (uint8, ``[N, 1, 28, 28]``) and their labels (int64, ``[N]``)."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def read_idx(path: str, raw: bytes) -> torch.Tensor:
    """The tensor stored in ``raw``, the IDX file at ``path`` (gzip-compressed when it ends in .gz)."""
    if path.endswith(".gz"):
        raw = _gunzip(path, raw, MAX_IDX_BYTES)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    dtype, width = _IDX_TYPES[raw[2]]
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    count = 1
    for n in shape:
        count *= n
    if len(raw) - header != count * width:
        raise ValueError(f"{path}: header says {shape} but holds {len(raw) - header} bytes of data")
    data = torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8)
    if width > 1:
        # IDX is big-endian; flip each element's bytes before viewing them as the wide type.
        data = data.view(-1, width).flip(1).reshape(-1).view(dtype)
    else:
        data = data.view(dtype)
    return data.reshape(shape)


def _gunzip(path: str, raw: bytes, limit: int) -> bytes:
    """``raw`` unpacked, read no further than one byte past ``limit``."""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as unpacked:
            data = unpacked.read(limit + 1)
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path} is not a gzip file gpuq can read: {exc}") from None
    if len(data) > limit:
        raise ValueError(f"{path} unpacks to more than {limit >> 20} MiB, the most an IDX file may hold")
    return data


def find_idx(files: OwnerFiles, data_dir: str, name: str) -> tuple[str, bytes] | None:
    """The path and bytes of IDX file ``name`` in ``data_dir``, plain or .gz, read with the job
    owner's rights; None when neither is there."""
    for candidate in (name, name + ".gz"):
        path = os.path.join(data_dir, candidate)
        raw = files.read(path)
        if raw is not None:
            return path, raw
    return None


def load_fashion_mnist(files: OwnerFiles, data_dir: str) -> tuple[Dataset, Dataset]:
    """The training and test sets from the four IDX files in ``data_dir``."""
    tensors = []
    for name in IDX_FILES:
        found = find_idx(files, data_dir, name)
        if found is None:
            raise FileNotFoundError(f"{data_dir} lacks {name} (or {name}.gz)")
        tensors.append(read_idx(*found))
    train_x, train_y, test_x, test_y = tensors
    return (Dataset(train_x.reshape(-1, 1, SIDE, SIDE), train_y.long()),
            Dataset(test_x.reshape(-1, 1, SIDE, SIDE), test_y.long()))


def synthetic(seed: int, train_size: int, test_size: int) -> tuple[Dataset, Dataset]:
    """A learnable stand-in for Fashion-MNIST: a pattern per class, shifted, blurred by a second
    class's pattern and by noise, so a network has to learn shapes (LeNet gets ~80% in a few epochs).

    The same seed gives the same sets in every process, which data-parallel ranks rely on.
    """
    g = torch.Generator().manual_seed(seed)
    # Coarse 7x7 blobs scaled up to 28x28: shapes a small CNN can tell apart.
    patterns = (torch.rand(CLASSES, 1, 7, 7, generator=g) > 0.5).float()
    patterns = torch.nn.functional.interpolate(patterns, size=(SIDE, SIDE), mode="nearest")

    def make(n: int) -> Dataset:
        labels = torch.randint(0, CLASSES, (n,), generator=g)
        other = torch.randint(0, CLASSES, (n,), generator=g)
        contrast = 0.5 + 0.5 * torch.rand(n, 1, 1, 1, generator=g)
        distractor = 0.5 * torch.rand(n, 1, 1, 1, generator=g)
        images = patterns[labels] * contrast + patterns[other] * distractor
        shifts = torch.randint(-_SHIFT, _SHIFT + 1, (n, 2), generator=g)
        for dx in range(-_SHIFT, _SHIFT + 1):
            for dy in range(-_SHIFT, _SHIFT + 1):
                moved = (shifts[:, 0] == dx) & (shifts[:, 1] == dy)
                images[moved] = images[moved].roll((dx, dy), (2, 3))
        images += 0.5 * torch.randn(n, 1, SIDE, SIDE, generator=g)
        return Dataset((images.clamp_(0, 1) * 255).round_().to(torch.uint8), labels)

    return make(train_size), make(test_size)


def load(files: OwnerFiles, params: dict) -> tuple[Dataset, Dataset, str]:
    """The training set, the test set and a word for where they came from, per the job's params."""
    if params.get("data_dir"):
        train, test = load_fashion_mnist(files, params["data_dir"])
        return train, test, params["data_dir"]
    train, test = synthetic(params["seed"], params["train_size"], params["test_size"])
    return train, test, "synthetic"


def batches(data: Dataset, batch_size: int, order: torch.Tensor | None = None,
            min_batch: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(images, labels)`` minibatches in ``order`` (all, in order, when None), images as floats.

    A last batch smaller than ``min_batch`` is dropped: a data-parallel step needs at least one
    example for every device.
    """
    n = len(data)
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        if stop - start < min_batch:
            break
        idx = order[start:stop] if order is not None else slice(start, stop)
        yield data.images[idx].float().div_(255), data.labels[idx]


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled order of epoch ``epoch``: the same on every rank and after a resume."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
