"""Ready jobs a pass holds back: the tasks of an array past its limit (`--array 0-99%4`, SLURM's
array throttle), and each `--dependency singleton` job behind another of its user and name. Both
keep a pass (and so the next-up lists it writes) from starting more at once than the user asked;
the jobs held back wait for "array limit" or "dependency"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select

from gpuq.service import policy
from gpuq.service.constants import State
from gpuq.service.models import Job, table

_t = table(Job).c
# Each limited array's limit and its running tasks' expected ends (epoch s; inf: no time limit).
ArrayLimits = dict[int, tuple[int, list[float]]]

# The tasks of these arrays that hold GPUs now (dispatched or running: what `--array 0-99%4` counts
# against its limit), with what their expected ends are counted from.
_ARRAY_TASKS_STARTED = (select(_t.array_id, _t.started_at, _t.time_limit_s)
                        .where(_t.array_id.in_(bindparam("arrays", expanding=True)),
                               _t.state.in_((State.DISPATCHED, State.RUNNING))))


def within_array_limits(conn: Any, pending: Sequence[Any], jobs: list[policy.JobRequest], hours: dict[str, float],
                        not_eligible: dict[int, str], now: datetime
                        ) -> tuple[list[policy.JobRequest], list[policy.JobRequest], ArrayLimits]:
    """``jobs`` less the tasks of arrays at their limit (`--array 0-99%4`), which wait for "array
    limit" (in ``not_eligible``): of an array whose tasks hold GPUs N times short of its limit,
    only its first N eligible tasks in queue order are considered, as SLURM's array throttle. Also
    the tasks held back, and each limited array's limit and its running tasks' expected ends (for
    ``forecast.start_times``).

    Whatever this pass places or lists on a GPU's next-up list comes from those N, so no more than
    the limit start before the next pass counts again."""
    limit: dict[int, int] = {}
    for row in pending:
        if row.array_limit is not None:
            # An update may have changed some tasks' limit and not others': the lowest.
            limit[row.array_id] = min(limit.get(row.array_id, row.array_limit), row.array_limit)
    if not limit:
        return jobs, [], {}
    ends: dict[int, list[float]] = {array: [] for array in limit}
    for array, started, seconds in conn.execute(_ARRAY_TASKS_STARTED, {"arrays": sorted(limit)}):
        ends[array].append((started or now).timestamp() + seconds if seconds else math.inf)
    room = {array: max(most - len(ends[array]), 0) for array, most in limit.items()}
    kept, throttled = [], []
    for job in sorted(jobs, key=lambda j: policy.order_key(j, hours)):
        if job.array is not None:
            if room[job.array] == 0:
                not_eligible[job.id] = policy.ARRAY_LIMIT
                throttled.append(job)
                continue
            room[job.array] -= 1
        kept.append(job)
    return kept, throttled, {array: (most, ends[array]) for array, most in limit.items()}


_STARTED_NAMES = (select(_t.user, _t.name).distinct()
                  .where(_t.state.in_((State.DISPATCHED, State.RUNNING)),
                         _t.user.in_(bindparam("users", expanding=True)),
                         _t.name.in_(bindparam("names", expanding=True))))


def started_names(conn: Any, users: Sequence[str], names: Sequence[str]) -> set[tuple[str, str]]:
    """Which of these users' job names a job holds GPUs under now (dispatched or running), as
    (user, name): what a `--dependency singleton` job of that user and name waits for."""
    return {(user, name) for user, name in conn.execute(_STARTED_NAMES, {"users": sorted(set(users)),
                                                                         "names": sorted(set(names))})}


def one_singleton_each(conn: Any, pending: Sequence[Any], jobs: list[policy.JobRequest],
                       hours: dict[str, float], not_eligible: dict[int, str]) -> list[policy.JobRequest]:
    """``jobs`` less the `--dependency singleton` jobs that must wait (for "dependency", in
    ``not_eligible``): each whose user has a job of its name holding GPUs, and of those left, each
    but the first in queue order of its user and name. So one such job at a time starts under a
    name, and from this pass only, never from a next-up list (``JobRequest.singleton``). Only jobs
    ready otherwise count: one that waits for its ``--after`` or a begin time keeps no other back
    (and so no two of them can wait for each other)."""
    name_of = {row.id: (row.user, row.name) for row in pending if row.singleton}
    ready = [j for j in jobs if j.id in name_of]
    if not ready:
        return jobs
    taken = started_names(conn, [name_of[j.id][0] for j in ready], [name_of[j.id][1] for j in ready])
    kept = []
    for job in sorted(jobs, key=lambda j: policy.order_key(j, hours)):
        if job.id in name_of:
            if name_of[job.id] in taken:
                not_eligible[job.id] = policy.DEPENDENCY
                continue
            taken.add(name_of[job.id])
        kept.append(job)
    return kept
