"""The server's audit trail: who changed whose jobs, one line in the server's log for each request
that did (as slurmctld logs its RPCs with the caller's uid).

A change is logged at INFO once it is done, a change refused for want of rights or past a limit
(``GPUQ_MAX_PENDING_PER_USER``) at WARNING; the
logger is ``gpuq.audit``, so the lines read (after the log's time)::

    INFO gpuq.audit: cancel by alice (uid 1001): job 12
    INFO gpuq.audit: hold by root (uid 0) as admin: jobs 12-14 of alice; job 20 of bob
    INFO gpuq.audit: update by alice (uid 1001): jobs 12,15 (priority=5)
    INFO gpuq.audit: resubmit by alice (uid 1001): job 12 (as job 30)
    INFO gpuq.audit: submit by root (uid 0) on behalf of alice via --user: jobs 31-40 of alice
    WARNING gpuq.audit: refused cancel by bob (uid 1002): job 12 of alice (job 12 belongs to alice; ...)

Job ids are written as runs (``31-40``) and a job's owner is named where it is not the caller.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from aiohttp import web

from gpuq.server.copies import Copies
from gpuq.server.request import acting, call, reading
from gpuq.service import display, jobs
from gpuq.service.errors import NotAllowed, OverLimit
from gpuq.service.models import Job
from gpuq.service.rights import Caller, is_admin
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.audit")
T = TypeVar("T")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.$-]{1,64}")


async def audited(request: web.Request, action: str, fn: Callable[..., T], *args: Any, ids: Sequence[int] = (),
                  acted: Callable[[T], Iterable[int] | Mapping[int, str]] | None = None,
                  note: Callable[[T], str] | None = None, via_user: str | None = None,
                  copies: Copies | None = None) -> T:
    """``fn(*args)`` run as ``call`` runs it, for the request's caller, and logged: the ``action``
    done to the jobs ``acted`` picks from its result (``ids``, the jobs the request names, by
    default; a mapping gives each job's owner, else they are read where the caller may act on
    others' jobs), with ``note``'s words on the result; a NotAllowed it raises is logged with the
    other users' jobs among ``ids``. ``via_user`` is a submit's ``--user``; ``copies``, the pool a
    submit that copies a work tree runs in (server/copies.py) instead of the default one."""
    settings, caller = acting(request)
    behalf = via_user if via_user is not None and via_user != caller.user else None
    who = f"{caller.user} (uid {caller.uid})" + (f" on behalf of {_name(behalf)} via --user" if behalf else "")
    try:
        result = await (copies.run(fn, *args) if copies is not None else call(fn, *args))
    except (NotAllowed, OverLimit) as refused:  # no right to, or past a limit (a flood's pending cap)
        try:
            found = await call(_owners, settings, ids) if ids else {}
            others = {i: o for i, o in found.items() if o != caller.user}
            log.warning("refused %s by %s: %s (%s)", action, who, _jobs(others or found, caller) if found else "no job",
                        display.printable(str(refused)))
        except Exception:  # the refusal stands, line or not
            log.exception("refused %s by %s: its audit line could not be written", action, who)
        raise
    try:
        done = acted(result) if acted is not None else ids
        if isinstance(done, Mapping):
            owners = dict(done)
        elif behalf is None and not is_admin(settings, caller):
            # Only an admin may change another user's job: everything this caller changed is theirs.
            owners = dict.fromkeys(done, caller.user)
        else:
            owners = await call(_owners, settings, list(done))
        if owners:
            admin = behalf is None and any(o != caller.user for o in owners.values())
            log.info("%s by %s%s: %s%s", action, who, " as admin" if admin else "", _jobs(owners, caller),
                     f" ({note(result)})" if note is not None else "")
    except Exception:  # the change is made: a failure to write its line is no failure of the request
        log.exception("%s by %s: done, but its audit line could not be written", action, who)
    return result


def _owners(settings: Settings, ids: Sequence[int]) -> dict[int, str]:
    """Each job's owner, by id (a job that does not exist is left out)."""
    with reading(settings) as session:
        return {job_id: row.user for job_id, row in jobs.rows_of(session, ids, Job.user).items()}


def _jobs(owners: Mapping[int, str], caller: Caller) -> str:
    """``job 12; jobs 14-16 of alice``: the caller's own first, then each other owner's."""
    by_owner: dict[str, list[int]] = {}
    for job_id, owner in owners.items():
        by_owner.setdefault(owner, []).append(job_id)
    order = sorted(by_owner, key=lambda o: (o != caller.user, o))
    return "; ".join(("job " if len(by_owner[o]) == 1 else "jobs ")
                     + display.ranges(by_owner[o], most=len(by_owner[o]))
                     + ("" if o == caller.user else f" of {_name(o)}") for o in order)


def _name(user: str) -> str:
    """A user name as the log writes it: as it is, or quoted where it holds anything odd (a
    refused ``--user`` is whatever the request said)."""
    return user if _PLAIN_NAME.fullmatch(user) else repr(user)
