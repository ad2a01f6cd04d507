"""A SLURM job script's ``#SBATCH`` lines, read as `gpuq submit` options: a lab's scripts run as
they are (`gpuq submit train.sbatch`); and sbatch's command line (``command_line``, for `gpuq
sbatch`, cli/sbatch.py), whose options are read as one more such line.

Each option sbatch and gpuq both have becomes gpuq's (``--job-name`` is ``--name``, ``--mem``, the
host memory of a node in SLURM, is ``--host-mem``, ``-c`` is ``--cpus``); options that mean nothing
here (a partition, an account, a QOS, one node) are read and left out, and the submit says which in
one line; one gpuq cannot honour (two nodes, a whole node, a feature constraint) or does not know
is refused in one line naming it, as a bad ``#GPUQ`` line is. Tasks on the node (``--ntasks``,
``--ntasks-per-node``) are the job's (``Lines``), and what is asked per task (``-c``,
``--gpus-per-task``) the job takes times its tasks. A script's ``#GPUQ`` lines go over its
``#SBATCH`` lines, and the command line over both (cli/script.py). What sbatch gives a batch script
by default, gpuq gives a SLURM script's job too (``sbatch_defaults``: its output in slurm-%j.out,
SLURM's names for its facts and tasks, all of its submitter's environment without ``--export``);
its ``srun`` is gpuq.cli.srun.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuq.service.errors import InvalidSpec

MARKER = "#SBATCH"

# sbatch's options that gpuq submit has too, by long name: (short letter or "", gpuq's option).
_SAME = {
    "job-name": ("J", "--name"), "time": ("t", "--time"), "gres": ("", "--gres"), "gpus": ("G", "--gpus"),
    "gpus-per-node": ("", "--gpus"), "gpus-per-task": ("", "--gpus"), "cpus-per-task": ("c", "--cpus"),
    "mem": ("", "--host-mem"), "output": ("o", "--output"), "error": ("e", "--error"), "array": ("a", "--array"),
    "mail-type": ("", "--mail-type"), "mail-user": ("", "--mail-user"), "dependency": ("d", "--dependency"),
    "begin": ("b", "--begin"), "deadline": ("", "--deadline"), "signal": ("", "--signal"),
    "exclude": ("x", "--exclude"), "nodelist": ("w", "--node"), "export": ("", "--env"),
}
# Flags, the same.
_FLAGS = {"requeue": ("", "--requeue"), "no-requeue": ("", "--no-requeue"), "hold": ("H", "--hold")}
# Options with no meaning for gpuq's one queue of GPUs: read, left out, and said so.
_LEFT_OUT = {"partition": "p", "account": "A", "qos": "q", "comment": "", "open-mode": "", "time-min": "",
             "nice": "", "reservation": "", "wckey": "", "get-user-env": "", "propagate": "", "hint": "",
             "distribution": "m", "gpu-bind": "", "gpu-freq": "", "mem-bind": "", "cpu-freq": "",
             "threads-per-core": "", "oversubscribe": "s", "kill-on-invalid-dep": "", "no-kill": "k",
             "profile": "", "acctg-freq": "", "licenses": "L", "cluster": "M", "clusters": "M"}
# Of those, the flags, and those whose value only follows an = (``--nice=10``).
_LEFT_OUT_FLAGS = {"oversubscribe", "no-kill", "get-user-env", "parsable", "quiet", "verbose", "nice"}
# A job runs on one node (refused past one), and its tasks there: as many as these say, which its
# srun starts (cli/srun.py).
_ONE = {"nodes": "N", "ntasks": "n", "ntasks-per-node": "", "tasks-per-node": ""}
# What gpuq cannot honour, and what to ask instead.
_REFUSED = {
    "exclusive": "gpuq does not hold a whole node; ask for its GPUs (--gpus) and cores (--cpus)",
    "constraint": "ask for a GPU model with --gres gpu:MODEL:N or --gpu-type",
    "mem-per-cpu": "give the job's host memory as --mem",
    "mem-per-gpu": "give the job's host memory as --mem",
    "chdir": "give -D on the command line",
    "wrap": "give --wrap on the command line",
    "wait": "give --wait on the command line",
    "test-only": "give --test-only on the command line",
    "uid": "submit as another user with --user, as root",
}
_SHORT = {short: name for table in (_SAME, _FLAGS) for name, (short, _) in table.items() if short}
_SHORT.update({short: name for table in (_LEFT_OUT, _ONE) for name, short in table.items() if short})
_SHORT.update(D="chdir", W="wait", C="constraint", Q="quiet", v="verbose")
# Of those refused, the flags: the others take a value, which a command line gives as a word of its own.
_REFUSED_FLAGS = {"exclusive", "wait", "test-only"}


@dataclass
class Lines:
    """What a script's ``#SBATCH`` lines say beyond `gpuq submit`'s options, read line by line
    (``translate``): whether one names ``--export``, its tasks on its node, and which of gpuq's
    options they gave per task (``cpus`` from ``-c``, ``gpus`` from ``--gpus-per-task``), which the
    job takes times its tasks (script_options)."""

    exported: bool = False
    tasks: int | None = None  # --ntasks, -n
    tasks_per_node: int | None = None  # --ntasks-per-node: the same on one node
    per_task: set[str] = field(default_factory=set)
    # Each task's GPUs where the job's are asked per task (--gpus-per-task) and it has several
    # tasks: its srun gives each task its own, as SLURM binds them (script_options sets it).
    gpus_per_task: int | None = None

    @property
    def task_count(self) -> int:
        return self.tasks or self.tasks_per_node or 1


def translate(words: list[str], seen: Lines | None = None) -> tuple[list[str], list[str]]:
    """`gpuq submit`'s words for one ``#SBATCH`` line's, and the options it left out, as written
    (``-p gpu``); what else it says, into ``seen``. InvalidSpec, in a line naming the option, for
    one gpuq cannot honour or does not know, or a word that is no option."""
    from gpuq.cli.slurm_options import Leading, Unreadable

    seen = Lines() if seen is None else seen
    out: list[str] = []
    left_out: list[str] = []
    options = Leading(words, _SHORT, _takes_value)  # an option gpuq does not know is refused below
    try:
        for name, value, shown in options:
            _one(name, value, shown, seen, out, left_out)
    except Unreadable as unread:
        raise InvalidSpec(f"{unread.shown} needs a value") from None
    stray = ["--"] if options.dashes else options.rest
    if stray:
        raise InvalidSpec(f"{stray[0][:80]!r}: an {MARKER} line takes sbatch's options only")
    return out, left_out


def _takes_value(name: str) -> bool:
    """Whether an ``#SBATCH`` line's option takes a value (one that is refused or unknown, none)."""
    return name in _SAME or name in _ONE or (name in _LEFT_OUT and name not in _LEFT_OUT_FLAGS)


