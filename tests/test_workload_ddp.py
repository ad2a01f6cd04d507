"""DDP training across real processes (gloo on the CPU): ranks agree with each other and with one device."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from gpuq.service.errors import JobCancelled
from gpuq.service.workloads import get_workload
from gpuq.workers.context import WorkloadContext
from gpuq.workers.workloads import data, nets, parallel, train

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: on a small shared box, more threads wait on each other (and on others)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

# One rank: two DDP steps on the shared global batch, then its parameters to a file.
RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
from gpuq.workers.workloads import data, nets, parallel
rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
torch.manual_seed(rank)  # different initial parameters per rank: DDP must broadcast rank 0's
trainer = parallel.make("ddp", nets.build("lenet"), [torch.device("cpu")], lr=0.5)
x, y = next(data.batches(data.synthetic(0, 15, 1)[0], 15))
for _ in range(2):
    trainer.step(x, y)
torch.save(trainer.model.state_dict(), out)
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_every_ddp_rank_ends_with_the_single_device_parameters(tmp_path):
    init = f"file://{tmp_path}/rendezvous"
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), "2", init,
                               str(tmp_path / f"rank{r}.pt")]) for r in range(2)]
    assert [p.wait(timeout=50) for p in ranks] == [0, 0]

    torch.manual_seed(0)
    single = parallel.make("single", nets.build("lenet"), [CPU], lr=0.5)
    x, y = next(data.batches(data.synthetic(0, 15, 1)[0], 15))
    for _ in range(2):
        single.step(x, y)
    states = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for key, value in single.model.state_dict().items():
        assert torch.equal(states[0][key], states[1][key]), key
        torch.testing.assert_close(states[0][key], value, rtol=1e-5, atol=1e-6, msg=key)


def ddp_context(tmp_path, **params) -> tuple[WorkloadContext, list[dict]]:
    base = {"strategy": "ddp", "epochs": 1, "batch_size": 32, "train_size": 256,
            "test_size": 64, "lr": 0.3, "checkpoint": str(tmp_path / "ck.pt")}
    rows: list[dict] = []
    p = get_workload("train").validate({**base, **params}, 2)
    return WorkloadContext(7, p, [CPU, CPU], log=lambda line: None, on_metric=rows.append), rows


@pytest.mark.timeout(90)
def test_ddp_job_runs_its_ranks_as_processes_and_rank_0_reports(tmp_path):
    ctx, rows = ddp_context(tmp_path)
    result = train.run(ctx)
    assert result["strategy"] == "ddp" and result["world_size"] == 2 and result["rank"] == 0
    assert result["devices"] == ["cpu", "cpu"] and result["simulated"] is True
    assert result["epochs"] == 1 and result["train_size"] == 256
    assert [r["epoch"] for r in rows] == [1]  # metrics from rank 0 only
    assert 0 <= result["test_acc"] <= 1 and result["train_loss"] > 0
    state = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert state["epoch"] == 1 and state["net"] == "lenet"


@pytest.mark.timeout(90)
def test_cancelling_a_ddp_job_stops_every_rank(tmp_path):
    ctx, rows = ddp_context(tmp_path, epochs=50, train_size=2048, checkpoint="")
    threading.Timer(4.0, ctx.cancelled.set).start()
    started = time.monotonic()
    with pytest.raises(JobCancelled):
        train.run(ctx)
    assert time.monotonic() - started < 40
