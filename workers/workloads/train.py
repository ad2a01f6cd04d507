"""Seed 001: train LeNet or ResNet-18 on Fashion-MNIST (or a synthetic stand-in) on the job's GPUs.

``run`` is the workload's entry. The strategies ``single``, ``manual`` and ``dp`` run in this
process over all of ``ctx.devices``; ``ddp`` runs one process per device, see ``ranks``.
Statistics stay on the device during an epoch and are copied to the host once at its end (the
seed 002 lesson: a ``.item()`` per step makes the GPU wait for Python).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpuq.service.errors import JobCancelled
from gpuq.workers.context import WorkloadContext
from gpuq.workers.workloads import checkpoint, data, nets, parallel
from gpuq.workers.workloads.common import synchronize

# How many steps apart DDP ranks agree on whether the job was cancelled: each agreement is a
# collective and a host sync, too costly every step, and a cancel still lands within a second.
DDP_CANCEL_EVERY = 20
# Test-set batch size: evaluation keeps no gradients, so it can take bigger bites than training.
EVAL_BATCH = 1024


def run(ctx: WorkloadContext) -> dict[str, Any]:
    """Train per ``ctx.params``; the final epoch's figures, the model, strategy, devices, epochs."""
    if ctx.params["strategy"] == "ddp":
        from gpuq.workers.workloads import ranks

        return ranks.launch(ctx)
    return fit(ctx, ctx.params["strategy"], list(ctx.devices))


def fit(ctx: WorkloadContext, strategy: str, devices: list[torch.device]) -> dict[str, Any]:
    """Train with ``strategy`` on ``devices`` (one per rank under ddp), resuming from a checkpoint.

    Under ddp every rank calls this; only rank 0 logs, records metrics and writes checkpoints, and
    every rank returns the same figures.
    """
    p = ctx.params
    if devices[0].type == "cpu":
        # Late in training, tiny gradients become denormal floats, which the CPU handles ~10x slower.
        torch.set_flush_denormal(True)
    torch.manual_seed(p["seed"])  # the same initial parameters on every rank and every rerun
    trainer = parallel.make(strategy, nets.build(p["model"]), devices, p["lr"])
    reporter = trainer.rank == 0
    say = ctx.log if reporter else (lambda line: None)
    train_set, test_set, source = data.load(ctx.files, p)
    start = 0
    state = checkpoint.load(ctx.files, p["checkpoint"], p["model"], trainer.device)
    if state is not None:
        trainer.load(state)
        start = state["epoch"]
        say(f"train: resumed from {p['checkpoint']} after epoch {start}")
    say(f"train: {p['model']} on {source} data ({len(train_set)} train, {len(test_set)} test), "
        f"strategy {strategy}, devices {', '.join(str(d) for d in devices)}, "
        f"world size {trainer.world_size}")

    row: dict[str, Any] = {}
    total_seconds = 0.0
    for epoch in range(start, p["epochs"]):
        row = train_epoch(ctx, trainer, train_set, p["batch_size"], p["seed"], epoch)
        row["test_acc"] = evaluate(trainer, test_set)
        total_seconds += row["seconds"]
        if reporter:
            ctx.metric(**row)
            say(f"epoch {row['epoch']}/{p['epochs']}: loss {row['train_loss']:.4f}, "
                f"train acc {row['train_acc']:.3f}, test acc {row['test_acc']:.3f}, "
                f"{row['examples_per_s']:.0f} examples/s, {row['seconds']:.2f} s")
            if p["checkpoint"]:
                checkpoint.save(ctx.files, p["checkpoint"], trainer.state(), p["model"], epoch + 1)
    if not row:  # the checkpoint had already done every epoch asked for
        row = {"epoch": start, "test_acc": evaluate(trainer, test_set)}
    return {
        "model": p["model"],
        "strategy": strategy,
        "devices": [str(d) for d in devices],
        "world_size": trainer.world_size,
        "simulated": trainer.device.type == "cpu",  # the CPU stood in for the GPUs
        "data": source,
        "train_size": len(train_set),
        "test_size": len(test_set),
        "batch_size": p["batch_size"],
        "lr": p["lr"],
        "epochs": row["epoch"],
        "epochs_this_run": row["epoch"] - start,
        "resumed_from_epoch": start,
        "train_loss": row.get("train_loss"),
        "train_acc": row.get("train_acc"),
        "test_acc": row["test_acc"],
        "examples_per_s": row.get("examples_per_s"),
        "seconds": total_seconds,
        "checkpoint": p["checkpoint"] or None,
    }


def train_epoch(ctx: WorkloadContext, trainer: parallel.Single, train_set: data.Dataset,
                batch_size: int, seed: int, epoch: int) -> dict[str, Any]:
    """One pass over ``train_set``; the epoch's metric row (without test accuracy)."""
    trainer.model.train()
    device = trainer.device
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen = 0
    order = data.epoch_order(len(train_set), seed, epoch)
    synchronize(device)
    started = time.perf_counter()
    for step, (x, y) in enumerate(data.batches(train_set, batch_size, order, trainer.shards)):
        check_cancelled(ctx, trainer, step)
        loss, right = trainer.step(x, y)
        loss_sum += loss
        correct += right
        seen += x.shape[0]
    synchronize(device)
    seconds = time.perf_counter() - started
    # Each DDP rank counted its own slices; the sum is the global batch's.
    totals = trainer.reduce(torch.stack([loss_sum.float(), correct.float()]))
    loss_total, correct_total = totals.tolist()
    seconds = max(seconds, 1e-9)
    return {
        "epoch": epoch + 1,
        "train_loss": loss_total / max(seen, 1),
        "train_acc": correct_total / max(seen, 1),
        "examples_per_s": seen / seconds,
        "seconds": seconds,
    }


def check_cancelled(ctx: WorkloadContext, trainer: parallel.Single, step: int) -> None:
    """Raise JobCancelled when the job was cancelled; under ddp, when it was on any rank."""
    if trainer.world_size == 1:
        ctx.check_cancelled()
    elif step % DDP_CANCEL_EVERY == 0 and trainer.any_rank(ctx.cancelled.is_set()):
        raise JobCancelled(f"job {ctx.job_id} cancelled")


@torch.no_grad()
def evaluate(trainer: parallel.Single, test_set: data.Dataset) -> float:
    """Accuracy on ``test_set``; under ddp each rank scores its slice and the counts are summed."""
    net = trainer.eval_net
    trainer.model.eval()
    part = torch.arange(len(test_set)).tensor_split(trainer.world_size)[trainer.rank]
    subset = data.Dataset(test_set.images[part], test_set.labels[part])
    correct = torch.zeros((), device=trainer.device)
    for x, y in data.batches(subset, EVAL_BATCH):
        out = net(x.to(trainer.device, non_blocking=True))
        correct += (out.argmax(1) == y.to(trainer.device)).sum()
    trainer.model.train()
    total = trainer.reduce(torch.stack([correct, torch.tensor(float(len(subset)), device=trainer.device)]))
    right, count = total.tolist()
    return right / max(count, 1.0)
