"""Parsing the lab's ways of writing sizes, durations, index ranges and signals (`20G`, `2h`, `0-9:2%4`,
`USR1@120`)."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from gpuq.service.constants import MAX_CPUS, MIN_CPUS
from gpuq.service.errors import InvalidSpec

MAX_ARRAY_TASKS = 10_000  # one submission; a bigger sweep is a mistake more often than a plan
# Bounds that keep every number inside a 32-bit SQL integer and inside reason.
MAX_TIME_S = 366 * 86400  # --time: a year
MAX_MEM_MIB = 1 << 30  # --mem: 1 PiB per GPU, far above any GPU; the real bound is the largest GPU
MAX_INDEX = 1_000_000_000  # --array indices
MAX_JOB_ID = 2**31 - 1

# ASCII digits only: str.isdigit's others (٣, ³) read as numbers in a limit nobody typed.
_MEM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE | re.ASCII)
_MEM_SCALE = {"k": 1 / 1024, "": 1, "m": 1, "g": 1024, "t": 1024 * 1024}


def parse_mem(text: str, option: str = "--mem") -> int:
    """``20G`` / ``512M`` / ``20GiB`` / ``2048`` (MiB) as MiB."""
    m = _MEM.match(text)
    if not m:
        raise InvalidSpec(f"{option} takes a size like 20G or 512M; got {text!r}")
    value = float(m.group(1)) * _MEM_SCALE[m.group(2).lower()]
    if value > MAX_MEM_MIB:  # before int(): a 400-digit number is inf as a float
        what = "machine" if option == "--host-mem" else "GPU"
        raise InvalidSpec(f"{option} {text.strip()[:40]} is more than any {what} has")
    mib = int(value)
    if mib < 1:
        raise InvalidSpec(f"{option} must be at least 1M; got {text!r}")
    return mib


def parse_cpus(text: str) -> float:
    """``--cpus``: ``4``, ``0.5`` or ``2.25`` CPU cores (as docker --cpus), a float."""
    try:
        cpus = float(text.strip())
    except ValueError:
        cpus = float("nan")
    if not MIN_CPUS <= cpus <= MAX_CPUS:  # NaN and inf fail both
        raise InvalidSpec(f"--cpus takes a number of CPU cores from {MIN_CPUS:g} to {MAX_CPUS}, e.g. 4 or 0.5; "
                          f"got {text.strip()[:40]!r}")
    return round(cpus, 2)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE | re.ASCII)
_SECONDS = {"s": 1, "m": 60, "": 60, "h": 3600, "d": 86400}


# SLURM's forms (sbatch --time): minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds.
_SLURM_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$", re.ASCII)
TIME_FORMS = "2h, 30m, 90s, 1d, or as SLURM: minutes, M:SS, H:MM:SS, D-H, D-H:MM, D-H:MM:SS"


def parse_duration(text: str) -> int:
    """A time limit in seconds: ``90s``, ``30m``, ``2h``, ``1d``, or any of SLURM's forms (a bare
    number is minutes, ``1:00`` one minute, ``1:30:00`` an hour and a half, ``2-00:00:00`` two days)."""
    slurm = _SLURM_TIME.match(text.strip()) if text.strip().isascii() else None
    if slurm and ("-" in text or ":" in text):
        days, d_hours, d_minutes, d_seconds, first, second, third = slurm.groups()
        limits: list[int | None]
        if days is not None:
            parts = [int(d_hours), int(d_minutes or 0), int(d_seconds or 0)]
            seconds = int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
            limits = [24, 60, 60]
        elif third is not None:
            parts = [int(first), int(second), int(third)]
            seconds, limits = parts[0] * 3600 + parts[1] * 60 + parts[2], [None, 60, 60]
        else:
            parts = [int(first), int(second)]
            seconds, limits = parts[0] * 60 + parts[1], [None, 60]
        # 1:99:99 is a typo, not 2:40:39.
        if all(limit is None or part < limit for part, limit in zip(parts, limits, strict=True)) and seconds >= 1:
            return _check_time(seconds, text)
        raise InvalidSpec(f"--time takes {TIME_FORMS}; got {text!r}")
    m = _DURATION.match(text)
    if not m:
        raise InvalidSpec(f"--time takes {TIME_FORMS}; got {text!r}")
    value = float(m.group(1)) * _SECONDS[m.group(2).lower()]
    if value > MAX_TIME_S:
        raise InvalidSpec(f"--time {text.strip()[:40]} is more than {MAX_TIME_S // 86400} days")
    seconds = int(value)
    if seconds < 1:
        raise InvalidSpec(f"--time must be at least 1s; got {text!r}")
    return _check_time(seconds, text)


def _check_time(seconds: int, text: str) -> int:
    if seconds > MAX_TIME_S:
        raise InvalidSpec(f"--time {text.strip()[:40]} is more than {MAX_TIME_S // 86400} days")
    return seconds


_BEGIN_IN = re.compile(r"^(?:now\s*\+\s*)?(\d{1,9}(?:\.\d+)?)\s*([a-z]*)$", re.IGNORECASE | re.ASCII)
_BEGIN_UNITS = {"": 1, "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1, "m": 60, "min": 60, "mins": 60,
                "minute": 60, "minutes": 60, "h": 3600, "hour": 3600, "hours": 3600, "d": 86400, "day": 86400,
                "days": 86400}
_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$", re.ASCII)
BEGIN_FORMS = ("a time of day (16:00, or SLURM's midnight, noon, fika, teatime), a date and time "
               "(2026-12-24T09:00, today, tomorrow), or a wait (30m, 2h, now+1hour)")
# SLURM's words for times of day (sbatch --begin): each its next coming, as 16:00 is.
_BEGIN_CLOCK_WORDS = {"midnight": "00:00", "noon": "12:00", "fika": "15:00", "teatime": "16:00"}


def parse_begin(text: str, now: datetime, option: str = "--begin") -> datetime:
    """``--begin``'s value as the moment a job may start, in UTC (sbatch's --begin): ``now``, a
    wait (``90s``, ``30m``, ``2h``, ``1d``, ``now+1hour``; a bare number after ``now+`` is seconds,
    as SLURM reads it), a time of day (its next coming: ``16:00`` past four is tomorrow's), or an
    ISO date and time. ``now`` is the submitter's, with their time zone: a time without a zone is
    theirs. At most MAX_TIME_S ahead. ``option``: the one read (``--deadline`` takes the same forms)."""
    t = text.strip()
    if t.lower() in ("now", "today"):  # today: its midnight, past already, as SLURM reads it
        return now.astimezone(UTC)
    if t.lower() == "tomorrow":
        return (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0).astimezone(UTC)
    t = _BEGIN_CLOCK_WORDS.get(t.lower(), t)
    wait = _BEGIN_IN.match(t)
    if wait and (t.lower().startswith("now") or wait.group(2)):
        unit = _BEGIN_UNITS.get(wait.group(2).lower())
        if unit is None:
            raise InvalidSpec(f"{option} takes {BEGIN_FORMS}; got {text[:60]!r}")
        when = now + timedelta(seconds=min(float(wait.group(1)) * unit, MAX_TIME_S + 1))
    elif clock := _CLOCK.match(t):
        hour, minute, second = int(clock.group(1)), int(clock.group(2)), int(clock.group(3) or 0)
        if hour > 23 or minute > 59 or second > 59:
            raise InvalidSpec(f"{option} {t[:20]} is not a time of day")
        when = now.replace(hour=hour, minute=minute, second=second, microsecond=0)
        if when <= now:
            when += timedelta(days=1)
    else:
        try:
            when = datetime.fromisoformat(t)
        except ValueError:
            raise InvalidSpec(f"{option} takes {BEGIN_FORMS}; got {text[:60]!r}") from None
        if when.tzinfo is None:  # the submitter's local time, by their zone's rules on that date
            when = when.astimezone()
    if (when - now).total_seconds() > MAX_TIME_S:
        raise InvalidSpec(f"{option} {t[:40]} is more than {MAX_TIME_S // 86400} days ahead")
    return when.astimezone(UTC)


def begin_here(text: str, option: str = "--begin") -> str:
    """``--begin`` (or ``--deadline``) as a client reads it for the server: in this machine's clock and
    the user's zone (``parse_begin``), sent as the ISO moment the server takes (spec.begin_of)."""
    return parse_begin(text, datetime.now().astimezone(), option).isoformat()


def parse_array(text: str) -> tuple[list[int], int | None]:
    """``--array``'s value: its indices (``parse_indices``) and, after a ``%``, how many of its tasks
    may run at once (SLURM's ``0-99%4``), or None for no such limit."""
    indices, percent, limit = text.partition("%")
    if not percent:
        return parse_indices(text), None
    if not re.fullmatch(r"\s*\d{1,10}\s*", limit, re.ASCII) or not 1 <= int(limit) <= MAX_ARRAY_TASKS:
        raise InvalidSpec(f"--array's %N (tasks at once) takes a whole number from 1 to {MAX_ARRAY_TASKS:,}; "
                          f"got {text[:60]!r}")
    return parse_indices(indices), int(limit)


def parse_indices(text: str) -> list[int]:
    """``0-9``, ``0-9:2``, ``1,3,5`` or a mix, as sorted unique indices."""
    out: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d{1,10})\s*(?:-\s*(\d{1,10})\s*(?::\s*(\d{1,10})\s*)?)?", part, re.ASCII)
        if not m:
            raise InvalidSpec(f"--array takes ranges like 0-9, 0-9:2 or 1,3,5 (and %N: N at once); got {text!r}")
        start = int(m.group(1))
        stop = int(m.group(2)) if m.group(2) is not None else start
        step = int(m.group(3)) if m.group(3) is not None else 1
        if stop > MAX_INDEX:
            raise InvalidSpec(f"--array indices must be at most {MAX_INDEX}; got {text!r}")
        if stop < start or step < 1:
            raise InvalidSpec(f"--array range {part.strip()!r} is empty")
        if (stop - start) // step + 1 + len(out) > MAX_ARRAY_TASKS:
            raise InvalidSpec(f"--array {text} is more than {MAX_ARRAY_TASKS} tasks")
        out.update(range(start, stop + 1, step))
    return sorted(out)


