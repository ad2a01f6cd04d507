"""What the API returns for a job, a GPU and a report: JSON-ready data, the same for every caller.

Only what every user may see is here (squeue's view: states, names, users, resources, results).
A job's output, recorded diff and environment values are added by the routes that check the
caller's rights first; ``job`` never carries them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from gpuq.service import display
from gpuq.service.constants import State
from gpuq.service.jobs import PendingTasks
from gpuq.service.models import Job


def job(j: Job, gpus: list[int] | None = None) -> dict[str, Any]:
    """The job as JSON-ready data (the client's --json output)."""
    return {
        "id": j.id, "name": j.name, "user": j.user, "kind": j.kind, "workload": j.workload,
        "params": j.params, "argv": j.argv, "cwd": j.cwd, "gpus": j.gpus, "priority": j.priority,
        "state": j.state, "reason": j.reason, "node": j.node, "worker": j.worker,
        "gpu_indices": gpus, "exit_code": j.exit_code, "result": j.result,
        "mem_mib": j.mem_mib, "shared": j.shared, "on_node": j.on_node, "exclude_nodes": j.exclude_nodes,
        "time_limit_s": j.time_limit_s,
        "max_retries": j.max_retries, "attempts": j.attempts, "held": j.held, "admin_hold": j.admin_hold,
        "after": j.after, "after_kind": j.after_kind,
        "after_any": j.after_kind == "afterany", "singleton": j.singleton, "array_id": j.array_id,
        "preemptible": j.preemptible, "requeue": j.requeue,
        "array_index": j.array_index, "array_limit": j.array_limit, "output_file": j.output_file,
        "error_file": j.error_file,
        "begin_at": iso(j.begin_at), "deadline_at": iso(j.deadline_at), "signal": j.signal, "gpu_type": j.gpu_type,
        "failure": j.failure, "requeues": j.requeues, "host_mem_mib": j.host_mem_mib, "cpus": j.cpus,
        "submitted_at": iso(j.submitted_at), "dispatched_at": iso(j.dispatched_at),
        "started_at": iso(j.started_at), "ended_at": iso(j.ended_at),
        "git_commit": j.git_commit, "git_dirty": j.git_dirty, "git_diff_cut": j.git_diff_cut,
        "snapshot": j.snapshot, "snapshot_removed_at": iso(j.snapshot_removed_at),
        "cancel_requested_at": iso(j.cancel_requested_at),
    }


def pending_tasks(g: PendingTasks) -> dict[str, Any]:
    """An array's pending tasks that wait for one reason, as one entry of the queue's ``arrays``:
    what a job's line in `gpuq status` shows, with ``ids`` written as ranges and their ``count``."""
    return {"array_id": g.array_id, "first_id": g.ids[0], "ids": display.ranges(g.ids), "count": len(g.ids),
            "user": g.user, "name": g.name, "state": State.PENDING, "gpus": g.gpus, "held": g.held,
            "admin_hold": g.admin_hold,
            "reason": g.reason, "submitted_at": iso(g.submitted_at), "node": None, "elapsed_s": None,
            "idle": False, "result": None, "kind": None, "cancel_requested_at": None}


def iso(t: datetime | None) -> str | None:
    return t.isoformat() if t else None


def plain(value: Any) -> Any:
    """``value`` with its datetimes as ISO text, for a JSON answer."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
