"""`srun` inside a gpuq job from a SLURM script, or in a `gpuq alloc` shell: a step's command, run as
the job's tasks.

A batch script written for SLURM runs its work through srun (`srun python train.py`), which asks
slurmctld for a step of the job's allocation, and so does a user in salloc's shell. A gpuq job has
its GPUs, cores and memory already, on one node, so its worker puts this on the PATH of a SLURM
script's job, and `gpuq alloc` on its shell's (service/slurm_bin.py): srun's options for a step
inside the job (its cores, GPUs, binding, MPI) are read and let be, the step being the job itself;
``--chdir`` is honoured; more than one node is refused in one line.

A job of one task (the script's, or the shell's) runs the command in place of this process, so its
exit status is the script's to read, as srun's is. A job whose script asked for more
(``#SBATCH --ntasks-per-node=4``: ``SLURM_NTASKS`` in its environment, service/slurm_names.py) gets
them here, as srun starts a step's tasks on one node: the command once per task (``-n`` of them at
most), each with SLURM's variables for its place (``SLURM_PROCID``, ``SLURM_LOCALID``, ...), which
PyTorch Lightning and hand-written DDP scripts read for their ranks, and where the job's GPUs were
asked per task (``--gpus-per-task``: ``SLURM_GPUS_PER_TASK``) its own of them, as SLURM binds
them (``--gpu-bind=none``: all of the job's, as without); ``--label`` (``-l``) puts each
line of output after its task's number; this process waits for all of them and ends with the
highest exit status (128 + N for a task a signal N ended), passing on the signals it is sent (not
those gpuq's worker sends every process of the job, nor a terminal's, which reach each task already);
``--kill-on-bad-exit`` (``-K``) stops the others (SIGTERM) once one fails, and ends with its status.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    import threading
    from collections.abc import Mapping

# srun's options that take a value (long name: short letter, or ""), those of a step within the job.
_VALUES = {
    "nodes": "N", "ntasks": "n", "ntasks-per-node": "", "tasks-per-node": "", "chdir": "D",
    "cpus-per-task": "c", "gpus": "G", "gres": "", "gpus-per-task": "", "gpus-per-node": "", "cpus-per-gpu": "",
    "ntasks-per-gpu": "", "mem": "", "mem-per-cpu": "", "mem-per-gpu": "", "time": "t", "job-name": "J",
    "mpi": "", "cpu-bind": "", "mem-bind": "", "gpu-bind": "", "distribution": "m", "export": "", "partition": "p",
    "account": "A", "qos": "q", "nodelist": "w", "exclude": "x", "constraint": "C", "output": "o", "error": "e",
    "input": "i", "wait": "W", "relative": "r", "het-group": "", "jobid": "", "signal": "", "open-mode": "",
    "task-prolog": "", "task-epilog": "", "slurmd-debug": "", "cpu-freq": "", "hint": "", "threads-per-core": "",
}
# And its flags.
_FLAGS = {
    "label": "l", "unbuffered": "u", "pty": "", "overlap": "", "exact": "", "whole": "", "exclusive": "",
    "disable-status": "X", "quiet": "Q", "verbose": "v", "no-allocate": "Z", "kill-on-bad-exit": "K",
    "no-kill": "k", "oversubscribe": "s", "hold": "H",
}
_SHORT = {short: name for table in (_VALUES, _FLAGS) for name, short in table.items() if short}
# One node: the job's; and the step's tasks there.
_TASKS = {"ntasks", "ntasks-per-node", "tasks-per-node"}
# The signals passed on to a step's tasks (SIGKILL cannot be caught: the job's end stops them all).
_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT", "SIGALRM")
# Where its task's output would go instead of the job's: the job's own is kept, and this is said.
_REDIRECTS = {"output", "error", "input"}


class Refused(Exception):
    """A command line this srun cannot run, in the words to say it."""


@dataclass
class Step:
    """srun's command line read."""

    command: list[str]
    chdir: str | None = None  # --chdir; None: here
    said: list[str] = field(default_factory=list)  # options left out and said (a redirect of the output)
    tasks: int | None = None  # -n; None: the job's
    label: bool = False  # -l
    kill_on_bad_exit: bool = False  # -K
    gpus_per_task: int | None = None  # --gpus-per-task; None: the job's (SLURM_GPUS_PER_TASK)
    gpu_bind: str | None = None  # --gpu-bind: none lets each task see all of the job's GPUs


