"""Jobs their client keeps: an allocation (`gpuq alloc`) and the job a `gpuq run` follows live only
while their client says it is alive, as SLURM ends a job whose srun or salloc stopped answering
(its InactiveLimit). The client says so every third of the ``alloc_keepalive`` setting; its word
is the job's ``keepalive_at``, which only a kept job has.

One not heard from within the setting (killed, its ssh dropped, its node down) is ended for good
as ``client_lost``: cancelled by the scheduler while it waits, stopped by its worker once it runs
(an allocation's worker, workers/allocation.py; a run's job's watch, workers/watch.py). A job
asked to survive its client is not kept: `gpuq submit`, `gpuq run --detach`; and a `gpuq run`
stopped by Ctrl-Z, which cannot speak while stopped, lets go of its job first (``let_go``): the
job goes on as if detached while it is stopped, and `fg` (or `bg`) keeps it again (``keep_again``).

A client speaks through the server, so a silence counts only while the server is up, and from its
start: the server says it is up in Redis several times a second (``beat``, with its start time), and
while that word is missing (a server killed, restarting, upgraded) no kept job is judged; once it
is back, each client has the whole setting again to be heard from. Workers read it
(``server_since``) only when a job's client looks silent, the scheduler once a whole pass.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import bindparam, case
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import require_schema, rows_changed, write_scope
from gpuq.service.errors import NotAllowed, StateConflict
from gpuq.service.jobs import get_job
from gpuq.service.lifecycle import Actor, move
from gpuq.service.models import Job, table, utcnow
from gpuq.service.rights import Caller, may_change
from gpuq.service.settings import Settings

if TYPE_CHECKING:
    import redis

_JOBS = table(Job)
_ID = _JOBS.c.id == bindparam("job_id")
_KEPT = _JOBS.c.keepalive_at.is_not(None)

KEEPALIVE = move("a kept job's client says it is alive", Actor.USER, c.ACTIVE_STATES, None, _ID, _KEPT,
                 keepalive_at=bindparam("now"))
ABANDON = move("cancel a waiting kept job whose client is gone", Actor.SCHEDULER, State.PENDING, State.CANCELLED,
               _KEPT, _JOBS.c.keepalive_at < bindparam("cutoff"), ended_at=bindparam("now"),
               failure=c.FAILURE_CLIENT_LOST,
               reason=case((_JOBS.c.kind == c.KIND_INTERACTIVE, "its client (gpuq alloc) stopped answering while it "
                                                                "waited"),
                           else_="its client (gpuq run) stopped answering while it waited"))
LET_GO = move("a gpuq run lets go of the job it kept", Actor.USER, c.ACTIVE_STATES, None, _ID, _KEPT,
              _JOBS.c.kind != c.KIND_INTERACTIVE, keepalive_at=None)
KEEP_AGAIN = move("a gpuq run resumed by fg keeps its job again", Actor.USER, c.ACTIVE_STATES, None, _ID,
                  _JOBS.c.kind != c.KIND_INTERACTIVE, _JOBS.c.array_id.is_(None), keepalive_at=bindparam("now"))

# How long the server's word that it is up lasts, seconds, at most: a server gone is noticed within
# it. A third of the keepalive setting where that is less, so that a client's last word (at most a
# third of the setting old) and the server's, which outlives it, together stay under the setting.
BEAT_TTL = 2.0


def client_of(kind: str) -> str:
    """The command that keeps a job of ``kind``."""
    return "gpuq alloc" if kind == c.KIND_INTERACTIVE else "gpuq run"


def beat_ttl(settings: Settings) -> float:
    return min(BEAT_TTL, settings.alloc_keepalive / 3)


def beat_every(settings: Settings) -> float:
    """How often the server says it is up: four times in its word's life."""
    return beat_ttl(settings) / 4


def _beat_key(settings: Settings) -> str:
    return f"{settings.key_prefix}:server-up"


def beat(conn: redis.Redis, settings: Settings, since: float | None) -> None:
    """The server's word that it is up, and has been since ``since`` (epoch seconds); None: it
    stops (a clean stop says so at once)."""
    if since is None:
        conn.delete(_beat_key(settings))
    else:
        conn.set(_beat_key(settings), repr(since), px=max(int(beat_ttl(settings) * 1000), 1))


