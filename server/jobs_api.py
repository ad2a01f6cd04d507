"""The API's reads of jobs: the queue, their states, the history, one job, its recorded diff, its
output (and the wait for more) and why it waits. The moves on jobs are in server/moves_api.py.

Rights are checked here, with service/rights.py, before anything private leaves the server."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from sqlalchemy import select

from gpuq.server import views
from gpuq.server.request import JOB, acting, call, context, job_id_of, job_ids, reading
from gpuq.service import (
    bound_cores,
    display,
    inventory,
    job_output,
    jobs,
    kept_jobs,
    mail,
    policy,
    rights,
    units,
    usage,
)
from gpuq.service import constants as c
from gpuq.service import history as history_of
from gpuq.service.accounting import parse_when
from gpuq.service.constants import State
from gpuq.service.errors import InvalidSpec, NotAllowed
from gpuq.service.models import Job, utcnow
from gpuq.service.rights import Caller
from gpuq.service.settings import Settings
from gpuq.service.units import MAX_JOB_ID

routes = web.RouteTableDef()
T = TypeVar("T")
P = c.API_PREFIX


def _int(request: web.Request, name: str, default: int) -> int:
    return _number(request, name, default, int, "a whole number")


def _float(request: web.Request, name: str, default: float) -> float:
    return _number(request, name, default, float, "a number of seconds")


def _number(request: web.Request, name: str, default: T, kind: Callable[[str], T], what: str) -> T:
    """Query parameter ``name`` as ``kind``, or ``default`` when absent; InvalidSpec if malformed."""
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise InvalidSpec(f"{name} must be {what}, got {raw[:40]!r}") from None


@routes.get(P + "/jobs")
async def queue(request: web.Request) -> web.Response:
    """The queue as `gpuq status` shows it: active jobs, the newest ended ones, the GPUs."""
    settings, _ = context(request)
    ended = min(_int(request, "ended", 10), history_of.MAX_LISTED)
    user, named = _whose(request)
    # arrays=collapsed: an array's pending tasks come as entries of "arrays", one for each reason
    # they wait, not as thousands of jobs (`gpuq status` and the dashboard ask for it).
    collapsed = request.query.get("arrays") == "collapsed"
    # ``state`` and ``name``: those jobs only (`gpuq status -t running --name 'train*'`, squeue's -t, -n).
    state, name = request.query.get("state"), request.query.get("name")
    states = jobs.states_named(state) if state is not None else None
    if name is not None and not name.strip():
        raise InvalidSpec("--name needs a name or a pattern")
    # ``jobs``: those jobs and the arrays among them, whatever their state (`gpuq status -j`, squeue's -j).
    ids = units.parse_job_ids(request.query["jobs"], "--jobs") if "jobs" in request.query else None
    return web.json_response(await call(_queue, settings, user, max(ended, 0), collapsed, named, states, name, ids))


def _whose(request: web.Request) -> tuple[str | None, bool]:
    """Whose jobs a listing asks for: the caller's own (``mine``), one user's (``user``: `gpuq status
    -u`, squeue -u, which everyone may see), or everyone's (None); and whether a user was named."""
    named = request.query.get("user")
    if named is not None and not named.strip():
        raise InvalidSpec("--user needs a user name")
    return (acting(request)[1].user if request.query.get("mine") in ("1", "true") else named), named is not None


