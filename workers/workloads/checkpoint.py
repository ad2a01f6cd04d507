"""A training job's checkpoint: network and optimizer state plus the number of epochs done.

Written at the end of every epoch, atomically (a crash mid-write leaves the previous one), and read
back with ``map_location`` so a job checkpointed on one GPU resumes on another GPU or on the CPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def save(path: str, state: dict[str, Any], net: str, epoch: int) -> None:
    """Write ``state`` (from a strategy's ``state()``) for network ``net`` after ``epoch`` epochs."""
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({**state, "net": net, "epoch": epoch}, tmp)
    os.replace(tmp, path)


def load(path: str, net: str, device: torch.device) -> dict[str, Any] | None:
    """The checkpoint at ``path`` with its tensors on ``device``; None when there is none yet.

    Raises ValueError when the checkpoint is of another network than ``net``.
    """
    if not path or not os.path.exists(path):
        return None
    state = torch.load(path, map_location=device, weights_only=True)
    if state.get("net") != net:
        raise ValueError(f"checkpoint {path} holds a {state.get('net')!r} network, not {net!r}; "
                         f"give another --checkpoint path or the matching --model")
    return state
