"""The training data: the IDX reader on files the test writes, and the synthetic stand-in."""

from __future__ import annotations

import gzip
import struct

import pytest
import torch

from gpuq.workers.owner_files import OwnerFiles
from gpuq.workers.workloads import data


def write_idx(path, tensor: torch.Tensor, type_byte: int = 0x08) -> None:
    """An IDX file holding ``tensor`` (big-endian), gzipped when ``path`` ends in .gz."""
    header = bytes([0, 0, type_byte, tensor.dim()]) + struct.pack(f">{tensor.dim()}I", *tensor.shape)
    # struct, not NumPy: torch's CPU wheel does not bring NumPy, and gpuq does not need it.
    code = {torch.uint8: "B", torch.int8: "b", torch.int16: "h", torch.int32: "i",
            torch.float32: "f", torch.float64: "d"}[tensor.dtype]
    values = tensor.flatten().tolist()
    body = struct.pack(f">{len(values)}{code}", *values)
    raw = header + body
    path.write_bytes(gzip.compress(raw) if str(path).endswith(".gz") else raw)


def fake_fashion_mnist(root, n_train: int = 12, n_test: int = 5, gz_labels: bool = True):
    g = torch.Generator().manual_seed(1)
    sets = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
        labels = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte", images)
        write_idx(root / (f"{prefix}-labels-idx1-ubyte" + (".gz" if gz_labels else "")), labels)
        sets[prefix] = (images, labels)
    return sets


@pytest.mark.parametrize("name", ["images-idx3-ubyte", "images-idx3-ubyte.gz"])
def test_read_idx_returns_the_tensor_written_plain_or_gzipped(tmp_path, name):
    images = torch.arange(3 * 4 * 5, dtype=torch.uint8).reshape(3, 4, 5)
    write_idx(tmp_path / name, images)
    out = data.read_idx(name, (tmp_path / name).read_bytes())
    assert out.dtype == torch.uint8 and torch.equal(out, images)


def test_read_idx_reads_big_endian_wide_types(tmp_path):
    values = torch.tensor([[1, -2, 70000], [3, 4, -5]], dtype=torch.int32)
    write_idx(tmp_path / "ints-idx2-int", values, type_byte=0x0C)
    assert torch.equal(data.read_idx("ints-idx2-int", (tmp_path / "ints-idx2-int").read_bytes()), values)


def test_read_idx_rejects_a_file_that_is_not_idx_or_is_truncated(tmp_path):
    (tmp_path / "junk").write_bytes(b"PK\x03\x04 not an idx file")
    with pytest.raises(ValueError, match="not an IDX file"):
        data.read_idx("junk", (tmp_path / "junk").read_bytes())
    write_idx(tmp_path / "short", torch.zeros(4, 4, dtype=torch.uint8))
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-3])
    with pytest.raises(ValueError, match="holds"):
        data.read_idx("short", (tmp_path / "short").read_bytes())


def test_load_fashion_mnist_gives_images_and_labels_in_training_shape(tmp_path):
    sets = fake_fashion_mnist(tmp_path)
    train, test = data.load_fashion_mnist(OwnerFiles(), str(tmp_path))
    assert train.images.shape == (12, 1, 28, 28) and test.images.shape == (5, 1, 28, 28)
    assert train.labels.dtype == torch.int64
    assert torch.equal(train.images[:, 0], sets["train"][0])
    assert torch.equal(test.labels, sets["t10k"][1].long())
    x, y = next(data.batches(train, 8))
    assert x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1 and x.shape == (8, 1, 28, 28)


def test_load_names_the_missing_file(tmp_path):
    fake_fashion_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        data.load_fashion_mnist(OwnerFiles(), str(tmp_path))


def test_synthetic_data_is_the_same_for_the_same_seed_and_has_every_class():
    a_train, a_test = data.synthetic(3, 200, 50)
    b_train, _ = data.synthetic(3, 200, 50)
    c_train, _ = data.synthetic(4, 200, 50)
    assert torch.equal(a_train.images, b_train.images) and torch.equal(a_train.labels, b_train.labels)
    assert not torch.equal(a_train.images, c_train.images)
    assert a_train.images.shape == (200, 1, 28, 28) and a_train.images.dtype == torch.uint8
    assert len(a_test) == 50 and set(a_train.labels.tolist()) == set(range(10))


def test_batches_drop_a_last_batch_too_small_to_split_over_the_devices():
    train, _ = data.synthetic(0, 9, 1)
    assert [len(y) for _, y in data.batches(train, 4)] == [4, 4, 1]
    assert [len(y) for _, y in data.batches(train, 4, min_batch=2)] == [4, 4]
    order = data.epoch_order(9, seed=0, epoch=1)
    assert torch.equal(order, data.epoch_order(9, seed=0, epoch=1))
    assert sorted(order.tolist()) == list(range(9))


def test_a_gzipped_idx_that_unpacks_past_the_cap_is_refused_without_unpacking_it_all(tmp_path, monkeypatch):
    # A gzip bomb: a few KiB that unpack to far more than the worker should hold.
    monkeypatch.setattr(data, "MAX_IDX_BYTES", 1 << 20)
    bomb = gzip.compress(b"\0" * (8 << 20))
    with pytest.raises(ValueError, match="unpacks to more than 1 MiB"):
        data.read_idx("images-idx3-ubyte.gz", bomb)


def test_a_gz_name_that_holds_no_gzip_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="junk-idx1-ubyte.gz is not a gzip file"):
        data.read_idx("junk-idx1-ubyte.gz", b"plain bytes")