def _queue(settings: Settings, user: str | None, ended: int, collapsed: bool = False,
           named: bool = False, states: tuple[str, ...] | None = None, name: str | None = None,
           ids: list[int] | None = None) -> dict[str, Any]:
    now = utcnow()
    with reading(settings) as session:
        if named and user is not None:
            _check_known_user(session, user)  # as squeue's "Invalid user"
        if ids is not None and session.scalar(select(Job.id).where(Job.id.in_(ids)).limit(1)) is None:
            # As squeue's "Invalid job id specified": none of them was ever a job (gpuq forgets none).
            raise jobs.JobNotFound(f"no job {', '.join(map(str, ids[:10]))}" + (" ..." if len(ids) > 10 else ""))
        rows = jobs.list_jobs(session, ended_limit=ended, user=user, but_pending_tasks=collapsed, states=states,
                              name=name, ids=ids)
        want_tasks = collapsed and (states is None or State.PENDING in states)
        tasks = jobs.pending_tasks(session, user=user, name=name, ids=ids) if want_tasks else []
        gpus = inventory.view(session, settings)
        idle = usage.idle_jobs(session, settings)
        held = jobs.gpu_indices_of(session, [j.id for j in rows if j.started_at is not None])
        listed = [views.job(j, held.get(j.id)) | {"elapsed_s": _secs(jobs.elapsed(j, now)), "idle": j.id in idle}
                  for j in rows]
    answer = {"jobs": listed, "gpus": [views.plain(g.__dict__) for g in gpus], "idle_window_s": settings.idle_window,
              "idle_limit_s": settings.idle_limit_s or None,
              "idle_limit_exempt": sorted(settings.idle_exempt_users) if settings.idle_limit_s else []}
    if collapsed:
        answer["arrays"] = [views.pending_tasks(g) for g in tasks]
    return answer


def _check_known_user(session: Any, user: str) -> None:
    """InvalidSpec for a ``--user`` with no account here and no job: a mistyped name is said, not
    answered with an empty list."""
    if not _known_user(session, user):
        raise InvalidSpec(f"--user {display.printable(user[:100])}: no such user here, and no job of theirs")


def _known_user(session: Any, user: str) -> bool:
    """Whether ``user`` has an account on the server's node or a job in the queue (one of another
    node's users)."""
    import pwd

    try:
        pwd.getpwnam(user)
        return True
    except ValueError:  # a NUL in it: no account, and no text a database takes (was a 500)
        return False
    except KeyError:
        return session.scalar(select(Job.id).where(Job.user == user).limit(1)) is not None


def _secs(d: Any) -> float | None:
    return None if d is None else round(d.total_seconds(), 3)


@routes.get(P + "/jobs/states")
async def states(request: web.Request) -> web.Response:
    """Each job's state (for `gpuq wait`); a missing job is an error, as `gpuq wait 99` is."""
    settings, _ = context(request)
    ids = job_ids(request.query.get("ids", ""))
    found = await call(_states, settings, ids)
    return web.json_response({"states": {str(k): v for k, v in found.items()}})


def _states(settings: Settings, ids: list[int]) -> dict[int, str]:
    with reading(settings) as session:
        found = jobs.wait_states(session, ids)
    for job_id in ids:
        if job_id not in found:
            raise jobs.JobNotFound(f"no job {job_id}")
    return found


@routes.get(P + "/jobs/start")
async def starts(request: web.Request) -> web.Response:
    """Each pending job's expected start (`gpuq status --start`, squeue --start), earliest first;
    ``mine`` or ``user``: theirs only."""
    settings, _ = context(request)
    return web.json_response(await call(_starts, settings, *_whose(request)))


def _starts(settings: Settings, user: str | None, named: bool) -> dict[str, Any]:
    from gpuq.service.explain import expected_starts

    with reading(settings) as session:
        if named and user is not None:
            _check_known_user(session, user)
        planned: dict[int, str] = {}
        starts = expected_starts(session, settings, planned)
        query = select(Job.id, Job.name, Job.user, Job.gpus, Job.gpu_type, Job.on_node, Job.reason,
                       Job.held).where(Job.state == State.PENDING)
        rows = session.execute(query.where(Job.user == user) if user is not None else query).all()
    # Earliest first, unknown starts last, as squeue lists them.
    earliest = sorted(rows, key=lambda r: (starts.get(r.id) is None, starts.get(r.id) or 0, r.id))
    listed = [{"id": r.id, "name": r.name, "user": r.user, "gpus": r.gpus, "gpu_type": r.gpu_type,
               "node": r.on_node, "reason": r.reason or ("held" if r.held else None),
               "start": views.iso(starts.get(r.id)), "planned_node": planned.get(r.id)} for r in earliest]
    return {"jobs": listed}


