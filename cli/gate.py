"""The gate an allocation's shell (or command) starts behind: ``python -I -m gpuq.cli.gate -- ARGV``.

`gpuq alloc` runs the shell in the user's own terminal, out of the worker's process tree, so the
worker finds its processes by looking (workers/allocation.py). A process the shell started and
that left at once (`(env -u GPUQ_RUN_ID setsid cmd &)`) was gone from every trace before the
worker's first look, and outlived the allocation. So the client starts this gate in the shell's
place, with the shell's environment: the worker finds it by its run id, puts it in the
allocation's cgroup where it has one, and then sends it SIGUSR1; only then does it exec the shell,
in the same process, so the shell and everything it starts are in that cgroup from their first
instruction. Without the signal within ALLOC_GATE_SECONDS (a worker of an older gpuq) it goes on
as before. Imports nothing heavy: it stands between a keystroke and the user's prompt.
"""

from __future__ import annotations

import os
import signal
import sys

from gpuq.service.constants import ALLOC_GATE_SECONDS, ALLOC_GATE_SIGNAL


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -I -m gpuq.cli.gate -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    # Blocked, the signal waits for sigtimedwait whenever it comes; the mask is given back before
    # the exec, which keeps it (the shell must get SIGUSR1 as any program does).
    signal.pthread_sigmask(signal.SIG_BLOCK, {ALLOC_GATE_SIGNAL})
    signal.sigtimedwait({ALLOC_GATE_SIGNAL}, ALLOC_GATE_SECONDS)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {ALLOC_GATE_SIGNAL})
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"gpuq: cannot run {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
