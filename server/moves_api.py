"""The API's moves on jobs: submit, and cancel, signal, hold, release, update and resubmit (of one
job or of many in one request), an allocation's client saying it is alive or has ended, and the
input `gpuq run` forwards to its job; and a submit tried without queueing it (its estimate).

Each move is audited (``audit.audited``); rights are checked in the service function it calls."""

from __future__ import annotations

import contextlib
from typing import Any

from aiohttp import web

from gpuq.server import dispatch, submission, views
from gpuq.server.audit import audited
from gpuq.server.copies import COPIES
from gpuq.server.request import JOB, acting, body_of, bounded, call, job_id_of
from gpuq.service import constants as c
from gpuq.service import jobs
from gpuq.service.errors import InvalidSpec

routes = web.RouteTableDef()
P = c.API_PREFIX


@routes.post(P + "/jobs")
async def submit(request: web.Request) -> web.Response:
    settings, caller = acting(request)
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


@routes.post(P + "/jobs/estimate")
async def estimate(request: web.Request) -> web.Response:
    """A submit's body tried, not queued (`gpuq submit --test-only`): when its jobs would start.
    Checked as the caller's submit; nothing is written, so nothing is audited."""
    settings, caller = acting(request)
    body = await body_of(request)
    return web.json_response(await call(submission.estimate, settings, caller, body))


@routes.post(JOB + "/cancel")
async def cancel(request: web.Request) -> web.Response:
    settings, caller = acting(request)
    job_id = job_id_of(request)
    outcome = await audited(request, "cancel", jobs.cancel, settings, job_id, caller, ids=[job_id])
    return web.json_response({"id": outcome.job_id, "state": outcome.state, "kill_grace_s": settings.kill_grace})


@routes.post(P + "/jobs/cancel")
async def cancel_all(request: web.Request) -> web.Response:
    """Cancel the jobs of ``{"ids": [...]}`` in one request (`gpuq cancel` of an array, of all of
    mine): all or none, if one may not be cancelled by the caller or does not exist."""
    settings, caller = acting(request)
    ids = await _ids_of(request)
    outcomes = await audited(request, "cancel", jobs.cancel_all, settings, ids, caller, ids=ids,
                             acted=lambda done: [o.job_id for o in done if not o.ended])
    return web.json_response({"jobs": [{"id": o.job_id, "state": o.state, "ended": o.ended} for o in outcomes],
                              "kill_grace_s": settings.kill_grace})


@routes.post(P + "/jobs/signal")
async def signal_all(request: web.Request) -> web.Response:
    """Send a signal to the running commands of ``{"ids": [...], "signal": "USR1"}`` (`gpuq cancel
    --signal`; ``"B:USR1"``: to each one's main process alone), through their workers: all checked
    first, as a cancel; for each, null where its worker sends it, else why not."""
    from gpuq.service import job_signals
    from gpuq.service.units import JobSignal

    settings, caller = acting(request)
    body = await body_of(request)
    shape = 'the body must be {"ids": [job ids], "signal": "USR1"}'
    if set(body) != {"ids", "signal"} or not isinstance(body["signal"], str):
        raise InvalidSpec(shape)
    ids = _ids_in(body, shape)
    sig = JobSignal.parse_now(body["signal"])
    outcomes = await audited(request, "signal", job_signals.signal_all, settings, ids, sig, caller, ids=ids,
                             acted=lambda done: [o.job_id for o in done if o.not_sent is None],
                             note=lambda _: f"SIG{sig.name}" + (" to the main process" if sig.main_only else ""))
    return web.json_response({"signal": f"SIG{sig.name}", "main_only": sig.main_only,
                              "jobs": [{"id": o.job_id, "state": o.state, "not": o.not_sent} for o in outcomes]})


@routes.post(P + "/jobs/hold")
async def hold_all(request: web.Request) -> web.Response:
    """Hold the pending jobs of ``{"ids": [...]}`` (all checked first, as a cancel); for each, null
    where it was held, else why not (running, already held)."""
    return await _set_held_all(request, True)


@routes.post(P + "/jobs/release")
async def release_all(request: web.Request) -> web.Response:
    return await _set_held_all(request, False)


async def _set_held_all(request: web.Request, held: bool) -> web.Response:
    settings, caller = acting(request)
    ids = await _ids_of(request)
    outcome = await audited(request, "hold" if held else "release", jobs.set_held_all, settings, ids, held, caller,
                            ids=ids, acted=lambda done: [i for i, why in done.items() if why is None])
    return web.json_response({"jobs": [{"id": job_id, "not": why} for job_id, why in outcome.items()]})


@routes.post(P + "/jobs/requeue")
async def requeue_all(request: web.Request) -> web.Response:
    """Requeue the running jobs of ``{"ids": [...], "hold": false}`` (all checked first, as a
    cancel): their workers stop them and they wait again under their ids (``hold``: held); for each,
    null where it is being requeued, else why not (not running, an allocation, stopping already)."""
    settings, caller = acting(request)
    body = await body_of(request)
    shape = 'the body must be {"ids": [job ids], "hold": true or false}'
    if not set(body) <= {"ids", "hold"} or not isinstance(body.get("hold", False), bool):
        raise InvalidSpec(shape)
    ids = _ids_in(body, shape)
    outcome = await audited(request, "requeue", jobs.requeue_all, settings, ids, body.get("hold", False), caller,
                            ids=ids, acted=lambda done: [i for i, why in done.items() if why is None])
    return web.json_response({"jobs": [{"id": job_id, "not": why} for job_id, why in outcome.items()]})


