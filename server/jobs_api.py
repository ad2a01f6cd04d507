"""The API's job routes: submit, the queue, one job, its output, and the moves users make.

Rights are checked here, with service/rights.py, before anything private leaves the server."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from sqlalchemy import select

from gpuq.server import dispatch, submission, views
from gpuq.server.audit import audited
from gpuq.server.copies import COPIES
from gpuq.server.request import body_of, call, context, job_id_of, reading
from gpuq.service import constants as c
from gpuq.service import display, inventory, jobs, policy, rights, usage
from gpuq.service import history as history_of
from gpuq.service.accounting import parse_when
from gpuq.service.constants import State
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import Job, utcnow
from gpuq.service.rights import Caller
from gpuq.service.settings import Settings
from gpuq.service.units import MAX_JOB_ID

routes = web.RouteTableDef()
T = TypeVar("T")
P = c.API_PREFIX
JOB = P + r"/jobs/{id:\d+}"
MAX_IDS = 100_000  # job ids one request may name


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


def _ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidSpec(f"ids must be job ids separated by commas, got {text[:60]!r}") from None
    return _bounded(ids)


def _bounded(ids: list[int]) -> list[int]:
    """``ids``, if a request may name that many; InvalidSpec otherwise, and JobNotFound for one
    no job can have."""
    if not 1 <= len(ids) <= MAX_IDS:
        raise InvalidSpec(f"name between 1 and {MAX_IDS:,} job ids")
    for job_id in ids:
        if not 1 <= job_id <= MAX_JOB_ID:
            raise jobs.JobNotFound(f"no job {job_id}")
    return ids


@routes.post(P + "/jobs")
async def submit(request: web.Request) -> web.Response:
    settings, caller = context(request)
    body = await body_of(request)
    user = body.get("user")
    # A copy of a work tree may take minutes: in a pool of its own, two of a user's at a time.
    copies = request.app[COPIES] if body.get("snapshot") is True else None
    async with copies.turn(caller.uid) if copies is not None else contextlib.nullcontext():
        # A repeated key wrote nothing: no line (the first request's is the record of its jobs).
        done: submission.Submitted = await audited(
            request, "submit", submission.submit, settings, caller, body,
            acted=lambda d: {} if d.repeated else {j.id: j.user for j in d.jobs},
            via_user=user if isinstance(user, str) else None, copies=copies)
    response = web.json_response({"jobs": [views.job(j) for j in done.jobs]})
    if done.placed:
        # The answer first: the client (the next submit of a loop, `gpuq run`) goes on while the
        # placed jobs' messages are published (a fifth of a submit's CPU here).
        await response.prepare(request)
        await response.write_eof()
        await call(dispatch.send, settings, done.placed)
    return response


@routes.get(P + "/jobs")
async def queue(request: web.Request) -> web.Response:
    """The queue as `gpuq status` shows it: active jobs, the newest ended ones, the GPUs."""
    settings, caller = context(request)
    ended = min(_int(request, "ended", 10), history_of.MAX_LISTED)
    mine = request.query.get("mine") in ("1", "true")
    # ``user``: one user's jobs (`gpuq status --user`, squeue -u), which everyone may see.
    named = request.query.get("user")
    if named is not None and not named.strip():
        raise InvalidSpec("--user needs a user name")
    # arrays=collapsed: an array's pending tasks come as entries of "arrays", one for each reason
    # they wait, not as thousands of jobs (`gpuq status` and the dashboard ask for it).
    collapsed = request.query.get("arrays") == "collapsed"
    user = caller.user if mine else named
    return web.json_response(await call(_queue, settings, user, max(ended, 0), collapsed, named is not None))


def _queue(settings: Settings, user: str | None, ended: int, collapsed: bool = False,
           named: bool = False) -> dict[str, Any]:
    now = utcnow()
    with reading(settings) as session:
        if named and user is not None:
            _check_known_user(session, user)  # as squeue's "Invalid user"
        rows = jobs.list_jobs(session, ended_limit=ended, user=user, but_pending_tasks=collapsed)
        tasks = jobs.pending_tasks(session, user=user) if collapsed else []
        gpus = inventory.view(session, settings)
        idle = usage.idle_jobs(session, settings)
        held = jobs.gpu_indices_of(session, [j.id for j in rows if j.started_at is not None])
        listed = [views.job(j, held.get(j.id)) | {"elapsed_s": _secs(jobs.elapsed(j, now)), "idle": j.id in idle}
                  for j in rows]
    answer = {"jobs": listed, "gpus": [views.plain(g.__dict__) for g in gpus], "idle_window_s": settings.idle_window}
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
    ids = _ids(request.query.get("ids", ""))
    found = await call(_states, settings, ids)
    return web.json_response({"states": {str(k): v for k, v in found.items()}})


def _states(settings: Settings, ids: list[int]) -> dict[int, str]:
    with reading(settings) as session:
        found = jobs.wait_states(session, ids)
    for job_id in ids:
        if job_id not in found:
            raise jobs.JobNotFound(f"no job {job_id}")
    return found


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
        user=caller.user if q.get("mine") in ("1", "true") else q.get("user") or None, states=states,
        name=q.get("name") or None, array_id=_int(request, "array", 0) or None, limit=_int(request, "limit", 100))
    return web.json_response(await call(_history, settings, query))


def _history(settings: Settings, query: history_of.HistoryQuery) -> dict[str, Any]:
    with reading(settings) as session:
        if query.user is not None:
            _check_known_user(session, query.user)  # as sacct's "Invalid user id"
        found = history_of.ended_jobs(session, query)
        ran_on = jobs.gpu_indices_of(session, [j.id for j in found.jobs if j.started_at is not None])
        # How long each waited and ran, worked out here once for every front-end ("-" where it never started).
        listed = [views.job(j, ran_on.get(j.id)) | {"elapsed_s": _secs(jobs.elapsed(j)),
                                  "waited_s": _secs(j.started_at - j.submitted_at) if j.started_at else None}
                  for j in found.jobs]
    return {"since": query.since.isoformat(), "until": query.until.isoformat(), "jobs": listed,
            "counts": found.counts, "total": found.total}


@routes.get(P + "/jobs/active")
async def active(request: web.Request) -> web.Response:
    """The caller's waiting and running jobs (`gpuq cancel --user`); ``name`` (a name or a pattern)
    and ``state`` (pending or running) narrow them (`gpuq cancel --name --state`, scancel's -n, -t)."""
    settings, caller = context(request)
    name, state = request.query.get("name"), request.query.get("state")
    if name is not None and not name.strip():
        raise InvalidSpec("--name needs a name or a pattern")
    if state is not None and state not in _ACTIVE_BY_WORD:
        raise InvalidSpec(f"--state takes pending or running; got {state[:40]!r}")
    states = _ACTIVE_BY_WORD[state] if state is not None else c.ACTIVE_STATES
    return web.json_response({"ids": await call(_active, settings, caller.user, name, states)})


# `--state` as scancel's -t reads it: a dispatched job is on its way to running.
_ACTIVE_BY_WORD: dict[str, tuple[str, ...]] = {State.PENDING: (State.PENDING,),
                                              State.RUNNING: (State.DISPATCHED, State.RUNNING)}


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
    if the caller may read its private data (its owner, root, the admins), else ``env`` null."""
    settings, caller = context(request)
    return web.json_response(await call(_show, settings, caller, job_id_of(request)))


def _show(settings: Settings, caller: Caller, job_id: int) -> dict[str, Any]:
    with reading(settings) as session:
        job = jobs.get_job(session, job_id)
        gpus = jobs.gpu_indices(session, job_id)
        metrics = jobs.read_metrics(session, job_id)
        explains = job.failure not in (None, c.FAILURE_CANCELLED, c.FAILURE_TIMEOUT)
        readable = rights.may_read_output(settings, job.user, caller)
        tail = jobs.output_tail(session, job_id, c.FAILURE_TAIL_LINES) if explains and readable else []
        # Not opened by GPUQ_SHARED_LOGS, as output is: the values may be the owner's secrets.
        env = dict(job.env or {}) if rights.may_read_private(settings, job.user, caller) else None
        data = views.job(job, gpus or None) | {"elapsed_s": _secs(jobs.elapsed(job))}
        # A shared job is placed with its share and this reserve for its CUDA context on each GPU.
        context = settings.shared_context_mib if job.shared else None
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
        chunks = jobs.read_output(session, job_id, after)
        epochs = job.params.get("epochs") if job.workload == "train" else None
        done = _epochs_done(jobs.read_metrics(session, job_id)) if epochs else 0
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


@routes.post(JOB + "/cancel")
async def cancel(request: web.Request) -> web.Response:
    settings, caller = context(request)
    job_id = job_id_of(request)
    outcome = await audited(request, "cancel", jobs.cancel, settings, job_id, caller, ids=[job_id])
    return web.json_response({"id": outcome.job_id, "state": outcome.state, "kill_grace_s": settings.kill_grace})


@routes.post(P + "/jobs/cancel")
async def cancel_all(request: web.Request) -> web.Response:
    """Cancel the jobs of ``{"ids": [...]}`` in one request (`gpuq cancel` of an array, of all of
    mine): all or none, if one may not be cancelled by the caller or does not exist."""
    settings, caller = context(request)
    ids = await _ids_of(request)
    outcomes = await audited(request, "cancel", jobs.cancel_all, settings, ids, caller, ids=ids,
                             acted=lambda done: [o.job_id for o in done if not o.ended])
    return web.json_response({"jobs": [{"id": o.job_id, "state": o.state, "ended": o.ended} for o in outcomes],
                              "kill_grace_s": settings.kill_grace})


@routes.post(P + "/jobs/hold")
async def hold_all(request: web.Request) -> web.Response:
    """Hold the pending jobs of ``{"ids": [...]}`` (all checked first, as a cancel); for each, null
    where it was held, else why not (running, already held)."""
    return await _set_held_all(request, True)


@routes.post(P + "/jobs/release")
async def release_all(request: web.Request) -> web.Response:
    return await _set_held_all(request, False)


async def _set_held_all(request: web.Request, held: bool) -> web.Response:
    settings, caller = context(request)
    ids = await _ids_of(request)
    outcome = await audited(request, "hold" if held else "release", jobs.set_held_all, settings, ids, held, caller,
                            ids=ids, acted=lambda done: [i for i, why in done.items() if why is None])
    return web.json_response({"jobs": [{"id": job_id, "not": why} for job_id, why in outcome.items()]})


@routes.post(P + "/jobs/update")
async def update_all(request: web.Request) -> web.Response:
    """Change the jobs of ``{"ids": [...], "priority": P, "time": "2h", "name": N, "retries": R}``
    (any of the four; `gpuq update`): all checked first, as a cancel; for each, what changed
    (``{field: [old, new]}``) or why not."""
    from gpuq.service import update

    settings, caller = context(request)
    body = await body_of(request)
    ids = _ids_in(body, 'the body must have "ids": [job ids]')
    changes = update.Changes.of(body)
    asked = ", ".join(f"{f}={getattr(changes, f)!r}" for f in update.FIELDS if getattr(changes, f) is not None)
    outcomes = await audited(request, "update", update.update_all, settings, ids, changes, caller, ids=ids,
                             acted=lambda done: [o.job_id for o in done if o.changed], note=lambda _: asked)
    return web.json_response({"jobs": [o.as_json() for o in outcomes]})


async def _ids_of(request: web.Request) -> list[int]:
    """The job ids of a request on many jobs, ``{"ids": [...]}``; InvalidSpec for anything else."""
    body = await body_of(request)
    shape = 'the body must be {"ids": [job ids]}'
    if set(body) != {"ids"}:
        raise InvalidSpec(shape)
    return _ids_in(body, shape)


def _ids_in(body: dict[str, Any], shape: str) -> list[int]:
    """The job ids of a body's ``"ids"``, bounded; InvalidSpec(``shape``) unless a list of ids."""
    ids = body.get("ids")
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise InvalidSpec(shape)
    return _bounded(ids)


@routes.post(JOB + "/hold")
async def hold(request: web.Request) -> web.Response:
    return await _set_held(request, True)


@routes.post(JOB + "/release")
async def release(request: web.Request) -> web.Response:
    return await _set_held(request, False)


async def _set_held(request: web.Request, held: bool) -> web.Response:
    settings, caller = context(request)
    job_id = job_id_of(request)
    await audited(request, "hold" if held else "release", jobs.set_held, settings, job_id, held, caller, ids=[job_id])
    return web.json_response({"id": job_id, "held": held})


@routes.post(JOB + "/resubmit")
async def resubmit(request: web.Request) -> web.Response:
    from gpuq.service.resubmit import resubmit as again

    settings, caller = context(request)
    job_id = job_id_of(request)
    job = await audited(request, "resubmit", again, settings, job_id, caller, ids=[job_id],
                        acted=lambda new: {job_id: new.user}, note=lambda new: f"as job {new.id}")
    return web.json_response({"job": views.job(job)})


@routes.post(JOB + "/keepalive")
async def keepalive(request: web.Request) -> web.Response:
    """An allocation's client (`gpuq alloc`) is alive: the allocation as it needs it (state, GPUs,
    run id, deadline, how often to say so again). Its owner's only."""
    from gpuq.service.allocations import keep_alive

    settings, caller = context(request)
    held = await call(keep_alive, settings, job_id_of(request), caller)
    return web.json_response(held.as_json())


@routes.post(JOB + "/end")
async def end(request: web.Request) -> web.Response:
    """An allocation's shell (or command) exited with ``exit_code``: its worker ends it and stops
    whatever it left running."""
    from gpuq.service.allocations import end_by_client

    settings, caller = context(request)
    body = await body_of(request)
    code = body.get("exit_code")
    if not isinstance(code, int) or isinstance(code, bool):
        raise InvalidSpec("exit_code must be a whole number")
    job_id = job_id_of(request)
    await audited(request, "end", end_by_client, settings, job_id, code, caller, ids=[job_id],
                  note=lambda _: f"its client's exit code {code}")
    return web.json_response({"id": job_id, "exit_code": code})
