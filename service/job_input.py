"""A job's stdin, forwarded by the `gpuq run` that submitted it, as srun forwards its stdin to the
job's task 0: `seq 1000 | gpuq run -- python score.py`.

The client reads its stdin (a pipe or a file, never a terminal: an interactive program wants
``gpuq alloc``) and sends it in chunks to the server, which appends each to a Redis list of the
job's (``put``); the job's worker takes them in order (``take``) and writes them to the command's
stdin, which it closes once the client sent its end. Chunks wait in Redis while the job waits for
its GPUs; past MAX_QUEUED of them the server says "full" and the client sends again a little
later, so a fast producer is held to the job's pace, not to Redis's memory.

Only the job's owner (or root) may send it input: it is what their process reads. A job that ran
before (a retry, a requeue) reads what is left: the input is read once. The keys expire
TTL_S after the last chunk, so a client that died without ending its input leaves nothing for ever.
Its job does not wait on a read meanwhile: `gpuq run` keeps the job it follows (service/kept_jobs.py),
which ends once its client is gone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import select

from gpuq.service import broker
from gpuq.service import constants as c
from gpuq.service.db import read_scope
from gpuq.service.errors import InvalidSpec, JobNotFound, NotAllowed, StateConflict
from gpuq.service.models import Job
from gpuq.service.rights import Caller
from gpuq.service.settings import Settings

if TYPE_CHECKING:
    import redis

# Chunks a job's list holds before the server answers "full" (16 MiB of input at most, waiting).
MAX_QUEUED = 64
# The list and its end mark expire this long after the last chunk came (seconds).
TTL_S = 7 * 86400
# What ``take`` gives once the client's input has ended and every chunk was taken.
END = b""


def _keys(settings: Settings, job_id: int) -> tuple[str, str]:
    return f"{settings.key_prefix}:stdin:{job_id}", f"{settings.key_prefix}:stdin-end:{job_id}"


def _seq_key(settings: Settings, job_id: int) -> str:
    return f"{settings.key_prefix}:stdin-seq:{job_id}"


def put(conn: redis.Redis, settings: Settings, job_id: int, data: bytes, end: bool, seq: int | None = None) -> bool:
    """Append ``data`` to job ``job_id``'s input, then its end where ``end``; False (nothing
    appended) while MAX_QUEUED chunks wait already: send it again later.

    ``seq``: the chunk's place in the input (0, 1, ...), which makes sending it again safe: a
    chunk whose place was taken already is not appended again (True). `gpuq run` sends each chunk
    again after its server restarted, not knowing whether the one that died had appended it."""
    chunks, ended = _keys(settings, job_id)
    # One round trip for what decides: the last place taken, the list's length.
    look = conn.pipeline(transaction=False)
    look.get(_seq_key(settings, job_id))
    look.llen(chunks)
    last, queued = look.execute()
    if seq is not None and last is not None and int(last) >= seq:
        return True
    if data and queued >= MAX_QUEUED:
        return False
    pipe = conn.pipeline(transaction=True)
    if data:
        pipe.rpush(chunks, data)
    if end:
        # The mark a later attempt reads once the list is empty; the empty chunk wakes a take now.
        pipe.set(ended, b"1", ex=TTL_S)
        pipe.rpush(chunks, END)
    if seq is not None:
        pipe.set(_seq_key(settings, job_id), seq, ex=TTL_S)
    pipe.expire(chunks, TTL_S)
    pipe.execute()
    return True


def take(conn: redis.Redis, settings: Settings, job_id: int, timeout: float) -> bytes | None:
    """The next chunk of job ``job_id``'s input; END once it ended and nothing is left; None when
    nothing came within ``timeout`` seconds."""
    chunks, ended = _keys(settings, job_id)
    got = conn.blpop([chunks], timeout=timeout)
    if got is not None:
        chunk = got[1]  # bytes: gpuq's clients of the broker do not decode
        return chunk.encode() if isinstance(chunk, str) else bytes(chunk)
    # The end was taken by an earlier attempt (a retry reads what is left: nothing).
    return END if conn.exists(ended) and not conn.llen(chunks) else None


def accept(settings: Settings, job_id: int, caller: Caller, data: bytes, end: bool, seq: int | None = None) -> bool:
    """The server's part: ``put`` for the job's owner (or root), where the job asked for its input
    and has not ended. JobNotFound, NotAllowed (another user's job, even an admin's: it is what the
    owner's process reads), StateConflict (it reads no input, or ended: the client stops sending)."""
    if len(data) > c.STDIN_CHUNK:
        raise InvalidSpec(f"a chunk of input is at most {c.STDIN_CHUNK} bytes")
    with read_scope(settings) as session:
        # The three columns, not the row (its command, environment, ...): one read per chunk.
        row = session.execute(select(Job.user, Job.state, Job.stdin).where(Job.id == job_id)).first()
    if row is None:
        raise JobNotFound(f"no job {job_id}")
    owner, state, forwarded = row
    if not caller.is_root and caller.user != owner:
        raise NotAllowed(f"job {job_id} belongs to {owner}; only they may send it input")
    if not forwarded:
        raise StateConflict(f"job {job_id} reads no input (gpuq run forwards its stdin to the job it runs)")
    if state in c.END_STATES:
        raise StateConflict(f"job {job_id} {state}; it reads no more input")
    return put(broker.shared(settings), settings, job_id, data, end, seq)
