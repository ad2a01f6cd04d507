"""A user's command run as a job: no shell, its own session and process group, output kept."""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import errno
import functools
import mmap
import os
import pwd
import queue
import signal
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO

from gpuq.service import constants as c
from gpuq.service import reach
from gpuq.service.launchable import interpreter_of
from gpuq.service.units import JobSignal
from gpuq.workers.cgroup import JobCgroup
from gpuq.workers.host_memory import HostMemory
from gpuq.workers.identity import Identity
from gpuq.workers.input_feed import Feed
from gpuq.workers.job_processes import (
    Finder,
    exited,
    registered,
    signal_all,
    signal_each_once,
    stop_tree,
    tree,
    verify_gone,
)
from gpuq.workers.output import OutputSink
from gpuq.workers.output_copy import Copy, OutputFiles, copies_of, open_in_child, receive
from gpuq.workers.owner_files import umask_of

# Seconds between looks at the child and at the cancel flag.
POLL_SECONDS = 0.05


@dataclass(frozen=True)
class CommandOutcome:
    exit_code: int | None
    cancelled: bool
    # Out of host memory: the kernel's OOM killer killed one of its processes (its memory cgroup
    # counted it), or, without a cgroup, the worker stopped it past its limit (``over_limit_mib``).
    oom_killed: bool = False
    # Without a memory cgroup: the MiB the job's processes held when the worker stopped them.
    over_limit_mib: int | None = None
    # Processes of the job still alive after everything was done to stop them (their pids).
    leftover: tuple[int, ...] = ()
    # The CPU seconds, user and system, of its main process and every process of it that was waited
    # for (the kernel's rusage of a reaped child: a process orphaned to init is not counted; sacct's
    # TotalCPU). Not its peak memory: a child forked from the worker carries the worker's resident
    # size into its ru_maxrss, so a small job's would read as the worker's.
    cpu_s: float | None = None
    # The most host memory its processes were seen to hold, MiB (workers/host_memory.py); None: none
    # seen (it ended before the first look).
    host_mem_peak_mib: int | None = None


class CannotStart(Exception):
    """The command could not be started (its file, interpreter or directory is gone, or it is not
    a program): ``why`` in a line, and the exit code a shell gives for it (127 not found, 126
    found but not run)."""

    def __init__(self, why: str, exit_code: int) -> None:
        super().__init__(why)
        self.why = why
        self.exit_code = exit_code


def _why_not_started(exc: OSError, program: str, cwd: str, run_as: Identity | None) -> tuple[str, int]:
    """What a failed exec means to the user, as a line, and the shell's exit code for it. Looked
    into as the job's owner (``reach.as_owner``): the worker may be root, and a script's #! line
    or a directory that the owner may not read is not read, nor named, for them."""
    with reach.as_owner(run_as.name) if run_as is not None else contextlib.nullcontext():
        if exc.filename == cwd or not reach.is_dir(cwd):
            return f"its directory {cwd} is gone (it was there at submit)", 126
        where = program if os.path.isabs(program) else os.path.join(cwd, program)
        if isinstance(exc, FileNotFoundError):
            interpreter = interpreter_of(where)
            if interpreter is not None and interpreter.endswith("\r"):
                # Windows line endings: the kernel looks for "/bin/sh\r", which "/bin/sh is not found"
                # hid, the one program every machine has.
                return (f"{program}: its #! line ends in a carriage return (Windows line endings), so the kernel "
                        f"looks for {interpreter!r}: convert it (dos2unix {program})"), 127
            if interpreter is not None:  # the kernel says ENOENT for a script whose #! names nothing
                return f"{program}: its interpreter {interpreter} is not found", 127
            return f"{program}: no such file or command (it was there at submit)", 127
    if exc.errno == errno.ENOEXEC:
        return f"{program}: not a program this machine runs (a script needs a #! line)", 126
    return f"{program}: {os.strerror(exc.errno) if exc.errno else exc}", 126