@routes.get(P + "/jobs/history")
async def history(request: web.Request) -> web.Response:
    """Ended jobs over a period (`gpuq history`, as sacct): ``since`` and ``until`` (a date, a time,
    an age such as 12h, or now), ``mine=1`` or ``user``, ``state`` (end states, comma-separated),
    ``name`` (a name or a pattern with * and ?), ``array`` and ``limit``; newest end first, with
    how many jobs of each state the whole period holds. What everyone may see, no output."""
    settings, caller = context(request)
    q = request.query
    now = utcnow()
    states = tuple(s.strip() for s in q["state"].split(",") if s.strip()) if "state" in q else c.END_STATES
    if "user" in q and not q["user"].strip():
        raise InvalidSpec("user: give a user name (or neither user nor mine for everyone's jobs)")
    query = history_of.HistoryQuery(
        since=parse_when(q.get("since", "1d"), "--since", now), until=parse_when(q.get("until", "now"), "--until", now),
        user=acting(request)[1].user if q.get("mine") in ("1", "true") else q.get("user") or None, states=states,
        name=q.get("name") or None, array_id=_int(request, "array", 0) or None, limit=_int(request, "limit", 100))
    return web.json_response(await call(_history, settings, query))


def _history(settings: Settings, query: history_of.HistoryQuery) -> dict[str, Any]:
    with reading(settings) as session:
        if query.user is not None:
            _check_known_user(session, query.user)  # as sacct's "Invalid user id"
        found = history_of.ended_jobs(session, query)
        # Each one's usage summary, as `gpuq stats ID` gives it to anyone (None: it has none), and the
        # GPUs it ran on, which the summary keeps.
        used = usage.summaries(session, [j.id for j in found.jobs if j.started_at is not None])
        # How long each waited and ran, worked out here once for every front-end ("-" where it never started).
        listed = [views.job(j, _ran_on(used.get(j.id))) | {
            "elapsed_s": _secs(jobs.elapsed(j)),
            "waited_s": _secs(j.started_at - j.submitted_at) if j.started_at else None,
            "usage": None if j.id not in used else {f: getattr(used[j.id], f) for f in usage.SUMMARY_FIELDS}}
                  for j in found.jobs]
    return {"since": query.since.isoformat(), "until": query.until.isoformat(), "jobs": listed,
            "counts": found.counts, "total": found.total}


def _ran_on(summary: Any) -> list[int] | None:
    """An ended job's GPUs from its summary, as ``jobs.gpu_indices_of`` gives them; None where it
    keeps none (one from before gpuq kept them)."""
    return list(summary.gpu_indices) if summary is not None and summary.gpu_indices else None


@routes.get(P + "/jobs/active")
async def active(request: web.Request) -> web.Response:
    """The caller's waiting and running jobs (`gpuq cancel --me`), or for root and the admins
    another ``user``'s (`gpuq cancel -u NAME`, scancel's -u); ``name`` (a name or a pattern) and
    ``state`` (pending or running) narrow them (`gpuq cancel --name --state`, scancel's -n, -t)."""
    settings, caller = acting(request)
    name, state = request.query.get("name"), request.query.get("state")
    user = request.query.get("user", caller.user)
    if user != caller.user and not rights.is_admin(settings, caller):
        raise NotAllowed(f"only root or an admin (GPUQ_ADMINS) may act on another user's jobs (-u {user[:64]}); "
                         f"you are {caller.user}")
    if name is not None and not name.strip():
        raise InvalidSpec("--name needs a name or a pattern")
    if state is not None and state not in _ACTIVE_BY_WORD:
        raise InvalidSpec(f"--state takes pending or running; got {state[:40]!r}")
    states = _ACTIVE_BY_WORD[state] if state is not None else c.ACTIVE_STATES
    return web.json_response({"ids": await call(_active, settings, user, name, states)})