def _one(name: str, value: str | None, shown: str, seen: Lines, out: list[str], left_out: list[str]) -> None:
    """One option of an ``#SBATCH`` line: gpuq's words for it onto ``out``, or onto ``left_out``
    as written; what else it says into ``seen``. InvalidSpec for one refused or unknown."""
    written = shown if value is None else f"{shown} {value}"
    if name in _REFUSED:
        raise InvalidSpec(f"{MARKER} {written[:80]}: {_REFUSED[name]}")
    if name in _FLAGS:
        out.append(_FLAGS[name][1])
    elif name in _LEFT_OUT or name in _LEFT_OUT_FLAGS:
        left_out.append(written)
    elif name == "nodes":
        assert value is not None
        if value.strip() not in ("1", "1-1"):
            raise InvalidSpec(f"{MARKER} {written[:80]}: a gpuq job runs on one node (its GPUs, cores and "
                              "tasks all there)")
    elif name in _ONE:
        assert value is not None
        count = value.strip()
        from gpuq.service.slurm_names import MAX_TASKS

        if not count.isdigit() or not 1 <= int(count) <= MAX_TASKS:
            raise InvalidSpec(f"{MARKER} {written[:80]}: a count of tasks on the job's one node, 1 to {MAX_TASKS}")
        if name == "ntasks":
            seen.tasks = int(count)
        else:
            seen.tasks_per_node = int(count)
    elif name == "export":
        assert value is not None
        seen.exported = True
        out.extend(_exports(value))
    elif name == "time" and value is not None and value.strip().upper() in ("UNLIMITED", "INFINITE"):
        left_out.append(written)  # no limit asked: the queue's default (GPUQ_DEFAULT_TIME), if any, holds
    elif name == "mail-type":
        assert value is not None
        kept, dropped = _mail_events(value)
        out += ["--mail-type", kept] if kept else []
        left_out += [f"{shown} {event}" for event in dropped]
    elif name == "mem":
        assert value is not None
        out += ["--host-mem", value.strip() + ("M" if value.strip().isdigit() else "")]  # sbatch's unit: MB
    elif name in _SAME:
        assert value is not None
        out += [_SAME[name][1], value]
        given = _SAME[name][1].lstrip("-")
        if given in ("cpus", "gpus", "gres"):  # per task where it says so; the job's own otherwise
            kind = "gpus" if given == "gres" else given
            (seen.per_task.add if name.endswith("-per-task") else seen.per_task.discard)(kind)
    else:
        raise InvalidSpec(f"{MARKER} {shown}: not an option gpuq takes (gpuq submit --help)")