@dataclass
class Ahead:
    """`--signal`: ``signal`` to send the job once ``due`` is set (its watch sets it as the time
    limit nears), once for each deadline (``deadline``: as the limit now reads; one changed after
    the signal was sent asks for it again). Sent by the thread that runs the job, while its main
    process is unreaped, so its pid and group are still its own."""

    signal: JobSignal
    due: threading.Event
    deadline: Callable[[], float | None]
    sent_for: float | None = None  # the deadline it was sent before

    @property
    def wanted(self) -> bool:
        return self.due.is_set() and self.sent_for != self.deadline()

    def send(self, pid: int, found: Finder, sink: OutputSink) -> None:
        self.sent_for = self.deadline()
        send_signal(self.signal, pid, found, sink, f"{self.signal.before_s} s before its time limit (--signal)")


def send_signal(sig: JobSignal, pid: int, found: Finder, sink: OutputSink, why: str) -> None:
    """Send ``sig`` to the job whose main process is ``pid`` (unreaped): to that process alone
    (``B:``), else once to each of the job's processes; and say so, and ``why``, in its output."""
    if sig.main_only:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig.number)
    else:
        signal_each_once(pid, found(), sig.number)
    to = "its main process" if sig.main_only else "the job"
    sink.note(f"[gpuq: SIG{sig.name} sent to {to}, {why}]")


def send_asked(asked: queue.SimpleQueue[JobSignal], pid: int, found: Finder, sink: OutputSink) -> None:
    """Send the signals asked of the job since the last look (`gpuq cancel --signal`), in order."""
    while True:
        try:
            sig = asked.get_nowait()
        except queue.Empty:
            return
        send_signal(sig, pid, found, sink, "as asked (gpuq cancel --signal)")


def run_command(argv: list[str], cwd: str, env: Mapping[str, str], sink: OutputSink,
                cancelled: threading.Event, kill_grace: float | Callable[[], float],
                cgroup: JobCgroup | None = None,
                verify_within: float = c.STOP_VERIFY_SECONDS, run_as: Identity | None = None,
                on_start: Callable[[int], None] | None = None, limit_mib: int | None = None,
                files: OutputFiles | None = None, ahead: Ahead | None = None,
                asked: queue.SimpleQueue[JobSignal] | None = None, feed: Feed | None = None,
                cores: tuple[int, ...] = ()) -> CommandOutcome:
    """Run ``argv`` to its end, or until ``cancelled`` is set, then make sure none of it is left.

    ``start_new_session`` puts the job in its own session and process group, so one signal to the
    group reaches every child it forked. Processes that left both are found through its memory
    cgroup where there is one, else the process tree and the random ``GPUQ_RUN_ID`` each process
    of the job inherits in its environment. ``run_as`` switches the child to that user (after it
    joined the cgroup, which takes root); the pipe and the signals stay the worker's, root then.
    ``limit_mib`` (``--host-mem``) is the cgroup's to enforce; without a cgroup the worker holds the
    job to it by polling (workers/host_memory.py, which watches its peak either way). ``files``: the
    user's files its output is copied to as well, opened by the child as the user
    (workers/output_copy.py). ``ahead``: a signal to send it once its time limit nears
    (`--signal`); ``asked``: signals to send it as they come (`gpuq cancel --signal`).
    ``kill_grace``: seconds from SIGTERM to SIGKILL once ``cancelled`` is set, or what says them then
    (a preemption's grace is known only once the stop is asked). ``feed``: what writes its stdin
    (the input `gpuq run` forwards, workers/input_feed.py), in a thread; without one, /dev/null.
    ``cores``: the CPU cores it runs on (workers/core_binding.py); empty: those the worker may.
    """
    run_id = uuid.uuid4().hex
    oom_before = cgroup.oom_kills() if cgroup else 0
    # Shared with the child, which sets it once it joined the cgroup: then the cgroup alone finds
    # every process of the job (``Finder``), and the child may have ended before the worker looks.
    joined = mmap.mmap(-1, 1) if cgroup is not None else None
    pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) if files is not None else None
    try:
        # Popen enters ``cwd`` before it calls preexec_fn, as the worker (root): a command to run as
        # another user enters it in _in_child instead, as that user, or a user could run a job in a
        # directory only root may enter.
        opener = (files, pair[1].fileno(), run_as.name if run_as is not None else _own_name()) \
            if files is not None and pair is not None else None
        proc = subprocess.Popen(argv, cwd="/" if run_as is not None else cwd, env={**env, "GPUQ_RUN_ID": run_id},
                                stdin=subprocess.PIPE if feed is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, pass_fds=(pair[1].fileno(),) if pair is not None else (),
                                preexec_fn=functools.partial(_in_child, cgroup, run_as, cwd, umask_of(env), opener,
                                                             cores, joined))
    except OSError as exc:  # the child's chdir or exec failed: nothing of the job ran
        if pair is not None:
            pair[0].close()  # with the output files it may have sent before its exec failed
        raise CannotStart(*_why_not_started(exc, argv[0], cwd, run_as)) from None
    finally:
        if pair is not None:
            pair[1].close()
        contained = joined is not None and joined[0] == 1
        if joined is not None:
            joined.close()
    copies: tuple[Copy | None, Copy | None] = (None, None)
    if files is not None and pair is not None:
        with pair[0]:
            got = receive(pair[0], files)
        if isinstance(got, str):  # it could not open them: it exited, nothing ran
            proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            raise CannotStart(got, 126)
        copies = copies_of(got, files)
    over = threading.Event()
    if feed is not None and proc.stdin is not None:
        threading.Thread(target=feed, args=(proc.stdin, over), name=f"stdin-{proc.pid}", daemon=True).start()
    try:
        return _run(proc, Finder(proc.pid, cgroup, run_id, contained), sink, cancelled, kill_grace, cgroup,
                    verify_within, on_start, limit_mib, oom_before, copies, ahead, asked)
    finally:
        over.set()
        for copy in copies:
            if copy is not None:
                copy.close()