def parse_job_ids(text: str, option: str) -> list[int]:
    """``12`` or ``12,13`` as job ids."""
    parts = text.split(",")
    # ASCII digits only: int() takes 2_0 (20, where SLURM means task 0 of array 2), and an empty
    # part (1,,2 or "") is a mistake to name.
    if not all(re.fullmatch(r"[0-9]+", p) for p in parts):
        raise InvalidSpec(f"{option} takes job ids like 12 or 12,13; got {text!r}")
    ids = [int(p) for p in parts]
    if not ids or any(not 1 <= i <= MAX_JOB_ID for i in ids):
        raise InvalidSpec(f"{option} takes job ids like 12 or 12,13; got {text!r}")
    return ids


# sbatch's dependency types gpuq has no counterpart for, and what each would ask.
_OTHER_DEPENDENCIES = {"afterburstbuffer": "after a burst buffer's stage-out"}
SINGLETON = "singleton"
# sbatch's kinds of dependency on jobs, as a job's ``after_kind`` holds them, and what each waits for
# every one of its jobs (an array's every task) to do, as `gpuq why` says it (after: or to end
# without starting; afternotok: to fail, be cancelled, time out...).
AFTER_OK, AFTER_ANY, AFTER_NOT_OK, AFTER_START = "afterok", "afterany", "afternotok", "after"
# sbatch's aftercorr: each task of an array waits for the task of its own index of the arrays named
# to succeed. A submit gives each task those tasks' own ids (``dependencies.corresponding``), each
# waited for alone (a first task's id is otherwise its whole array's).
AFTER_CORR = "aftercorr"
AFTER_KINDS = {AFTER_OK: "to succeed", AFTER_ANY: "to end", AFTER_NOT_OK: "to end other than succeeded",
               AFTER_START: "to start", AFTER_CORR: "to succeed"}