@routes.post(P + "/jobs/update")
async def update_all(request: web.Request) -> web.Response:
    """Change the jobs of ``{"ids": [...], "priority": P, "time": "2h", "name": N, "retries": R}``
    (any of the four; `gpuq update`): all checked first, as a cancel; for each, what changed
    (``{field: [old, new]}``) or why not."""
    from gpuq.service import update
    from gpuq.service.changes import FIELDS, Changes

    settings, caller = acting(request)
    body = await body_of(request)
    ids = _ids_in(body, 'the body must have "ids": [job ids]')
    changes = Changes.of(body)
    asked = ", ".join(f"{f}={getattr(changes, f)!r}" for f in FIELDS if getattr(changes, f) is not None)
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
    return bounded(ids)


@routes.post(JOB + "/hold")
async def hold(request: web.Request) -> web.Response:
    return await _set_held(request, True)


@routes.post(JOB + "/release")
async def release(request: web.Request) -> web.Response:
    return await _set_held(request, False)


async def _set_held(request: web.Request, held: bool) -> web.Response:
    settings, caller = acting(request)
    job_id = job_id_of(request)
    await audited(request, "hold" if held else "release", jobs.set_held, settings, job_id, held, caller, ids=[job_id])
    return web.json_response({"id": job_id, "held": held})


@routes.post(JOB + "/resubmit")
async def resubmit(request: web.Request) -> web.Response:
    from gpuq.service.resubmit import resubmit as again

    settings, caller = acting(request)
    job_id = job_id_of(request)
    job = await audited(request, "resubmit", again, settings, job_id, caller, ids=[job_id],
                        acted=lambda new: {job_id: new.user}, note=lambda new: f"as job {new.id}")
    return web.json_response({"job": views.job(job)})


@routes.post(JOB + "/keepalive")
async def keepalive(request: web.Request) -> web.Response:
    """A kept job's client is alive (service/kept_jobs.py): `gpuq alloc`'s, which gets the
    allocation as it needs it (state, GPUs, run id, deadline, how often to say so again), or `gpuq
    run`'s (its job's state, how often). Its owner's, and the admins'."""
    from gpuq.service.allocations import keep_alive

    settings, caller = acting(request)
    held = await call(keep_alive, settings, job_id_of(request), caller)
    return web.json_response(held.as_json())


@routes.delete(JOB + "/keepalive")
async def let_go(request: web.Request) -> web.Response:
    """A `gpuq run` stopped by Ctrl-Z lets go of the job it kept: the job outlives it from now on,
    as a detached one (service/kept_jobs.py). Its owner's, and the admins'."""
    from gpuq.service.kept_jobs import let_go as release

    settings, caller = acting(request)
    job_id = job_id_of(request)
    await call(release, settings, job_id, caller)
    return web.json_response({"id": job_id, "kept": False})


@routes.put(JOB + "/keepalive")
async def keep_again(request: web.Request) -> web.Response:
    """A `gpuq run` that let go of its job when Ctrl-Z stopped it is resumed (`fg`, `bg`) and keeps
    the job again (service/kept_jobs.py); answered as a keepalive is. Its owner's, and the admins'."""
    from gpuq.service.allocations import keep_alive

    settings, caller = acting(request)
    held = await call(keep_alive, settings, job_id_of(request), caller, True)
    return web.json_response(held.as_json())


@routes.post(JOB + "/end")
async def end(request: web.Request) -> web.Response:
    """An allocation's shell (or command) exited with ``exit_code``: its worker ends it and stops
    whatever it left running."""
    from gpuq.service.allocations import end_by_client

    settings, caller = acting(request)
    body = await body_of(request)
    code = body.get("exit_code")
    if not isinstance(code, int) or isinstance(code, bool):
        raise InvalidSpec("exit_code must be a whole number")
    job_id = job_id_of(request)
    await audited(request, "end", end_by_client, settings, job_id, code, caller, ids=[job_id],
                  note=lambda _: f"its client's exit code {code}")
    return web.json_response({"id": job_id, "exit_code": code})


@routes.post(JOB + "/stdin")
async def stdin(request: web.Request) -> web.Response:
    """A chunk of the input `gpuq run` forwards to its job: ``{"data": BASE64, "end": bool}``;
    ``{"taken": false}`` while the job's waiting input is full (send it again later). ``seq``
    (0, 1, ...: the chunk's place) makes a chunk sent again after a restart appended once. Not
    audited chunk by chunk: the submit that asked for it was."""
    import base64
    import binascii

    from gpuq.service import job_input

    settings, caller = acting(request)
    job_id = job_id_of(request)
    body = await body_of(request)
    unknown = set(body) - {"data", "end", "seq"}
    if unknown:
        raise InvalidSpec(f"unknown input field {sorted(unknown)[0]!r}")
    data, end, seq = body.get("data", ""), body.get("end", False), body.get("seq")
    if not isinstance(data, str) or type(end) is not bool:
        raise InvalidSpec('the body must be {"data": base64 text, "end": true or false}')
    if seq is not None and (type(seq) is not int or seq < 0):
        raise InvalidSpec("seq must be a whole number from 0: the chunk's place in the input")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidSpec("the input's data is not base64") from None
    taken = await call(job_input.accept, settings, job_id, caller, raw, end, seq)
    return web.json_response({"taken": taken})