# sbatch's options that only its command line gives, which gpuq submit has under the same names
# (sbatch's name: whether it takes a value).
COMMAND_LINE = {"chdir": True, "wrap": True, "wait": False, "test-only": False, "parsable": False}


@dataclass
class CommandLine:
    """sbatch's command line read (cli/sbatch.py): `gpuq submit`'s options for those only a command
    line gives (``--parsable``, ``-D DIR``...), ``--wrap``'s command, the other options' words as an
    ``#SBATCH`` line would give them, and the script with its arguments."""

    submit: list[str] = field(default_factory=list)
    wrap: str | None = None
    options: list[str] = field(default_factory=list)
    script: list[str] = field(default_factory=list)


_KNOWN = {*_SAME, *_FLAGS, *_LEFT_OUT, *_LEFT_OUT_FLAGS, *_ONE, *_REFUSED, *COMMAND_LINE}


def command_line(argv: list[str]) -> CommandLine:
    """``argv``, sbatch's arguments, read up to its script (the first word that is no option or
    an option's value). InvalidSpec for an option it does not know or one without its value."""
    from gpuq.cli.slurm_options import Leading, Unreadable

    def takes_value(name: str) -> bool | None:
        if name not in _KNOWN:
            return None
        return COMMAND_LINE[name] if name in COMMAND_LINE else (
            _takes_value(name) or (name in _REFUSED and name not in _REFUSED_FLAGS))

    options = Leading(argv, _SHORT, takes_value)
    try:
        found = list(options)
    except Unreadable as unread:
        raise InvalidSpec(f"{unread.shown} needs a value" if unread.needs_value
                          else f"{unread.shown}: not an option sbatch has (or none gpuq knows)") from None
    read = CommandLine(script=options.rest)
    for name, value, shown in found:
        if name == "wrap":
            read.wrap = value
        elif name in COMMAND_LINE:
            read.submit += [f"--{name}"] + ([] if value is None else [value])
        else:
            read.options += [shown] + ([] if value is None else [value])
    return read


def _exports(value: str) -> list[str]:
    """``--export``'s variables as ``--env`` words: ALL, all of yours gpuq passes on; NONE, gpuq's
    default set alone; NAME or NAME=VALUE, each as --env takes it, ALL among them too."""
    out: list[str] = []
    for item in value.split(","):
        item = item.strip()
        if item and item.upper() != "NONE":
            out += ["--env", "ALL" if item.upper() == "ALL" else item]
    return out


def _mail_events(value: str) -> tuple[str, list[str]]:
    """``--mail-type``'s events gpuq mails (BEGIN, END, FAIL, REQUEUE, ALL, NONE), and SLURM's others
    (TIME_LIMIT_80, ARRAY_TASKS, INVALID_DEPEND...), which gpuq sends no mail for."""
    from gpuq.service.units import MAIL_EVENTS

    events = [e.strip() for e in value.split(",") if e.strip()]
    known = {*MAIL_EVENTS, "ALL", "NONE"}
    return ",".join(e for e in events if e.upper() in known), [e for e in events if e.upper() not in known]


def sbatch_defaults(options: dict[str, Any], submit_dir: str, lines: Lines | None = None) -> None:
    """What sbatch gives a batch script that its lines and the command line did not ask otherwise,
    into ``options`` (`gpuq submit`'s): ``SLURM_SUBMIT_DIR``, which marks the job as a SLURM
    script's (its worker gives it SLURM's other names for its facts, service/slurm_names.py); its
    tasks where its ``lines`` ask for more than one, which its srun starts (cli/srun.py), and each
    one's GPUs where they were asked per task; and its output in ``slurm-%j.out``
    (``slurm-%A_%a.out`` for an array's tasks) in its directory."""
    from gpuq.service.slurm_names import GPUS_PER_TASK, MARK, TASKS, TASKS_PER_NODE

    options["env"] = [*options["env"], f"{MARK}={submit_dir}"]
    tasks = 1 if lines is None else lines.task_count
    if tasks > 1:
        options["env"] += [f"{TASKS}={tasks}", f"{TASKS_PER_NODE}={tasks}"]
    if tasks > 1 and lines is not None and lines.gpus_per_task:
        options["env"].append(f"{GPUS_PER_TASK}={lines.gpus_per_task}")
    if not options.get("output"):
        options["output"] = "slurm-%A_%a.out" if options.get("array") else "slurm-%j.out"
