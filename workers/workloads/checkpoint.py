"""A training job's checkpoint: network and optimizer state plus the number of epochs done.

Written at the end of every epoch, atomically (a crash mid-write leaves the previous one), and read
back with ``map_location`` so a job checkpointed on one GPU resumes on another GPU or on the CPU.
Both go through the job's ``OwnerFiles``: the path is the user's, opened with their rights.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from gpuq.workers.owner_files import OwnerFiles


def save(files: OwnerFiles, path: str, state: dict[str, Any], net: str, epoch: int) -> None:
    """Write ``state`` (from a strategy's ``state()``) for network ``net`` after ``epoch`` epochs."""
    buffer = io.BytesIO()
    torch.save({**state, "net": net, "epoch": epoch}, buffer)
    files.write(path, buffer.getvalue())


def load(files: OwnerFiles, path: str, net: str, device: torch.device) -> dict[str, Any] | None:
    """The checkpoint at ``path`` with its tensors on ``device``; None when there is none yet.

    Raises ValueError when the checkpoint is of another network than ``net``.
    """
    data = files.read(path) if path else None
    if data is None:
        return None
    state = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    if state.get("net") != net:
        raise ValueError(f"checkpoint {path} holds a {state.get('net')!r} network, not {net!r}; "
                         f"give another --checkpoint path or the matching --model")
    return state
