"""A job's way to use simulated GPU memory: ``python -m gpuq.workers.simulated_memory --mib 3000``.

Holds that much memory on the first GPU of CUDA_VISIBLE_DEVICES for ``--seconds`` (default: until
stopped), optionally changing to ``--then-mib`` after ``--after`` seconds, the way a training run
grows; the worker's readings count it as the GPU's NVML would count a CUDA process's. Only on
simulated GPUs: the worker gives their jobs GPUQ_SIMULATED_MEMORY_DIR. Imports nothing heavy.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from gpuq.service.simulated_memory import ENV_VARIABLE, hold, release


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuq.workers.simulated_memory",
                                     description="Hold simulated GPU memory (a job on simulated GPUs).")
    parser.add_argument("--mib", type=int, required=True, help="MiB to hold")
    parser.add_argument("--seconds", type=float, default=None, help="how long to hold it (default: until stopped)")
    parser.add_argument("--then-mib", type=int, default=None, help="MiB to hold instead after --after seconds")
    parser.add_argument("--after", type=float, default=None, help="seconds before holding --then-mib")
    args = parser.parse_args(argv)
    if (args.then_mib is None) != (args.after is None):
        parser.error("--then-mib and --after go together")
    if args.mib < 0 or (args.then_mib or 0) < 0:
        parser.error("memory held must not be negative")
    directory = os.environ.get(ENV_VARIABLE)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if not directory:
        print(f"simulated_memory: {ENV_VARIABLE} is not set: this job is not on simulated GPUs", file=sys.stderr)
        return 2
    if not visible.isdigit():
        print(f"simulated_memory: CUDA_VISIBLE_DEVICES names no simulated GPU ({visible!r})", file=sys.stderr)
        return 2
    index = int(visible)
    # SIGTERM (a cancel, a stop) ends the hold the way a CUDA process's end frees its memory.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    start = time.monotonic()
    try:
        _hold(Path(directory), index, args.mib)
        if args.then_mib is not None:
            _sleep_until(start, args.after, args.seconds)
            if args.seconds is None or args.after < args.seconds:
                _hold(Path(directory), index, args.then_mib)
        _sleep_until(start, args.seconds, args.seconds)
    finally:
        release(Path(directory), index)
    return 0


def _hold(directory: Path, index: int, mib: int) -> None:
    hold(directory, index, mib)
    print(f"holding {mib} MiB of simulated GPU {index}", flush=True)


def _sleep_until(start: float, at: float | None, end: float | None) -> None:
    """Sleep until ``at`` seconds after ``start`` (None: for ever), never past ``end``."""
    if at is None and end is None:
        while True:
            time.sleep(3600)
    limit = min(t for t in (at, end) if t is not None)
    time.sleep(max(start + limit - time.monotonic(), 0.0))


if __name__ == "__main__":
    sys.exit(main())