def command_of(argv: list[str]) -> Step:
    """srun's command line read. Refused for more than one node, a count of tasks that is none, an
    option srun does not have, or no command."""
    from gpuq.cli.slurm_options import Leading, Unreadable

    def takes_value(name: str) -> bool | None:
        return True if name in _VALUES else False if name in _FLAGS else None

    read = Leading(argv, _SHORT, takes_value)
    try:
        options = list(read)
    except Unreadable as unread:
        raise Refused(f"{unread.shown} needs a value" if unread.needs_value
                      else f"{unread.shown}: not an option srun has") from None
    step = Step(read.rest)
    for name, given, _ in options:
        if name == "label":
            step.label = True
        elif name == "kill-on-bad-exit":
            step.kill_on_bad_exit = given != "0"
        elif given is None or name in _FLAGS:
            continue
        elif name == "nodes" and given.strip() not in ("1", "1-1"):
            raise Refused(f"--nodes {given[:20]}: a gpuq job runs on one node, its tasks all there (its script's, or "
                          "an allocation's shell's)")
        elif name in _TASKS:
            step.tasks = _count(name, given, "tasks")
        elif name == "gpus-per-task":
            step.gpus_per_task = _count(name, given, "GPUs")
        elif name == "gpu-bind":
            step.gpu_bind = given
        elif name == "chdir":
            step.chdir = given
        elif name in _REDIRECTS:
            step.said.append(f"--{name} {given}")
    if not step.command:
        raise Refused("no command to run")
    return step


def _count(name: str, given: str, of: str) -> int:
    """An option's count, 1 or more; Refused naming the option for anything else."""
    if not given.strip().isdigit() or int(given) < 1:
        raise Refused(f"--{name} {given[:20]}: a count of {of}, 1 or more")
    return int(given)


def main(argv: list[str]) -> int:
    from gpuq.service.slurm_names import tasks_of

    try:
        step = command_of(argv)
        job_tasks = tasks_of(os.environ)
        tasks = job_tasks if step.tasks is None else step.tasks
        if tasks > job_tasks:
            raise Refused(f"--ntasks {tasks}: the job has {job_tasks} task{'' if job_tasks == 1 else 's'} (a "
                          "SLURM script asks for more with #SBATCH --ntasks-per-node=N; or start more processes "
                          "from one task: torchrun --nproc-per-node N, say)")
    except Refused as refused:
        print(f"gpuq srun: {refused}", file=sys.stderr)
        return 2
    if step.said:
        print(f"gpuq srun: left out (its output is the job's): {', '.join(step.said)}", file=sys.stderr)
    if job_tasks == 1 and not step.label:  # the job's one task: this process becomes it
        return _exec(step)
    # Its tasks (or its one, its lines labelled): SLURM's variables for each where the job has more
    # than one, none of them in a job of one, as there (module docstring).
    return _tasks(step, tasks, job_tasks > 1)


def _exec(step: Step) -> int:
    command, chdir = step.command, step.chdir
    try:
        if chdir is not None:
            os.chdir(chdir)
        os.execvp(command[0], command)
    except OSError as exc:
        return _not_started(step, exc)
    return 0  # not reached: exec replaced this process


def _not_started(step: Step, exc: OSError) -> int:
    """Says why ``step``'s command could not start, as a shell would; its exit status (127: no such
    command, 126: the command or its directory cannot be used)."""
    if isinstance(exc, FileNotFoundError) and (step.chdir is None or exc.filename != step.chdir):
        print(f"gpuq srun: {step.command[0]}: command not found", file=sys.stderr)
        return 127
    print(f"gpuq srun: {step.command[0] if step.chdir is None else step.chdir}: {exc.strerror}", file=sys.stderr)
    return 126


def task_env(environ: dict[str, str], rank: int, tasks: int, gpus: int | None = None) -> dict[str, str]:
    """A step's task's environment: SLURM's variables for its place among ``tasks`` on one node;
    with ``gpus``, its own that many of the job's GPUs (the rank-th of them), as SLURM binds a task
    to its GPUs where they were asked per task (``--gpus-per-task``, ``--gpu-bind=per_task``)."""
    env = dict(environ, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
               SLURM_NTASKS=str(tasks), SLURM_NPROCS=str(tasks), SLURM_STEP_NUM_TASKS=str(tasks),
               SLURM_STEP_NUM_NODES="1", SLURM_STEP_TASKS_PER_NODE=str(tasks), SLURM_NTASKS_PER_NODE=str(tasks),
               SLURM_TASKS_PER_NODE=str(tasks))
    devices = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if gpus and len(devices) >= gpus * tasks:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[rank * gpus:(rank + 1) * gpus])
    return env