# `--state` as scancel's -t reads it: a dispatched job is on its way to running.
_ACTIVE_BY_WORD: dict[str, tuple[str, ...]] = {word: jobs.STATE_WORDS[word] for word in (State.PENDING, State.RUNNING)}


def _active(settings: Settings, user: str, name: str | None, states: tuple[str, ...]) -> list[int]:
    with reading(settings) as session:
        return jobs.active_jobs_of(session, user, name, states)


@routes.get(P + r"/arrays/{id:\d+}")
async def array(request: web.Request) -> web.Response:
    settings, _ = context(request)
    return web.json_response({"jobs": await call(_array, settings, job_id_of(request))})


def _array(settings: Settings, array_id: int) -> list[dict[str, Any]]:
    now = utcnow()
    with reading(settings) as session:
        return [views.job(j) | {"elapsed_s": _secs(jobs.elapsed(j, now))}
                for j in (jobs.get_job(session, i) for i in jobs.array_jobs(session, array_id))]


@routes.get(JOB)
async def show(request: web.Request) -> web.Response:
    """One job (`gpuq show`): what everyone may see, its last output lines if it failed and the
    caller may read its output, and its environment (``env``, the variables it was submitted with)
    and where its mail goes (``mail.to``) if the caller may read its private data (its owner,
    root, the admins), else null."""
    settings, caller = context(request)
    return web.json_response(await call(_show, settings, caller, job_id_of(request)))


def _kept(settings: Settings, job: Job) -> dict[str, Any] | None:
    """An active kept job's client (service/kept_jobs.py), as `gpuq show` words it: which command,
    how long since it said it is alive (on the server's clock), and how long it may be silent."""
    if job.keepalive_at is None or job.state in c.END_STATES:
        return None
    silent = (utcnow() - job.keepalive_at).total_seconds()
    return {"client": kept_jobs.client_of(job.kind), "silent_s": round(silent, 1), "limit_s": settings.alloc_keepalive}


def _show(settings: Settings, caller: Caller, job_id: int) -> dict[str, Any]:
    with reading(settings) as session:
        job = jobs.get_job(session, job_id)
        gpus = jobs.gpu_indices(session, job_id)
        metrics = job_output.read_metrics(session, job_id)
        explains = job.failure not in (None, c.FAILURE_CANCELLED, c.FAILURE_TIMEOUT)
        readable = rights.may_read_output(settings, job.user, caller)
        tail = job_output.output_tail(session, job_id, c.FAILURE_TAIL_LINES) if explains and readable else []
        # Not opened by GPUQ_SHARED_LOGS, as output is: the values may be the owner's secrets.
        private = rights.may_read_private(settings, job.user, caller)
        env = dict(job.env or {}) if private else None
        data = views.job(job, gpus or None) | {"elapsed_s": _secs(jobs.elapsed(job)),
                                                "cores": bound_cores.of(session, job_id)}
        asked = mail.asked(session, job_id)
        # Its mail's events for all to see; where it goes, as its environment, for those who may read that.
        data["mail"] = None if asked is None else {
            "events": asked[0], "to": mail.address_of(job.user, asked[1], settings.mail_domain) if private else None}
        if job.after_kind == units.AFTER_CORR and job.after:
            # The tasks an aftercorr task waits for, as (array, index) by id: `gpuq show` names them so.
            data["after_tasks"] = {str(r.id): [r.array_id, r.array_index] for r in session.execute(
                select(Job.id, Job.array_id, Job.array_index).where(Job.id.in_(job.after)))}
        # A shared job is placed with its share and this reserve for its CUDA context on each GPU.
        context = settings.shared_context_mib if job.shared else None
        data["kept"] = _kept(settings, job)
    return data | {"context_mib": context, "env": env, "metrics": views.plain(metrics), "last_output": tail,
                   "output_readable": readable}