# The same, as `gpuq show` says it before the job ids ("after the success of job 5, 6").
AFTER_SHOWN = {AFTER_OK: "after the success of", AFTER_ANY: "after any end of", AFTER_NOT_OK: "after a failure of",
               AFTER_START: "after the start of", AFTER_CORR: "after the success of"}


@dataclass(frozen=True)
class Waits:
    """What a job waits for before it may start: jobs (``after``, each of them as ``kind`` says,
    one of ``AFTER_KINDS``) and, as sbatch's ``singleton``, every other job of its user and name
    that holds GPUs or waits ahead of it as a singleton too. ``Waits()``: nothing."""

    after: tuple[int, ...] = ()
    kind: str = AFTER_OK
    singleton: bool = False

    @property
    def text(self) -> str | None:
        """As sbatch's ``--dependency`` writes it (``afterok:5:6``, ``afterany:7,singleton``), or None."""
        parts = [f"{self.kind}:" + ":".join(map(str, self.after))] if self.after else []
        return ",".join(parts + [SINGLETON] * self.singleton) or None


def parse_dependency(text: str) -> Waits:
    """sbatch's ``--dependency`` (``-d``): ``afterok:12:13``, ``afterany:12,afterany:14``,
    ``afternotok:12``, ``after:12``, ``aftercorr:12`` (an array's, task by task), ``singleton`` or
    ``afterok:12,singleton``. gpuq waits for all of a job's dependencies, its jobs one way; anything
    else is refused with what gpuq has instead."""
    usage = (f"--dependency takes afterok:, afterany:, afternotok:, after: or aftercorr:ID[:ID...] and singleton "
             f"(as sbatch -d; or --after / --after-any ID,ID); got {text[:80]!r}")
    if "?" in text:
        raise InvalidSpec(f"--dependency: ? (any one of them) is not one gpuq has: a job waits for all of its "
                          f"dependencies; got {text[:80]!r}")
    kinds: set[str] = set()
    ids: list[int] = []
    singleton = False
    for part in text.split(","):
        kind, colon, rest = part.strip().partition(":")
        kind = kind.lower()
        if kind in _OTHER_DEPENDENCIES:
            raise InvalidSpec(f"--dependency {kind} ({_OTHER_DEPENDENCIES[kind]}) is not one gpuq has: afterok, "
                              "afterany, afternotok, after, aftercorr or singleton")
        if kind == SINGLETON and not colon:
            singleton = True
            continue
        if kind not in AFTER_KINDS or not colon:
            raise InvalidSpec(usage)
        for piece in rest.split(":"):
            if "+" in piece:
                raise InvalidSpec(f"--dependency: a delay (+MINUTES) is not one gpuq has: --begin starts a job "
                                  f"later; got {text[:80]!r}")
            if not re.fullmatch(r"[0-9]+", piece):
                raise InvalidSpec(usage)
            ids += parse_job_ids(piece, "--dependency")  # in its bounds
        kinds.add(kind)
    if len(kinds) > 1:
        raise InvalidSpec(f"--dependency: gpuq waits for all of a job's jobs one way ({', '.join(sorted(kinds))}: "
                          f"give one of them); got {text[:80]!r}")
    return Waits(tuple(dict.fromkeys(ids)), kinds.pop() if kinds else AFTER_OK, singleton)


