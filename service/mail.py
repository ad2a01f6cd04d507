"""Mail about a job's start and end (`gpuq submit --mail-type END`), as SLURM's MailProg and
task-spooler's `ts -m` send it.

A job asks for events (``units.MAIL_EVENTS``: BEGIN, it started; END, it ended, however; FAIL, it
failed or ran out of time; REQUEUE, it went back to the queue, preempted, requeued or retried; ALL,
the four) and may name an address (`--mail-user`; else its owner, with
GPUQ_MAIL_DOMAIN added where set, as SLURM's MailDomain). Its ``job_mail`` row keeps what is still
due. The scheduler's mail thread (``send_due``, every MAIL_EVERY seconds) finds the jobs whose
events happened, marks them sent and then hands each message to GPUQ_MAIL_PROG (``mail -s
SUBJECT ADDRESS``, the body on its stdin): a message is sent at most once, and one the program
refuses is logged, not tried again (SLURM's too).

An array is one job to mail about, as SLURM mails about it unless asked for each task: BEGIN
when its first task starts, END (or FAIL) once all its tasks have ended, with how many ended each
way; a REQUEUE is about the task that went back.

A message says what `gpuq status` and `gpuq show` say to anyone (names, states, times, the node),
never a job's output: an address is the owner's to choose, and mail leaves the machine.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import read_scope, write_scope
from gpuq.service.display import array_name, duration, printable, state_counts, utc
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import EarlierAttempt, Job, JobMail, table
from gpuq.service.settings import Settings
from gpuq.service.units import BEGIN, END, FAIL, MAIL_EVENTS, REQUEUE

log = logging.getLogger("gpuq.mail")

# An end FAIL mails about: the job's own failure or its time limit (a cancel is its owner's doing).
FAILED = (State.FAILED, State.TIMED_OUT)
# How long the mail program may take to hand a message over.
SEND_TIMEOUT_S = 30.0


def check_can_mail(settings: Settings) -> None:
    """InvalidSpec where this machine's mail program cannot be run: a job asking for mail would
    never get any."""
    prog = settings.mail_prog
    if not (os.path.isabs(prog) and os.path.isfile(prog) and os.access(prog, os.X_OK)):
        raise InvalidSpec(f"--mail-type: gpuq sends no mail here (its mail program, GPUQ_MAIL_PROG={prog}, is not "
                          "there); ask the admins")


def address_of(owner: str, address: str | None, domain: str) -> str:
    """Where a job's mail goes: its `--mail-user`, else its owner; a bare name gets ``domain``."""
    to = address or owner
    return f"{to}@{domain}" if domain and "@" not in to else to


@dataclass(frozen=True)
class Message:
    to: str
    subject: str
    body: str


def ask(session: Session, jobs: Iterable[tuple[int, str | None, str | None]]) -> None:
    """Write the mail each job of a submission asks for: (job id, events, address), none where
    events is None."""
    rows = [{"job_id": job_id, "events": events, "address": address, "due": events, "reruns_mailed": 0}
            for job_id, events, address in jobs if events is not None]
    if rows:
        session.execute(table(JobMail).insert(), rows)


def asked(session: Session, job_id: int) -> tuple[str, str | None] | None:
    """The events and address a job asked mail for (`gpuq show`, a resubmit), or None."""
    row = session.execute(select(JobMail.events, JobMail.address).where(JobMail.job_id == job_id)).first()
    return None if row is None else (row.events, row.address)


# How many times each job ran again (its earlier attempts), read by their index on job_id.
_RERUNS = (select(func.count()).select_from(EarlierAttempt).where(EarlierAttempt.job_id == JobMail.job_id)
           .scalar_subquery())
_DUE = (select(JobMail.job_id, JobMail.due, JobMail.address, JobMail.reruns_mailed, _RERUNS.label("reruns"),
               Job.name, Job.user, Job.state, Job.reason, Job.node, Job.array_id, Job.array_index, Job.submitted_at,
               Job.started_at, Job.ended_at, Job.exit_code, Job.attempts)
        .join(Job, Job.id == JobMail.job_id).where(JobMail.due.is_not(None)))


def send_due(settings: Settings, send: Callable[[Settings, Message], None] | None = None) -> int:
    """Mail about every job whose asked-for events happened: marked sent first, then handed to
    ``send`` (the mail program by default); the number of messages."""
    with read_scope(settings) as session:
        rows = session.execute(_DUE).all()
        if not rows:
            return 0
        arrays = {r.array_id for r in rows if r.array_id is not None}
        counts: dict[Any, Counter[str]] = defaultdict(Counter)
        if arrays:
            for array_id, state, n in session.execute(select(Job.array_id, Job.state, func.count()).where(
                    Job.array_id.in_(arrays)).group_by(Job.array_id, Job.state)):
                counts[array_id][state] += n
    messages, left = due_messages(rows, counts, settings.mail_domain)
    if not left:
        return 0
    with write_scope(settings) as session:
        for job_id, (was, now, reruns) in left.items():
            # Only if no other mail thread (a second scheduler) sent it meanwhile.
            session.execute(update(JobMail).where(JobMail.job_id == job_id, JobMail.due == was)
                            .values(due=now, reruns_mailed=reruns))
    for message in messages:
        try:
            (send or run_mail_prog)(settings, message)
        except Exception:  # one message's trouble is no reason to lose the others
            log.exception("could not mail %s about %r", message.to, message.subject)
    return len(messages)


