"""The gate an allocation's shell (or command) starts behind: ``python -I -m gpuq.cli.gate -- ARGV``.

`gpuq alloc` runs the shell in the user's own terminal, out of the worker's process tree, so the
worker finds its processes by looking (workers/allocation.py). A process the shell started and
that left at once (`(env -u GPUQ_RUN_ID setsid cmd &)`) was gone from every trace before the
worker's first look, and outlived the allocation. So the client starts this gate in the shell's
place, with the shell's environment: the worker finds it by its run id, puts it in the
allocation's cgroup where it has one, and then sends it SIGUSR1 (SIGUSR2 where it could not hold it
to its --cpus, which the gate says on the terminal); only then does it exec the shell, in the same
process, so the shell and everything it starts are in that cgroup from their first instruction.
Without a signal within ALLOC_GATE_SECONDS (a worker of an older gpuq) it goes on as before.
An allocation with --cpus asks the server, once let through, which cores its worker bound it to
(they were chosen after the shell's environment was made), and hands them to the shell in
GPUQ_CORES as a command job gets them. Imports nothing heavy: it stands between a keystroke and
the user's prompt.
"""

from __future__ import annotations

import os
import signal
import sys

from gpuq.service.constants import ALLOC_GATE_SECONDS, ALLOC_GATE_SIGNALS, ALLOC_GATE_UNHELD_SIGNAL
from gpuq.service.job_cpus import CORES_VARIABLE, CPUS_VARIABLE, not_held

# How long the shell waits for the server to say its cores, at most (then it starts without them).
_CORES_TIMEOUT_SECONDS = 2.0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -I -m gpuq.cli.gate -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    # Blocked, the signals wait for sigtimedwait whenever one comes; the mask is given back before
    # the exec, which keeps it (the shell must get SIGUSR1 and SIGUSR2 as any program does).
    signal.pthread_sigmask(signal.SIG_BLOCK, ALLOC_GATE_SIGNALS)
    got = signal.sigtimedwait(ALLOC_GATE_SIGNALS, ALLOC_GATE_SECONDS)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, ALLOC_GATE_SIGNALS)
    if got is not None and got.si_signo == ALLOC_GATE_UNHELD_SIGNAL and os.environ.get(CPUS_VARIABLE):
        print(f"gpuq: {not_held(os.environ[CPUS_VARIABLE], os.environ.get('GPUQ_NODE') or 'its node')}",
              file=sys.stderr)
    if got is not None and os.environ.get(CPUS_VARIABLE) and (cores := _bound_cores(os.environ.get("GPUQ_JOB_ID"))):
        os.environ[CORES_VARIABLE] = cores
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"gpuq: cannot run {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # not reached: exec replaced this process


def _bound_cores(job_id: str | None) -> str | None:
    """The cores allocation ``job_id``'s worker bound it to, as `gpuq show` gives them (the worker
    wrote them before it let the gate through); None where it is not bound or the server does not say."""
    if not job_id or not job_id.isdigit():
        return None
    try:
        from gpuq.cli.client import Client
        from gpuq.service.core_sets import format_list, parse_list

        cores = Client(timeout=_CORES_TIMEOUT_SECONDS).get(f"/jobs/{job_id}").get("cores")
        # A list of cores, in the project's one form of them, or nothing: never a string that is not.
        return format_list(parse_list(cores)) if isinstance(cores, str) and cores.strip() else None
    except Exception:  # noqa: BLE001 - the shell starts either way, only without the variable
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
