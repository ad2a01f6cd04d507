"""`srun` inside a gpuq job from a SLURM script, or in a `gpuq alloc` shell: the command, run as the
job's one task.

A batch script written for SLURM runs its work through srun (`srun python train.py`), which asks
slurmctld for a step of the job's allocation, and so does a user in salloc's shell. A gpuq job has
its GPUs, cores and memory already and one task, the script (or the shell), so its worker puts this
on the PATH of a SLURM script's job, and `gpuq alloc` on its shell's (service/srun_shim.py): srun's
options for a step inside the job (its cores, GPUs, binding, MPI, labels) are read and let be, the
step being the job itself; ``--chdir`` is honoured; more than one node or task is refused in one
line, since nothing here would start them; then the command replaces this process, so its exit
status is the script's to read, as srun's is.
"""

from __future__ import annotations

import os
import sys

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
# One node, one task: the job's.
_ONE = {"nodes", "ntasks", "ntasks-per-node", "tasks-per-node"}
# Where its task's output would go instead of the job's: the job's own is kept, and this is said.
_REDIRECTS = {"output", "error", "input"}


class Refused(Exception):
    """A command line this srun cannot run, in the words to say it."""


def command_of(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """srun's command line read: the command, the directory to run it in (``--chdir``; None: here),
    and the options left out and said (a redirect of the task's output). Refused for more than one
    node or task, an option srun does not have, or no command."""
    chdir: str | None = None
    said: list[str] = []
    at = 0
    while at < len(argv) and argv[at].startswith("-") and argv[at] != "-":
        word = argv[at]
        at += 1
        if word == "--":
            break
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            given: str | None = value if eq else None
        else:
            name, given = _SHORT.get(word[1], ""), word[2:] or None
        if name in _FLAGS and name not in _VALUES:
            continue
        if name not in _VALUES:
            raise Refused(f"{word[:60]}: not an option srun has")
        if given is None:
            if at == len(argv):
                raise Refused(f"{word} needs a value")
            given, at = argv[at], at + 1
        if name in _ONE and given.strip() not in ("1", "1-1"):
            raise Refused(f"--{name} {given[:20]}: a gpuq job runs one task on one node (its script, or an "
                          "allocation's shell); start more processes from it yourself (torchrun --nproc-per-node N, "
                          "say)")
        if name == "chdir":
            chdir = given
        elif name in _REDIRECTS:
            said.append(f"--{name} {given}")
    if at == len(argv):
        raise Refused("no command to run")
    return argv[at:], chdir, said


def main(argv: list[str]) -> int:
    try:
        command, chdir, said = command_of(argv)
    except Refused as refused:
        print(f"gpuq srun: {refused}", file=sys.stderr)
        return 2
    if said:
        print(f"gpuq srun: left out (its output is the job's): {', '.join(said)}", file=sys.stderr)
    try:
        if chdir is not None:
            os.chdir(chdir)
        os.execvp(command[0], command)
    except FileNotFoundError:
        print(f"gpuq srun: {command[0]}: command not found", file=sys.stderr)
        return 127
    except OSError as exc:
        print(f"gpuq srun: {command[0] if chdir is None else chdir}: {exc.strerror}", file=sys.stderr)
        return 126
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