def dependency_of(after: str | None, after_any: str | None, dependency: str | None, clears: bool = False
                  ) -> Waits | None:
    """What a job waits for, from ``--after ID,ID``, ``--after-any ID,ID`` or sbatch's
    ``--dependency`` (one of them), or None where none is given. With ``clears`` (`gpuq update`),
    ``--dependency none`` (or empty, as scontrol's ``Dependency=``) is ``Waits()``: nothing any more."""
    if after is not None and after_any is not None:
        raise InvalidSpec("give --after or --after-any, not both")
    ids = after if after is not None else after_any  # "" is a mistake, not none
    if dependency is not None:
        if ids is not None:
            raise InvalidSpec("give --dependency or --after / --after-any, not both")
        if clears and dependency.strip().lower() in ("", "none"):
            return Waits()
        return parse_dependency(dependency)
    if ids is None:
        return None
    return Waits(tuple(parse_job_ids(ids, "--after" if after is not None else "--after-any")),
                 AFTER_OK if after is not None else AFTER_ANY)


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """``lr=0.1,0.01`` as (``lr``, [``0.1``, ``0.01``])."""
    name, eq, values = text.partition("=")
    name = name.strip().lstrip("-")
    items = [v.strip() for v in values.split(",")]
    if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", name) or not all(items):
        # An empty value (lr=1,,2) is a typo to name, not one value fewer.
        raise InvalidSpec(f"--sweep takes name=value,value; got {text[:200]!r}")
    if any(not ch.isprintable() for v in items for ch in v):  # it goes into the tasks' names
        raise InvalidSpec(f"--sweep {name}: a value holds a control character; got {text[:200]!r}")
    twice = next((v for i, v in enumerate(items) if v in items[:i]), None)
    if twice is not None:
        # Two tasks of one name doing the same work: a typo (lr=0.1,0.1 for 0.1,0.01). Repeats of
        # one setting (seeds) are an --array.
        raise InvalidSpec(f"--sweep {name}: {twice[:100]} is given twice; got {text[:200]!r}")
    return name, items


MAX_SIGNAL_BEFORE_S = 65535  # sbatch's bound on --signal's @TIME
_SIGNAL = re.compile(r"^(?:([A-Za-z]):)?([A-Za-z0-9]+)(?:@([0-9]+))?$", re.ASCII)