def due_messages(rows: Sequence[Any], counts: Mapping[Any, Counter[str]], domain: str
                 ) -> tuple[list[Message], dict[int, tuple[str, str | None, int]]]:
    """The messages ``rows`` (``_DUE``'s) call for, and each changed job's due events (before,
    after) and the reruns mailed about; ``counts``: each array's tasks by state."""
    messages: list[Message] = []
    left: dict[int, tuple[str, str | None, int]] = {}
    groups: dict[Any, list[Any]] = defaultdict(list)
    for r in rows:
        groups[("array", r.array_id) if r.array_id is not None else ("job", r.job_id)].append(r)
    for (kind, _), members in groups.items():
        first = min(members, key=lambda r: r.job_id)
        due = set(first.due.split(","))
        to = address_of(first.user, first.address, domain)
        # (A job requeued since it began has no start of its own, and began all the same.)
        if kind == "job":
            ended = first.state in c.END_STATES
            started = first.started_at is not None or first.reruns > 0
            failed = first.state in FAILED
        else:
            tasks = counts.get(first.array_id, Counter())  # its tasks by state
            ended = all(s in c.END_STATES for s in tasks)
            started = any(r.started_at is not None or r.reruns > 0 or r.state in c.END_STATES for r in members)
            failed = any(tasks[s] for s in FAILED)
        after = set(due)
        # Events that came between two looks are each mailed, in their order.
        if BEGIN in due and started:
            messages.append(_begin(first, members, kind, to))
            after.discard(BEGIN)
        requeued = [r for r in members if r.reruns > r.reruns_mailed] if REQUEUE in due else []
        messages += [_requeue(r, to) for r in requeued]
        if ended:
            if END in due or (FAIL in due and failed):
                messages.append(_end(first, members, kind, to, counts.get(first.array_id)))
            after = set()
        if after != due:
            now = ",".join(e for e in MAIL_EVENTS if e in after) or None
            left.update({r.job_id: (r.due, now, r.reruns) for r in members})
        else:
            left.update({r.job_id: (r.due, r.due, r.reruns) for r in requeued})
    return messages, left


def _what(first: Any, kind: str) -> str:
    if kind == "array":
        return f"gpuq array {first.array_id} ({printable(array_name(first.name))})"
    return f"gpuq job {first.job_id} ({printable(first.name)})"


def _begin(first: Any, members: list[Any], kind: str, to: str) -> Message:
    began = min((r for r in members if r.started_at is not None), key=lambda r: r.started_at, default=first)
    where = f" on {began.node}" if began.node else ""
    subject = f"{_what(first, kind)} began{where}"
    lines = [("user", first.user), ("submitted", _at(first.submitted_at)), ("started", _at(began.started_at))]
    if kind == "array":
        lines.insert(0, ("first task", f"{began.job_id} (task {began.array_index}){where}"))
    return Message(to, subject, _body(lines, first, kind))


def _requeue(r: Any, to: str) -> Message:
    """A job (an array's task: this one) went back to the queue: preempted, requeued, or retried."""
    last = (r.attempts or [{}])[-1]
    said = printable(str(last.get("reason") or last.get("state") or "requeued"))
    subject = f"gpuq job {r.job_id} ({printable(r.name)}) requeued: {said}"
    lines = [("user", r.user), ("attempt", f"{r.reruns} ended {last.get('state', '-')} at "
                                           f"{str(last.get('ended_at', '-'))[:19].replace('T', ' ')} UTC"),
             ("reason", said), ("now", "it waits to run again")]
    return Message(to, subject, _body(lines, r, "job"))


def _end(first: Any, members: list[Any], kind: str, to: str, counts: Counter[str] | None) -> Message:
    if kind == "array":
        assert counts is not None
        total = sum(counts.values())
        tally = state_counts({s.replace("_", " "): n for s, n in counts.items()})
        subject = f"{_what(first, kind)} ended: {total} task{'s' if total != 1 else ''}, {tally}"
        return Message(to, subject, _body([("user", first.user), ("tasks", tally)], first, kind))
    state = first.state.replace("_", " ")  # succeeded, failed, timed out, cancelled
    ran = (duration(first.ended_at - first.started_at)
           if first.started_at is not None and first.ended_at is not None else None)
    said = [*([f"exit code {first.exit_code}"] if first.state == State.FAILED and first.exit_code is not None else []),
            *([f"run time {ran}"] if ran else [])]
    subject = ", ".join([f"{_what(first, kind)} {state}", *said])
    lines = [("user", first.user), ("state", state + (f": {printable(first.reason)}" if first.reason else "")),
             ("node", first.node or "-"), ("submitted", _at(first.submitted_at)), ("started", _at(first.started_at)),
             ("ended", _at(first.ended_at)), ("run time", ran or "-")]
    return Message(to, subject, _body(lines, first, kind))


def _at(t: Any) -> str:
    return "-" if t is None else utc(t)


def _body(lines: list[tuple[str, str]], first: Any, kind: str) -> str:
    ident = str(first.array_id if kind == "array" else first.job_id)
    width = max(len(k) for k, _ in lines)
    text = "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)
    return f"{text}\n\n`gpuq show {ident}`, `gpuq logs {ident}` (as {first.user}) say more.\n"


def run_mail_prog(settings: Settings, message: Message) -> None:
    """Hand ``message`` to the mail program: ``PROG -s SUBJECT ADDRESS``, the body on its stdin
    (mailx's way, which SLURM's MailProg takes too)."""
    # The subject is one line whatever a job's name holds (``printable`` wrote its control
    # characters out); the address was checked at submit: it cannot be read as an option.
    done = subprocess.run([settings.mail_prog, "-s", message.subject, message.to], input=message.body, text=True,
                          capture_output=True, timeout=SEND_TIMEOUT_S, check=False,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"})
    if done.returncode != 0:
        log.error("%s could not mail %s about %r (exit %s): %s", settings.mail_prog, message.to, message.subject,
                  done.returncode, (done.stderr or done.stdout).strip()[-300:])
