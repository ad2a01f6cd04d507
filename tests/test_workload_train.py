"""The train workload through a WorkloadContext on the CPU: it learns, checkpoints, resumes, stops."""

from __future__ import annotations

import gzip
import json
import struct
import threading
import time

import pytest
import torch

from gpuq.service.errors import JobCancelled
from gpuq.service.workloads import get_workload
from gpuq.workers.context import WorkloadContext
from gpuq.workers.workloads import train

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")

RESULT_KEYS = {"model", "strategy", "devices", "world_size", "simulated", "data", "train_size",
               "test_size", "batch_size", "lr", "epochs", "epochs_this_run", "resumed_from_epoch",
               "train_loss", "train_acc", "test_acc", "examples_per_s", "seconds", "checkpoint"}
ROW_KEYS = {"epoch", "train_loss", "train_acc", "test_acc", "examples_per_s", "seconds"}


def context(gpus: int = 1, **params) -> tuple[WorkloadContext, list[dict], list[str]]:
    base = {"epochs": 1, "batch_size": 32, "train_size": 320, "test_size": 100, "lr": 0.3}
    p = get_workload("train").validate({**base, **params}, gpus)
    rows: list[dict] = []
    lines: list[str] = []
    return WorkloadContext(1, p, [CPU] * gpus, log=lines.append, on_metric=rows.append), rows, lines


@pytest.mark.timeout(60)
def test_lenet_learns_synthetic_data_well_above_chance():
    ctx, rows, lines = context(epochs=3, train_size=1000, test_size=300, batch_size=32)
    result = train.run(ctx)
    assert result["test_acc"] > 0.4  # chance is 0.1
    assert [r["epoch"] for r in rows] == [1, 2, 3] and all(set(r) == ROW_KEYS for r in rows)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert sum(line.startswith("epoch ") for line in lines) == 3
    assert set(result) == RESULT_KEYS
    assert json.loads(json.dumps(result)) == result


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["manual", "dp"])
def test_data_parallel_strategies_train_on_two_simulated_gpus(strategy):
    ctx, rows, _ = context(gpus=2, strategy=strategy)
    result = train.run(ctx)
    assert result["strategy"] == strategy and result["devices"] == ["cpu", "cpu"]
    assert result["simulated"] is True and len(rows) == 1
    assert json.loads(json.dumps(result)) == result


@pytest.mark.timeout(60)
def test_checkpoint_resume_continues_where_a_straight_run_would_be(tmp_path):
    straight, _, _ = context(epochs=2, checkpoint=str(tmp_path / "straight.pt"))
    train.run(straight)

    first, _, _ = context(epochs=1, checkpoint=str(tmp_path / "resumed.pt"))
    assert train.run(first)["epochs"] == 1
    saved = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert saved["epoch"] == 1 and "optimizer" in saved

    second, rows, lines = context(epochs=2, checkpoint=str(tmp_path / "resumed.pt"))
    result = train.run(second)
    assert result["resumed_from_epoch"] == 1 and result["epochs"] == 2
    assert result["epochs_this_run"] == 1 and [r["epoch"] for r in rows] == [2]
    assert any("resumed" in line for line in lines)
    a = torch.load(tmp_path / "straight.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert b["epoch"] == 2
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], msg=key)


def test_a_finished_checkpoint_trains_no_more_and_still_reports(tmp_path):
    ck = str(tmp_path / "ck.pt")
    train.run(context(epochs=1, checkpoint=ck)[0])
    ctx, rows, _ = context(epochs=1, checkpoint=ck)
    result = train.run(ctx)
    assert rows == [] and result["epochs_this_run"] == 0 and 0 <= result["test_acc"] <= 1


def test_a_checkpoint_of_another_network_is_refused(tmp_path):
    ck = str(tmp_path / "ck.pt")
    train.run(context(epochs=1, checkpoint=ck)[0])
    with pytest.raises(ValueError, match="holds a 'lenet' network"):
        train.run(context(epochs=1, checkpoint=ck, model="resnet18", train_size=4, test_size=2)[0])


def test_training_reads_fashion_mnist_idx_files_from_data_dir(tmp_path):
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", 64), ("t10k", 16)):
        images = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
        labels = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
        for kind, t in (("images-idx3", images), ("labels-idx1", labels)):
            raw = bytes([0, 0, 8, t.dim()]) + struct.pack(f">{t.dim()}I", *t.shape) + bytes(t.flatten().tolist())
            (tmp_path / f"{prefix}-{kind}-ubyte.gz").write_bytes(gzip.compress(raw))
    ctx, rows, _ = context(data_dir=str(tmp_path))
    result = train.run(ctx)
    assert result["data"] == str(tmp_path)
    assert (result["train_size"], result["test_size"]) == (64, 16)


@pytest.mark.timeout(60)
def test_cancel_stops_training_within_a_step():
    ctx, _, _ = context(epochs=100, train_size=2000)
    threading.Timer(1.0, ctx.cancelled.set).start()
    started = time.monotonic()
    with pytest.raises(JobCancelled):
        train.run(ctx)
    assert time.monotonic() - started < 15