def _run(proc: subprocess.Popen[bytes], found: Finder, sink: OutputSink, cancelled: threading.Event,
         kill_grace: float | Callable[[], float], cgroup: JobCgroup | None, verify_within: float,
         on_start: Callable[[int], None] | None, limit_mib: int | None, oom_before: int,
         copies: tuple[Copy | None, Copy | None], ahead: Ahead | None = None,
         asked: queue.SimpleQueue[JobSignal] | None = None) -> CommandOutcome:
    """``run_command`` once its process started: watch it to its end and make sure none of it is left."""
    with registered(found):  # its share watch finds its every process meanwhile
        memory = HostMemory(cgroup, found, functools.partial(tree, proc.pid), limit_mib)
        if on_start is not None:
            on_start(proc.pid)
        assert proc.stdout is not None and proc.stderr is not None
        readers = [threading.Thread(target=_pump, args=(pipe, stream, sink, copy), name=f"pump-{proc.pid}-{stream}",
                                    daemon=True)
                   for pipe, stream, copy in ((proc.stdout, c.STDOUT, copies[0]), (proc.stderr, c.STDERR, copies[1]))]
        for reader in readers:
            reader.start()
        was_cancelled = False
        grace = 0.0
        over_limit: int | None = None
        # Its end is watched without reaping it (``exited``): until ``proc.wait`` below, its pid, which
        # is its process group's id too, stays its own, and no signal to the group can reach a
        # stranger's group that took the number over.
        while not exited(proc.pid):
            if cancelled.wait(POLL_SECONDS):
                was_cancelled = True
                grace = kill_grace() if callable(kill_grace) else kill_grace
                sink.note(f"[gpuq: stopping the job: SIGTERM, then SIGKILL after {grace:g} s]")
                stop_tree(proc.pid, grace, found)
                break
            if (held := memory.look()) is not None and over_limit is None:
                over_limit = held
                # As the OOM killer would: SIGKILL, no grace (a job past its memory has no time to
                # spare), and the job is host_oom. The loop goes on until the main process ends, and
                # its status, which ``proc.wait`` reads, is the SIGKILL.
                sink.note(f"[gpuq: the job's processes hold {over_limit} MiB of host memory, past its --host-mem "
                          f"of {limit_mib} MiB: stopped with SIGKILL]")
                signal_all(proc.pid, found(), signal.SIGKILL)
            if ahead is not None and ahead.wanted:
                ahead.send(proc.pid, found, sink)
            if asked is not None and not asked.empty():
                send_asked(asked, proc.pid, found, sink)
        # The job is over when its main process is: anything it left behind is stopped too (SLURM
        # does the same), or it would hold the GPU while gpuq hands it to the next job.
        stop_tree(proc.pid, grace, found)
        code, cpu_s = _reap(proc)  # from here on, nothing is sent to its process group
        for reader in readers:
            reader.join(timeout=5)
        leftover = verify_gone(found, verify_within, None, cgroup)
        oom = over_limit is not None or (cgroup is not None and cgroup.oom_kills() > oom_before)
        return CommandOutcome(exit_code=code, cancelled=was_cancelled, oom_killed=oom, over_limit_mib=over_limit,
                              leftover=tuple(leftover), cpu_s=cpu_s, host_mem_peak_mib=memory.peak_mib)


