"""The API's other routes: who am I, the GPUs, the built-in workloads, accounting."""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from gpuq.server import views
from gpuq.server.request import call, context, job_id_of, reading
from gpuq.service import accounting, display, efficiency, rights, samples, usage
from gpuq.service import constants as c
from gpuq.service.errors import InvalidSpec
from gpuq.service.jobs import get_job
from gpuq.service.models import Gpu, utcnow
from gpuq.service.settings import Settings
from gpuq.service.workloads import CATALOGUE

routes = web.RouteTableDef()
P = c.API_PREFIX
# Slices of a report's busy-GPU series: `gpuq stats --plot`'s by default, and at most (one query's
# GROUP BY, and one JSON list per user, of this length).
SERIES_BUCKETS, MAX_SERIES_BUCKETS = 120, 2000


@routes.get(P + "/whoami")
async def whoami(request: web.Request) -> web.Response:
    """Who the server takes the caller for, and whether they are an admin; nobody (user null) for
    a request that asked for the public view."""
    settings, caller = context(request)
    if caller is None:
        return web.json_response({"user": None, "uid": None, "admin": False})
    return web.json_response({"user": caller.user, "uid": caller.uid, "admin": rights.is_admin(settings, caller)})


@routes.get(P + "/devices")
async def devices(request: web.Request) -> web.Response:
    """Every GPU now (`gpuq devices`), the drained nodes with their reasons, and the drains planned."""
    settings, _ = context(request)
    return web.json_response(await call(_devices, settings))


def _devices(settings: Settings) -> dict[str, Any]:
    from gpuq.service import node_drains
    from gpuq.service.device_status import device_status

    with reading(settings) as session:
        drained, ahead = node_drains.notes(session)
        return {"devices": [d.as_dict() for d in device_status(session, settings)],
                "drained": drained, "drains_ahead": ahead}


@routes.get(P + "/share")
async def share(request: web.Request) -> web.Response:
    """Each user's standing in the fair share (`gpuq share`, sshare's): their recent GPU-hours,
    decayed, the order those put users in at equal priority, their jobs and GPUs now, and the GPUs
    they may hold at once (``limited``: whether anyone is held to a limit)."""
    settings, _ = context(request)
    return web.json_response(await call(_share, settings))


def _share(settings: Settings) -> dict[str, Any]:
    from gpuq.service.fair_share import standings

    with reading(settings) as session:
        return {"half_life_h": settings.fairshare_half_life_h, "limited": settings.gpu_limited,
                "users": [dataclasses.asdict(s) for s in standings(session, settings)]}


@routes.get(P + "/workloads")
async def workloads(request: web.Request) -> web.Response:
    """The built-in workloads, their parameters and defaults (`gpuq workloads`)."""
    return web.json_response({w.name: {"summary": w.summary, "min_gpus": w.min_gpus, "max_gpus": w.max_gpus,
                                       "params": {p.name: {"type": p.type.__name__, "default": p.default,
                                                           "help": p.help, "choices": p.choices, "min": p.min,
                                                           "max": p.max, "flag": p.flag}
                                                  for p in w.params}}
                              for w in CATALOGUE.values()})


@routes.get(P + "/stats")
async def report(request: web.Request) -> web.Response:
    """Per user and per node over a period (`gpuq stats`); ``plot=1`` adds the busy-GPU series, in
    ``buckets`` equal slices of the period (120 unless given)."""
    settings, _ = context(request)
    q = request.query
    return web.json_response(await call(_report, settings, q.get("since", "7d"), q.get("until", "now"),
                                        q.get("plot") in ("1", "true"), _buckets(q.get("buckets"))))


def _buckets(raw: str | None) -> int:
    if raw is None:
        return SERIES_BUCKETS
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_SERIES_BUCKETS:
        raise InvalidSpec(f"buckets must be a whole number from 1 to {MAX_SERIES_BUCKETS}, got {raw[:40]!r}")
    return int(raw)


def _report(settings: Settings, since: str, until: str, plot: bool, buckets: int = SERIES_BUCKETS) -> dict[str, Any]:
    now = utcnow()
    start, end = accounting.parse_when(since, "--since", now), accounting.parse_when(until, "--until", now)
    if start >= end:
        raise InvalidSpec(f"--since {since} is not before --until {until}")
    with reading(settings) as session:
        rep = accounting.report(session, start, end, now)
        series = accounting.utilization_by_user(session, start, end, buckets) if plot else None
    out: dict[str, Any] = {"since": start.isoformat(), "until": end.isoformat(),
                           "users": [r.as_dict() for r in rep["users"]], "nodes": [r.as_dict() for r in rep["nodes"]]}
    if series is not None:
        out["series"] = {"edges": views.plain(series[0]), "by_user": series[1]}
    return out


@routes.get(P + r"/jobs/{id:\d+}/stats")
async def job_stats(request: web.Request) -> web.Response:
    """One job's usage summary (`gpuq stats ID`); ``plot=1`` adds its samples, and the node and
    index of each GPU they name (``gpus``, by the samples' ``gpu_id``)."""
    settings, _ = context(request)
    return web.json_response(await call(_job_stats, settings, job_id_of(request),
                                        request.query.get("plot") in ("1", "true")))


def _job_stats(settings: Settings, job_id: int, plot: bool) -> dict[str, Any]:
    with reading(settings) as session:
        job = get_job(session, job_id)
        u = usage.job_usage(session, job_id)
        series = accounting.job_series(session, job_id, job.started_at) if plot else None
        out: dict[str, Any] = dict(job_id=job.id, name=job.name, user=job.user, state=job.state, node=job.node,
                                   gpus=job.gpus, time_limit_s=job.time_limit_s,
                                   time_used=efficiency.time_used(u.wall_s, job.time_limit_s),
                                   limit_hint=efficiency.job_hint(job.state, u.wall_s, job.time_limit_s),
                                   wall_s=u.wall_s, gpu_hours=u.gpu_hours,
                                   memory_peak_mib=u.memory_peak_mib, memory_mean_mib=u.memory_mean_mib,
                                   utilization_mean=u.utilization_mean, energy_j=u.energy_j, idle_s=u.idle_s,
                                   samples=u.samples, cpu_s=u.cpu_s, cpus=job.cpus,
                                   host_mem_peak_mib=getattr(u, "host_mem_peak_mib", None),
                                   host_mem_mib=job.host_mem_mib,
                                   # A shared job's share (with its context reserve), to read its peak against.
                                   share_mib=job.mem_mib + settings.shared_context_mib if job.shared and job.mem_mib
                                   else None)
        if series is not None:
            out["series"] = views.plain(series)
            out["series_gpus"] = {str(g.id): {"node": g.node, "index": g.index, "name": g.name}
                                  for g in (session.get(Gpu, i) for i in sorted({p["gpu_id"] for p in series}))
                                  if g is not None}
    return out


@routes.get(P + r"/arrays/{id:\d+}/stats")
async def array_stats(request: web.Request) -> web.Response:
    """An array's tasks summed (`gpuq stats --array ID`, as seff gives an array's), and each task's
    summary (``per_task``)."""
    settings, _ = context(request)
    return web.json_response(await call(_array_stats, settings, job_id_of(request)))


def _array_stats(settings: Settings, array_id: int) -> dict[str, Any]:
    with reading(settings) as session:
        tasks = usage.array_usage(session, array_id)
    return {"array_id": array_id, "name": display.array_name(tasks[0]["name"]), "user": tasks[0]["user"],
            **efficiency.array_summary(tasks), "per_task": tasks}


@routes.post(P + "/stats/rollup")
async def rollup(request: web.Request) -> web.Response:
    """Roll raw samples past retention into minute aggregates now (root and admins)."""
    settings, caller = context(request)
    rights.check_admin(settings, caller, "roll up samples")
    n = await call(samples.rollup, settings, utcnow())
    return web.json_response({"rolled": n, "retention_days": settings.sample_retention_days})
