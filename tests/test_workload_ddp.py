"""DDP training across real processes (gloo on the CPU): ranks agree with each other and with one device."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from gpuq.service.errors import JobCancelled
from gpuq.service.workloads import get_workload
from gpuq.workers.context import WorkloadContext
from gpuq.workers.workloads import data, nets, parallel, train

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# Two DDP steps on the shared global batch; the rank's parameters after them, to a file.
RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[5])
from test_workload_ddp import ddp_steps
torch.set_num_threads(1)
torch.save(ddp_steps(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]), sys.argv[4])
# Its parameters are saved: out without the interpreter's teardown, where gloo's threads once ended
# it with "terminate called without an active exception" (SIGABRT) after all its work was done.
import os
os._exit(0)
"""


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return next(data.batches(data.synthetic(0, 15, 1)[0], 15))


def ddp_steps(rank: int, world: int, init_method: str) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s parameters after two DDP steps on the global batch."""
    # A bounded wait: gloo's own is 30 minutes, in C, where the test's timeout cannot reach it
    # (a rank that died left the other waiting out a whole session once).
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=40))
    try:
        torch.manual_seed(rank)  # different initial parameters per rank: DDP must broadcast rank 0's
        trainer = parallel.make("ddp", nets.build("lenet"), [CPU], lr=0.5)
        x, y = global_batch()
        for _ in range(2):
            trainer.step(x, y)
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        # The DDP model (its reducer) goes before its process group, as in the workload: freed after
        # destroy_process_group, the reducer's gloo group joined its threads forever (a hung run).
        del trainer
        return state
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_every_ddp_rank_ends_with_the_single_device_parameters(tmp_path):
    init = f"file://{tmp_path}/rendezvous"
    # Rank 1 in a process of its own, rank 0 here: two processes that only meet through gloo.
    rank1 = subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, "1", "2", init,
                              str(tmp_path / "rank1.pt"), os.path.dirname(__file__)])
    rank0 = ddp_steps(0, 2, init)
    assert rank1.wait(timeout=50) == 0
    rank1_state = torch.load(tmp_path / "rank1.pt", weights_only=True)

    torch.manual_seed(0)
    single = parallel.make("single", nets.build("lenet"), [CPU], lr=0.5)
    x, y = global_batch()
    for _ in range(2):
        single.step(x, y)
    for key, value in single.model.state_dict().items():
        assert torch.equal(rank0[key], rank1_state[key]), key
        torch.testing.assert_close(rank0[key], value, rtol=1e-5, atol=1e-6, msg=key)


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
