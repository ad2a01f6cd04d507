"""One training step on a job's devices, four ways: single, manual (seed 001 from scratch), dp, ddp.

Every strategy takes the *global* minibatch and makes the same update a single device would make
on it: gradients are of the loss summed over the batch and divided by the global batch size, however
the batch is split. That is what lets the tests compare strategies parameter for parameter.

A strategy's ``model`` is the plain network (never a wrapper) on the first device: the one that is
checkpointed and evaluated, so a checkpoint written under one strategy resumes under any other.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

STRATEGIES = ("single", "manual", "dp", "ddp")


class Single:
    """Plain training on one device."""

    rank = 0  # this process's rank, and how many processes train together
    world_size = 1

    def __init__(self, model: nn.Module, devices: list[torch.device], lr: float) -> None:
        self.device = devices[0]
        self.model = model.to(self.device)
        self.net: nn.Module = self.model  # what the forward pass goes through
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.shards = 1  # pieces each global batch is cut into: one per device or rank

    @property
    def eval_net(self) -> nn.Module:
        """What evaluation runs through: a module without collectives, so ranks need not agree."""
        return self.net

    def step(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """One update on the global batch; the batch's summed loss and correct count, on the device."""
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        out = self.net(x)
        loss = F.cross_entropy(out, y, reduction="sum")
        (loss / x.shape[0]).backward()
        self.optimizer.step()
        return loss.detach(), (out.argmax(1) == y).sum()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the network's and the optimizer's state dicts."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def reduce(self, t: Tensor) -> Tensor:
        """``t`` summed over all ranks (one process: ``t`` itself)."""
        return t

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (one process: ``flag`` itself)."""
        return flag


class DataParallel(Single):
    """``nn.DataParallel`` as seed 001 uses it: scatter the batch, replicate, gather the outputs.

    On simulated GPUs (CPU devices) the step is the single-device one. The module is then not
    wrapped at all: ``nn.DataParallel`` without device ids takes every GPU the process sees, and on a
    machine with CUDA it refuses a module on the CPU (found on a lent H100).
    """

    def __init__(self, model: nn.Module, devices: list[torch.device], lr: float) -> None:
        super().__init__(model, devices, lr)
        if self.device.type == "cuda":
            self.net = nn.DataParallel(self.model, device_ids=[d.index or 0 for d in devices])
        self.shards = len(devices)


class Manual(Single):
    """Seed 001's data parallelism from scratch: a replica per device, scatter, allreduce, update all.

    With simulated GPUs the replicas all sit on the CPU; the arithmetic is the same.
    """

    def __init__(self, model: nn.Module, devices: list[torch.device], lr: float) -> None:
        super().__init__(model, devices, lr)
        self.devices = devices
        self.shards = len(devices)
        self.replicas = [self.model] + [copy.deepcopy(self.model).to(d) for d in devices[1:]]
        self.optimizers = [self.optimizer] + [torch.optim.SGD(r.parameters(), lr=lr)
                                              for r in self.replicas[1:]]

    def step(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        n = x.shape[0]
        losses, correct = [], []
        for replica, opt, d, xs, ys in zip(self.replicas, self.optimizers, self.devices,
                                           x.tensor_split(len(self.devices)),
                                           y.tensor_split(len(self.devices)), strict=True):
            xs, ys = xs.to(d, non_blocking=True), ys.to(d, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            out = replica(xs)
            loss = F.cross_entropy(out, ys, reduction="sum")
            (loss / n).backward()
            losses.append(loss.detach().to(self.device))
            correct.append((out.argmax(1) == ys).sum().to(self.device))
        with torch.no_grad():
            for grads in zip(*[[p.grad for p in r.parameters()] for r in self.replicas], strict=True):
                allreduce(list(grads))
            for opt in self.optimizers:
                opt.step()
            # Batch-norm statistics differ per shard; keep replica 0's everywhere, as DDP does.
            for replica in self.replicas[1:]:
                for mine, first in zip(replica.buffers(), self.model.buffers(), strict=True):
                    mine.copy_(first)
        return torch.stack(losses).sum(), torch.stack(correct).sum()

    def load(self, state: dict[str, Any]) -> None:
        for replica, opt in zip(self.replicas, self.optimizers, strict=True):
            replica.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])


def allreduce(tensors: list[Tensor]) -> None:
    """Sum ``tensors`` (one per device) into the first, then copy the sum back into every one.

    In place, so it works when several "devices" are the same CPU.
    """
    for t in tensors[1:]:
        tensors[0].add_(t.to(tensors[0].device))
    for t in tensors[1:]:
        t.copy_(tensors[0])


class Distributed(Single):
    """One rank of ``DistributedDataParallel``; the process group must already be initialised.

    Every rank is handed the same global batch and trains on its own slice of it; DDP averages the
    gradients over the ranks, so each rank scales its loss by ``world_size`` to get the global mean.
    """

    def __init__(self, model: nn.Module, devices: list[torch.device], lr: float) -> None:
        import torch.distributed as dist

        super().__init__(model, devices, lr)
        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        ids = [self.device] if self.device.type == "cuda" else None
        self.net = nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        self.shards = self.world_size

    @property
    def eval_net(self) -> nn.Module:
        return self.model

    def step(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        n = x.shape[0]
        xs = x.tensor_split(self.world_size)[self.rank].to(self.device, non_blocking=True)
        ys = y.tensor_split(self.world_size)[self.rank].to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        out = self.net(xs)
        loss = F.cross_entropy(out, ys, reduction="sum")
        (loss * self.world_size / n).backward()
        self.optimizer.step()
        return loss.detach(), (out.argmax(1) == ys).sum()

    def reduce(self, t: Tensor) -> Tensor:
        t = t.clone()
        self.dist.all_reduce(t)
        return t

    def any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return bool(t.item())


def make(strategy: str, model: nn.Module, devices: list[torch.device], lr: float) -> Single:
    """The strategy called ``strategy`` (one of STRATEGIES) training ``model`` on ``devices``."""
    kinds = {"single": Single, "manual": Manual, "dp": DataParallel, "ddp": Distributed}
    if strategy not in kinds:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    return kinds[strategy](model, devices, lr)