@dataclass(frozen=True)
class JobSignal:
    """`--signal [B:]SIG[@TIME]` (sbatch's): signal ``name`` (USR1, not SIGUSR1) sent to the job
    ``before_s`` seconds before its time limit ends it, so that it can save a checkpoint; to its
    main process alone (``B:``, sbatch's batch shell), else to all of its processes."""

    name: str
    before_s: int = 60  # sbatch's default
    main_only: bool = False

    @property
    def number(self) -> signal.Signals:
        return signal.Signals["SIG" + self.name]

    @property
    def text(self) -> str:
        """As stored, and as `gpuq show` prints it: ``B:USR1@120``."""
        return f"{'B:' if self.main_only else ''}{self.name}@{self.before_s}"

    @classmethod
    def parse(cls, text: str) -> JobSignal:
        found = _SIGNAL.match(text.strip())
        usage = "--signal takes [B:]SIGNAL[@SECONDS], e.g. USR1@120 (SIGUSR1 two minutes before the time limit)"
        if found is None:
            raise InvalidSpec(f"{usage}; got {text[:60]!r}")
        where, which, before = found.groups()
        number = _signal_number(where, which, text)
        if number in (signal.SIGKILL, signal.SIGSTOP):
            # The time limit's own end is SIGTERM then SIGKILL; a job told SIGKILL early could save nothing.
            raise InvalidSpec(f"--signal {number.name} cannot be caught: give one the job can act on, e.g. USR1")
        seconds = int(before) if before is not None else cls.before_s
        if not 0 <= seconds <= MAX_SIGNAL_BEFORE_S:
            raise InvalidSpec(f"--signal: @{before} is more than {MAX_SIGNAL_BEFORE_S} seconds")
        return cls(number.name.removeprefix("SIG"), seconds, where is not None)

    @classmethod
    def parse_now(cls, text: str) -> JobSignal:
        """`gpuq cancel --signal [B:]SIG` (scancel's): a signal sent to a running job now, so no
        @TIME. Any signal, as scancel's: KILL ends the job as killed, STOP pauses it (on its GPU)."""
        found = _SIGNAL.match(text.strip())
        if found is None or found.group(3) is not None:
            raise InvalidSpec(f"--signal takes [B:]SIGNAL, e.g. USR1 or B:INT (sent now: no @TIME); got {text[:60]!r}")
        where, which, _ = found.groups()
        return cls(_signal_number(where, which, text).name.removeprefix("SIG"), 0, where is not None)

    @property
    def asked_text(self) -> str:
        """As stored for `gpuq cancel --signal`: ``B:USR1`` or ``USR1``."""
        return f"{'B:' if self.main_only else ''}{self.name}"


def _signal_number(where: str | None, which: str, text: str) -> signal.Signals:
    """The signal of --signal's ``[where:]which`` (``text``, for the error); InvalidSpec if ``where`` is
    not B or ``which`` names no signal here."""
    if where is not None and where.upper() != "B":
        raise InvalidSpec(f"--signal: {where}: is not B: (only the job's main process); got {text[:60]!r}")
    try:
        return signal.Signals(int(which)) if which.isdigit() else \
            signal.Signals["SIG" + which.upper().removeprefix("SIG")]
    except (KeyError, ValueError):
        raise InvalidSpec(f"--signal: {which} is no signal here (USR1, USR2, TERM, INT, HUP, or its number); "
                          f"got {text[:60]!r}") from None


# Job mail (`--mail-type`, service/mail.py): it started, it ended (however), it failed or ran out of
# time, it went back to the queue (preempted, requeued, retried).
BEGIN, END, FAIL, REQUEUE = "BEGIN", "END", "FAIL", "REQUEUE"
MAIL_EVENTS = (BEGIN, END, FAIL, REQUEUE)
# A mail address as `--mail-user` takes it: a user name, or local@domain; never an option (-...).
_ADDRESS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._%+-]*(@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*)?", re.ASCII)
MAX_ADDRESS = 254


def parse_mail_events(text: str) -> str | None:
    """`--mail-type`'s comma-separated events as stored ("BEGIN,END", in ``MAIL_EVENTS``' order);
    None for NONE; InvalidSpec naming what it takes. ALL is the four."""
    words = {w.strip().upper() for w in text.split(",") if w.strip()}
    if words == {"NONE"}:
        return None
    if "ALL" in words:
        words = (words - {"ALL"}) | set(MAIL_EVENTS)
    if not words or not words <= set(MAIL_EVENTS):
        raise InvalidSpec(f"--mail-type takes BEGIN, END, FAIL, REQUEUE, ALL or NONE, comma-separated; got "
                          f"{text[:40]!r}")
    return ",".join(e for e in MAIL_EVENTS if e in words)


def parse_mail_address(text: str) -> str:
    """`--mail-user`: a user name or local@domain; InvalidSpec otherwise."""
    address = text.strip()
    if len(address) > MAX_ADDRESS or not _ADDRESS.fullmatch(address):
        raise InvalidSpec(f"--mail-user takes a user name or an address (name@host); got {text[:60]!r}")
    return address