@routes.get(JOB + "/diff")
async def diff(request: web.Request) -> web.Response:
    """The uncommitted changes recorded at submit (`gpuq show --diff`): the owner's and admins' only."""
    settings, caller = context(request)
    return web.json_response(await call(_diff, settings, caller, job_id_of(request)))


def _diff(settings: Settings, caller: Caller, job_id: int) -> dict[str, Any]:
    with reading(settings) as session:
        job = jobs.get_job(session, job_id)
        rights.check_read_private(settings, job_id, job.user, caller)
        return {"id": job.id, "git_commit": job.git_commit, "git_dirty": job.git_dirty,
                "git_diff": job.git_diff, "git_diff_cut": job.git_diff_cut}


@routes.get(JOB + "/output")
async def output(request: web.Request) -> web.Response:
    """Output chunks after sequence number ``after`` (-1: from the start), each [seq, text, stream],
    the job's state and reason (with its exit code, failure and result once it ended), and for a
    training job the epochs done (`gpuq logs [-f]`, `gpuq run`, `gpuq attach`).

    With ``wait=S`` and ``state=X`` (the state the client last saw) the answer waits, at most S
    seconds, for news: new output, or a state other than X. A follower then learns of a line or
    of the job's end as soon as SQL has it, without asking many times a second itself."""
    settings, caller = context(request)
    job_id, after = job_id_of(request), min(max(_int(request, "after", -1), -1), MAX_JOB_ID)
    wait = _float(request, "wait", 0.0)
    wait = min(max(wait, 0.0), 60.0) if math.isfinite(wait) else 0.0
    seen = request.query.get("state")
    loop = asyncio.get_running_loop()
    began = loop.time()
    while True:
        answer = await call(_output, settings, caller, job_id, after)
        waited = loop.time() - began
        if answer["chunks"] or answer["state"] != seen or answer["state"] in c.END_STATES or waited >= wait:
            return web.json_response(answer)
        # Often at first (a short job's end comes soon after its start), then less often: a
        # follower of a long job costs the server a read every quarter second, not twenty a second.
        await asyncio.sleep(c.FOLLOW_LOOK_SECONDS if waited < 1.0 else 5 * c.FOLLOW_LOOK_SECONDS)


def _output(settings: Settings, caller: Caller, job_id: int, after: int) -> dict[str, Any]:
    with reading(settings) as session:
        job = jobs.get_job(session, job_id)
        rights.check_read_output(settings, job_id, job.user, caller)
        chunks = job_output.read_output(session, job_id, after)
        epochs = job.params.get("epochs") if job.workload == "train" else None
        done = _epochs_done(job_output.read_metrics(session, job_id)) if epochs else 0
        # A held job waits for its release from its submit on, before any pass has written why.
        reason = job.reason or (policy.HELD if job.held and job.state == c.State.PENDING else None)
        answer = {"id": job_id, "state": job.state, "reason": reason, "kind": job.kind,
                  "chunks": [list(ch) for ch in chunks], "epochs": epochs, "epochs_done": done}
        if job.state in c.END_STATES:
            answer |= {"exit_code": job.exit_code, "failure": job.failure, "result": job.result}
        return answer


def _epochs_done(metrics: list[dict[str, Any]]) -> int:
    # The last row's epoch number, not the row count: a job resumed from a checkpoint starts past 0.
    return int(metrics[-1].get("epoch", len(metrics))) if metrics else 0


@routes.get(JOB + "/why")
async def why(request: web.Request) -> web.Response:
    settings, _ = context(request)
    return web.json_response(await call(_why, settings, job_id_of(request)))


def _why(settings: Settings, job_id: int) -> dict[str, Any]:
    from gpuq.service.explain import why as explain

    with reading(settings) as session:
        text = explain(session, settings, job_id)
        state = jobs.get_job(session, job_id).state
    return {"id": job_id, "state": state, "why": text}