def server_since(conn: redis.Redis, settings: Settings) -> datetime | None:
    """Since when the server is up, as its last word says; None while it is not (no word)."""
    said = conn.get(_beat_key(settings))
    if said is None:
        return None
    return datetime.fromtimestamp(float(said), tz=utcnow().tzinfo)


def _up_since(settings: Settings) -> datetime | None:
    """``server_since`` on this process's broker client; None too where Redis cannot be reached:
    nobody can tell then, so nobody is judged."""
    from gpuq.service import broker

    try:
        return server_since(broker.shared(settings), settings)
    except Exception:  # noqa: BLE001 - any failure of the broker's client reads as "cannot tell"
        return None


def _silent_since(settings: Settings, heard: datetime | None, now: datetime) -> bool:
    """Whether nothing was heard for longer than ``alloc_keepalive`` since ``heard`` (None: ever)."""
    return heard is None or (now - heard).total_seconds() > settings.alloc_keepalive


def lapsed(settings: Settings, keepalive_at: datetime | None, now: datetime | None = None) -> bool:
    """Whether a kept job's client, last heard from at ``keepalive_at`` (None: never), is gone:
    silent longer than ``alloc_keepalive`` while the server it speaks to was up (counted from the
    server's start, where that is later). Redis is asked only for a client that looks silent."""
    now = now or utcnow()
    if not _silent_since(settings, keepalive_at, now):
        return False
    since = _up_since(settings)
    return since is not None and _silent_since(settings, since if keepalive_at is None else max(keepalive_at, since),
                                               now)


def lost_reason(settings: Settings, kind: str) -> str:
    """A running kept job's reason once its client is gone and it was stopped."""
    return (f"its client ({client_of(kind)}) was not heard from for {settings.alloc_keepalive:g} s "
            "(GPUQ_ALLOC_KEEPALIVE); everything it started was stopped")


def abandon_waiting(session: Session, settings: Settings, now: datetime) -> int:
    """Cancel the waiting kept jobs whose client has not been heard from within alloc_keepalive
    while the server was up (the scheduler's pass); how many. Nothing while the server is not up,
    nor before it has been up that long."""
    cutoff = now - timedelta(seconds=settings.alloc_keepalive)
    since = _up_since(settings)
    if since is None or since > cutoff:
        return 0
    return rows_changed(session.execute(ABANDON, {"cutoff": cutoff, "now": now}))


def let_go(settings: Settings, job_id: int, caller: Caller) -> None:
    """The `gpuq run` that keeps job ``job_id`` lets go of it (stopped by Ctrl-Z): the job is kept
    no longer, and outlives its client as a detached one. Its owner's, and the admins'; an
    allocation cannot be let go (its shell is in its client's terminal), nor an ended job."""
    require_schema(settings)
    with write_scope(settings) as session:
        job = client_call(session, settings, job_id, caller)
        if job.kind == c.KIND_INTERACTIVE:
            raise StateConflict(f"allocation {job_id} lives only while its client does: its shell is there")
        if job.state in c.END_STATES:
            raise StateConflict(f"job {job_id} {job.state}; nothing keeps it")
        session.execute(LET_GO, {"job_id": job_id})  # a job nobody keeps: nothing to let go of


def keep_again(session: Session, job: Job, now: datetime) -> None:
    """The `gpuq run` that let go of ``job`` when Ctrl-Z stopped it is resumed (`fg`, `bg`) and
    keeps it again: from now on its silence ends the job, as before the stop. Not an ended job, nor
    an array's task (nobody keeps one); an allocation is kept from its start (this only says its
    client is alive). The caller has checked the rights (``client_call``): the client's keepalive,
    ``allocations.keep_alive`` with ``again``."""
    if job.state in c.END_STATES:
        raise StateConflict(f"job {job.id} {job.state}; nothing to keep")
    if job.array_id is not None:
        raise StateConflict(f"job {job.id} is a task of array {job.array_id}: an array is kept by nobody")
    session.execute(KEEPALIVE if job.kind == c.KIND_INTERACTIVE else KEEP_AGAIN, {"job_id": job.id, "now": now})


def client_call(session: Session, settings: Settings, job_id: int, caller: Caller) -> Job:
    """Job ``job_id``, for a call its client makes (keep it alive, let go of it, end it): its
    owner's, and the admins'; NotAllowed for anyone else."""
    job = get_job(session, job_id)
    if not may_change(settings, job.user, caller):
        raise NotAllowed(f"job {job_id} is {job.user}'s; only they or an admin may keep it alive or end it")
    return job