def _reap(proc: subprocess.Popen[bytes]) -> tuple[int, float | None]:
    """Reap the job's ended main process: its exit code as Popen gives it (-N for signal N), and the
    CPU seconds, user and system, the kernel counted of it and its waited-for descendants."""
    try:
        _, status, used = os.wait4(proc.pid, 0)
    except ChildProcessError:  # reaped already (it never is here): its code without its CPU time
        return proc.wait(), None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, used.ru_utime + used.ru_stime


_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _own_name() -> str:
    """This process's user's name (a worker of a user's own stack runs its jobs as itself)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return f"uid {os.getuid()}"


def _in_child(cgroup: JobCgroup | None, run_as: Identity | None = None, cwd: str | None = None,
              umask: int | None = None, opener: tuple[OutputFiles, int, str] | None = None,
              cores: tuple[int, ...] = (), joined: mmap.mmap | None = None) -> None:
    """Between fork and exec: join the job's cgroup (and say so in ``joined``), go onto its ``cores``
    (every process it starts inherits them), and die with the worker (SIGKILL when the
    worker's thread that started it ends), so a SIGKILLed worker leaves no job running; then
    become ``run_as``: its groups only, its gid, its uid, in that order (each needs root), and
    enter ``cwd`` as them. Only raw system calls here: another thread may have held a lock at the fork."""
    if cgroup is not None and cgroup.join() and joined is not None:
        joined[0] = 1
    if cores:
        os.sched_setaffinity(0, cores)
    if umask is not None:
        os.umask(umask)
    if run_as is not None:
        os.setgroups(list(run_as.groups))
        os.setgid(run_as.gid)
        os.setuid(run_as.uid)
        if cwd is not None:
            try:
                os.chdir(cwd)
            except OSError as exc:  # as a shell's cd: said on the job's stderr, 126, nothing ran
                os.write(2, (f"gpuq: cannot start the command: cannot enter its directory {cwd} as {run_as.name}: "
                             f"{os.strerror(exc.errno or 0)}\n").encode("utf-8", "replace"))
                os._exit(126)
    if opener is not None:  # as the user, in its directory: the kernel checks their rights on the path
        open_in_child(*opener)
    # Last: the kernel clears the parent-death signal when the credentials change.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _pump(pipe: IO[bytes], stream: int, sink: OutputSink, copy: Copy | None = None) -> None:
    """Copy one of the job's pipes (its stdout or its stderr) to ``sink`` until it closes, and to
    the user's file (``copy``) as it came."""
    # Incremental decoding keeps a UTF-8 character split across two reads in one piece.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd = pipe.fileno()
    while chunk := os.read(fd, 65536):
        if copy is not None and (failed := copy.write(chunk)) is not None:
            sink.note(failed)
        sink.write(decoder.decode(chunk), stream)
    sink.write(decoder.decode(b"", final=True), stream)
    pipe.close()
