"""Whole numbers as a user types them on gpuq's command line: ASCII digits, nothing else.

Click reads an int option with Python's ``int()``, which also takes digit groups (``7_0`` is 70),
other scripts' digits (``١٢``) and spaces around: `gpuq cancel 7_0`, SLURM's way to name task 0 of
array 7, cancelled job 70, and `--gpus 1_0` asked for ten GPUs. These parsers (typer's ``parser=``)
take digits only and say in the error what is taken. Click's ``min`` does not apply beside a
parser, so each carries its own bounds; an option's default (an int already) passes as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_DIGITS = re.compile(r"[0-9]+")
_SIGNED = re.compile(r"-?[0-9]+")


def job_id(text: str | int) -> int:
    """A job or array id: 1 or more, digits only."""
    if isinstance(text, int):
        return text
    if _DIGITS.fullmatch(text) and int(text) >= 1:
        return int(text)
    if re.fullmatch(r"[0-9]+_[0-9]+", text):
        array, _, _ = text.partition("_")
        raise ValueError(f"{text!r} is not a job id: an array's tasks have job ids of their own "
                         f"(gpuq show --array {array} lists them)")
    if re.fullmatch(r"[0-9]+([-,][0-9]+)+", text):
        raise ValueError(f"{text!r} is not a job id: give each id (12 13 14), or --array ID for an array's every job")
    raise ValueError(f"{text!r} is not a job id (a whole number from 1)")


def whole(low: int = 0, high: int | None = None, name: str = "count") -> Callable[[str | int], int]:
    """A parser of whole numbers from ``low`` (to ``high``), digits only; ``name`` is its metavar."""
    def parse(text: str | int) -> int:
        if isinstance(text, int):
            return text
        if not _SIGNED.fullmatch(text):
            raise ValueError(f"{text!r} is not a whole number (digits only)")
        value = int(text)  # below zero: said to be too small, below
        if high is not None and not low <= value <= high:
            raise ValueError(f"{value} is out of range ({low} to {high})")
        if value < low:
            raise ValueError(f"{value} is too small ({low} or more)")
        return value

    parse.__name__ = name  # typer shows it as the option's metavar (COUNT)
    return parse


@dataclass(frozen=True)
class GpuAsk:
    """``--gpus`` as given: how many, and the model where it came as sbatch's TYPE:COUNT (a100:2)."""

    count: int
    model: str | None = None


def gpu_count(text: str | int | GpuAsk) -> GpuAsk:
    """``--gpus``: 1 or more, or TYPE:COUNT as sbatch's ``--gpus a100:2`` (the type as --gpu-type's)."""
    if isinstance(text, GpuAsk):
        return text
    if isinstance(text, int):
        return GpuAsk(_one_or_more(text))
    model, colon, count = text.rpartition(":")
    if not colon:
        return GpuAsk(_one_or_more(text))
    if not model.strip() or not _DIGITS.fullmatch(count):
        raise ValueError(f"{text!r} is not a GPU count: give COUNT (2) or TYPE:COUNT (a100:2)")
    return GpuAsk(_one_or_more(count), model.strip())


def gres(text: str | GpuAsk) -> GpuAsk:
    """sbatch's ``--gres gpu[:TYPE][:COUNT]``: GPUs as ``--gpus`` takes them (``gpu``: one,
    ``gpu:a100``: one of that type, ``gpu:a100:2``); GPUs are the one generic resource gpuq knows."""
    if isinstance(text, GpuAsk):
        return text
    kind, _, ask = text.strip().partition(":")
    if kind != "gpu" or "," in ask:
        raise ValueError(f"{text!r}: GPUs are the one resource gpuq gives: gpu, gpu:COUNT or gpu:TYPE:COUNT")
    if not ask:
        return GpuAsk(1)
    if ":" not in ask and not _DIGITS.fullmatch(ask):
        return gpu_count(f"{ask}:1")  # gpu:a100, as SLURM reads it: one of that type
    return gpu_count(ask)


ONE_GPU = GpuAsk(1)
_one_or_more = whole(1)
gpu_count.__name__ = "[type:]count"
gres.__name__ = "gpu[:type][:count]"


def integer(text: str | int) -> int:
    """A number that may be below zero (a priority): digits, a minus sign first at most."""
    if isinstance(text, int):
        return text
    if not _SIGNED.fullmatch(text):
        raise ValueError(f"{text!r} is not a whole number (digits, a - first at most)")
    return int(text)
