"""A user's command run as a job: no shell, its own session and process group, output kept."""

from __future__ import annotations

import codecs
import os
import signal
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

from gpuq.workers.output import OutputSink

# Seconds between looks at the child and at the cancel flag.
POLL_SECONDS = 0.05


@dataclass(frozen=True)
class CommandOutcome:
    exit_code: int | None
    cancelled: bool


def run_command(argv: list[str], cwd: str, env: Mapping[str, str], sink: OutputSink,
                cancelled: threading.Event, kill_grace: float, run_as: dict | None = None) -> CommandOutcome:
    """Run ``argv`` to its end, or until ``cancelled`` is set, then make sure none of it is left.

    ``start_new_session`` puts the job in its own session and process group, so one signal to the
    group reaches every child it forked; processes that left the group are found through the
    process tree. ``run_as`` (``user``, ``group``, ``extra_groups``) switches the child to another
    user before it execs; the pipe and the signals stay the worker's, which is root then.
    """
    proc = subprocess.Popen(argv, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            **(run_as or {}))
    reader = threading.Thread(target=_pump, args=(proc, sink), name=f"pump-{proc.pid}", daemon=True)
    reader.start()
    was_cancelled = False
    while proc.poll() is None:
        if cancelled.wait(POLL_SECONDS):
            was_cancelled = True
            sink.line(f"[gpuq: stopping the job: SIGTERM, then SIGKILL after {kill_grace:g} s]")
            stop_tree(proc.pid, kill_grace)
            break
    # The job is over when its main process is: anything it left behind is stopped too (SLURM
    # does the same), or it would hold the GPU while gpuq hands it to the next job.
    stop_tree(proc.pid, 0 if not was_cancelled else kill_grace)
    code = proc.wait()
    reader.join(timeout=5)
    return CommandOutcome(exit_code=code, cancelled=was_cancelled)


def _pump(proc: subprocess.Popen, sink: OutputSink) -> None:
    assert proc.stdout is not None
    # Incremental decoding keeps a UTF-8 character split across two reads in one piece.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd = proc.stdout.fileno()
    while chunk := os.read(fd, 65536):
        sink.write(decoder.decode(chunk))
    sink.write(decoder.decode(b"", final=True))
    proc.stdout.close()


def job_processes(pid: int) -> list[psutil.Process]:
    """The job's processes: its process group (children that escaped the tree too) and its tree."""
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(pid)
        found[pid] = root
        for child in root.children(recursive=True):
            found[child.pid] = child
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and os.getpgid(p.pid) == pid:
                found.setdefault(p.pid, p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return list(found.values())


def stop_tree(pid: int, grace: float) -> None:
    """SIGTERM every process of the job, wait up to ``grace`` seconds, then SIGKILL the rest."""
    procs = job_processes(pid)
    if grace > 0:
        _signal(pid, procs, signal.SIGTERM)
        _, procs = psutil.wait_procs(procs, timeout=grace)
    if procs:
        _signal(pid, procs, signal.SIGKILL)
        psutil.wait_procs(procs, timeout=5)


def _signal(pgid: int, procs: list[psutil.Process], sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass
