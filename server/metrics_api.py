"""GET /v1/metrics: what a Prometheus exporter needs, as JSON (the dashboard's /metrics is built
from it): every GPU now with its UUID and sampled energy, jobs by state and user, pending jobs by
reason, each user's CPU seconds of ended commands, the attempts that ended with their job running
again by user and cause (preempted, requeued, a failure), and the queue-wait and run-time
histograms at the bounds the caller asks for.

Only what every user may see (states, users, reasons, resources, times): no output, diff or
environment value, whoever asks.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from aiohttp import web
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuq.server.histograms import Settled
from gpuq.server.request import call, context, reading
from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import DeviceMinute, DeviceSample, Gpu, Job, utcnow
from gpuq.service.settings import Settings

routes = web.RouteTableDef()
# The histograms' sums over the jobs long ended, kept by the server between scrapes (histograms.py).
SETTLED = web.AppKey("settled", Settled)
# Bounds one histogram may have (Prometheus's own clients use about a dozen).
MAX_BOUNDS = 64


@routes.get(c.API_PREFIX + "/metrics")
async def metrics(request: web.Request) -> web.Response:
    """The figures, with histograms at ``wait_le`` and ``duration_le`` (seconds, comma-separated,
    ascending; each histogram also has its count and sum)."""
    settings, _ = context(request)
    q = request.query
    settled = request.app[SETTLED]
    return web.json_response(await call(_metrics, settings, _bounds(q, "wait_le"), _bounds(q, "duration_le"),
                                        settled))


def _bounds(query: Any, name: str) -> list[float]:
    raw = query.get(name, "")
    try:
        bounds = [float(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise InvalidSpec(f"{name} must be numbers separated by commas, got {raw[:60]!r}") from None
    if len(bounds) > MAX_BOUNDS or bounds != sorted(set(bounds)):
        raise InvalidSpec(f"{name} must be at most {MAX_BOUNDS} ascending, distinct numbers")
    return bounds


def _metrics(settings: Settings, wait_le: list[float], duration_le: list[float],
             settled: Settled | None = None) -> dict[str, Any]:
    from gpuq.service import node_drains
    from gpuq.service.device_status import device_status

    settled = settled or Settled()
    now = utcnow()
    with reading(settings) as session:
        devices = device_status(session, settings)
        drained, ahead = node_drains.notes(session)
        ids = {(g.node, g.index): (g.id, g.uuid) for g in session.scalars(select(Gpu))}
        energy = _energy_by_gpu(session)
        by_state_user = sorted(settled.jobs(session, now).items())
        pending = session.execute(select(Job.reason, func.count()).where(Job.state == State.PENDING)
                                  .group_by(Job.reason)).all()
        wait = settled.histogram(session, "wait", wait_le, now)
        duration = settled.histogram(session, "duration", duration_le, now)
        cpu = settled.cpu(session, now)
        reruns = settled.reruns(session, now)
    out_gpus = []
    for d in devices:
        gpu_id, uuid = ids.get((d.node, d.index), (None, None))
        out_gpus.append(d.as_dict() | {"uuid": uuid, "energy_j": None if gpu_id is None else energy.get(gpu_id)})
    return {"gpus": out_gpus,
            "jobs": [{"state": s, "user": u, "count": n} for (s, u), n in by_state_user],
            "pending": [{"reason": r, "count": n} for r, n in pending],
            "cpu": [{"user": u, "cpu_s": s} for u, s in sorted(cpu.items())],
            "reruns": [{"user": u, "cause": why, "count": n} for (u, why), n in sorted(reruns.items())],
            "wait": wait, "duration": duration, "drained": drained, "drains_ahead": ahead}


def _energy_by_gpu(session: Session) -> dict[int, float]:
    """Joules each GPU used while gpuq sampled it: raw samples plus the minute aggregates."""
    out: defaultdict[int, float] = defaultdict(float)
    for t in (DeviceSample, DeviceMinute):
        for gpu_id, joules in session.execute(select(t.gpu_id, func.sum(t.energy_j)).group_by(t.gpu_id)):
            out[gpu_id] += float(joules or 0.0)
    return dict(out)