def gpus_per_task(step: Step, environ: Mapping[str, str]) -> int | None:
    """The GPUs each of ``step``'s tasks is bound to: its --gpus-per-task, else the job's
    (SLURM_GPUS_PER_TASK); None (each sees all the job's) with --gpu-bind=none or neither."""
    from gpuq.service.slurm_names import GPUS_PER_TASK

    if step.gpu_bind is not None and step.gpu_bind.strip().lower().startswith("none"):
        return None
    if step.gpus_per_task is not None:
        return step.gpus_per_task
    value = environ.get(GPUS_PER_TASK, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def _tasks(step: Step, tasks: int, variables: bool = True) -> int:
    """Run ``step``'s command as ``tasks`` tasks (each given ``task_env``'s variables where
    ``variables``); the highest exit status among them."""
    import signal
    import subprocess
    import threading

    started: list[subprocess.Popen[bytes]] = []
    received: list[int] = []  # the signals passed on so far: a task started after one is sent it too
    running: set[int] = set()  # the tasks not reaped yet, whose pids are theirs still
    forwarded = {getattr(signal, name) for name in _FORWARDED}

    def forward(signum: int) -> None:
        received.append(signum)
        for pid in list(running):
            try:
                os.kill(pid, signum)
            except OSError:
                pass

    def passing_on() -> None:
        while True:
            info = signal.sigwaitinfo(forwarded)
            # One the kernel sent (a terminal's Ctrl-C, its hangup) went to the tasks too: they
            # share this process's group, as an allocation's shell's srun runs in the foreground.
            if info.si_pid != 0 and not _sent_by_gpuq(info.si_pid):
                forward(info.si_signo)

    # Taken by a thread of its own from before the first task starts, which knows who sent each.
    # The tasks start with none of them blocked.
    signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)
    threading.Thread(target=passing_on, daemon=True).start()
    pipe = subprocess.PIPE if step.label else None
    environ = dict(os.environ)
    gpus = gpus_per_task(step, environ)
    try:
        for rank in range(tasks):
            task = subprocess.Popen(step.command, cwd=step.chdir, stdout=pipe, stderr=pipe,
                                    env=task_env(environ, rank, tasks, gpus) if variables else environ,
                                    preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded))
            started.append(task)
            running.add(task.pid)
            for signum in list(received):
                os.kill(task.pid, signum)
    except OSError as exc:
        for task in started:
            task.kill()
            task.wait()
        return _not_started(step, exc)

    pumps: list[threading.Thread] = []
    if step.label:
        lock = threading.Lock()
        width = len(str(tasks - 1))
        for rank, task in enumerate(started):
            for source, sink in ((task.stdout, sys.stdout.buffer), (task.stderr, sys.stderr.buffer)):
                assert source is not None
                pump = threading.Thread(target=_labelled, args=(source, sink, f"{rank:>{width}}: ".encode(), lock),
                                        daemon=True)
                pump.start()
                pumps.append(pump)
    worst = 0
    first_bad = 0  # with -K: the status of the task that failed first, not of those stopped for it
    left: dict[int, subprocess.Popen[bytes]] = {task.pid: task for task in started}
    while left:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid not in left:
            continue
        running.discard(pid)
        task = left.pop(pid)
        task.returncode = os.waitstatus_to_exitcode(status)
        code = task.returncode if task.returncode >= 0 else 128 - task.returncode
        worst = max(worst, code)
        if code and step.kill_on_bad_exit and not first_bad:
            first_bad = code
            forward(signal.SIGTERM)
    for pump in pumps:
        pump.join(timeout=5)
    return first_bad or worst


def _sent_by_gpuq(pid: int) -> bool:
    """Whether the process ``pid`` that sent this srun a signal is gpuq's worker (or its guard):
    one it sent every process of the job (`gpuq cancel --signal`, a stop, --signal's warning),
    which reached each task already, so it is not passed on again. Any other sender's (the job's
    script, its user) is, as srun passes on a signal it is sent. Its command line tells (anyone
    may read it, a root worker's too); a sender gone already (a `/bin/kill`) was none of gpuq's."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read().split(b"\0")
    except OSError:
        return False
    # `python -m gpuq.workers ...` as `gpuq up` starts one, `gpuq worker` (compose), `-m gpuq.cli worker`.
    pairs = zip(words, words[1:], strict=False)
    return any(word.startswith(b"gpuq.workers") for word in words) or any(
        word == b"worker" and (before.endswith(b"gpuq") or before == b"gpuq.cli") for before, word in pairs)


def _labelled(source: IO[bytes], sink: IO[bytes], label: bytes, lock: threading.Lock) -> None:
    """Each line of ``source`` onto ``sink`` after ``label``, as srun --label writes a task's."""
    for line in source:
        with lock:
            sink.write(label + line if line.endswith(b"\n") else label + line + b"\n")
            sink.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
