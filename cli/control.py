"""Steering the queue: `gpuq why`, `gpuq hold`, `gpuq release` and `gpuq update` (through the
server), `gpuq drain` and `gpuq resume` (admin commands on the database, like the services they steer)."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpuq.cli import numbers
from gpuq.cli.client import Client
from gpuq.cli.ends import selected
from gpuq.cli.render import mib, print_json, printable, time_limit, timestamp
from gpuq.service import constants as c
from gpuq.service.errors import InvalidSpec

if TYPE_CHECKING:
    from gpuq.service.settings import Settings

app = typer.Typer()

JobIds = Annotated[list[int] | None, typer.Argument(help="Job ids.", parser=numbers.job_id)]
Array = Annotated[int | None, typer.Option(help="Every job of this array.", parser=numbers.job_id)]


@app.command()
def why(job_id: Annotated[int, typer.Argument(help="The job's id.", parser=numbers.job_id)],
        as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Why a job waits (or how it ended), in a sentence with the figures."""
    answer = Client().get(f"/jobs/{job_id}/why")
    if as_json:
        print_json(answer)
    else:
        typer.echo(printable(answer["why"]))  # it quotes a job's reason, which a user's file can write


@app.command()
def hold(job_ids: JobIds = None, array: Array = None) -> None:
    """Keep pending jobs from starting until `gpuq release`."""
    _each(job_ids, array, "hold", "held")


@app.command()
def release(job_ids: JobIds = None, array: Array = None) -> None:
    """Let held jobs start again."""
    _each(job_ids, array, "release", "released")


@app.command()
def requeue(job_ids: JobIds = None, array: Array = None,
            hold: Annotated[bool, typer.Option("--hold", help="Wait held until `gpuq release` (as scontrol "
                                               "requeuehold).")] = False) -> None:
    """Put running jobs back in the queue under their ids (as scontrol requeue): stopped as a
    cancel stops them, they wait again and rerun from the start; the attempt stays in their record."""
    _each(job_ids, array, "requeue", "requeued and held" if hold else "requeued", hold=hold)


def _each(job_ids: list[int] | None, array: int | None, move: str, done: str, **body: Any) -> None:
    """``move`` (hold, release, requeue) asked of the jobs named and an array's, in one request
    (``body``: its options), each job's outcome said (``_report``)."""
    client = Client()
    targets = selected(client, job_ids, array)
    answer = client.post(f"/jobs/{move}", {"ids": targets, **body})["jobs"]
    _report(answer, set(job_ids or []), array, lambda outcome: f"job {outcome['id']} {done}", done,
            lambda outcome: outcome["not"])


_NOT_CHANGED = re.compile(r"job \d+ (?:is )?(.+?)(?:; (.+))?")
# What a refusal says after its state that the state already says (held, released, updated): left
# out of an array's line. What else it says (who may raise a time limit) is kept.
_SAID_BY_STATE = re.compile(r"only a pending job(?:'s priority)? can be \w+|an ended job cannot be changed")


def array_changed(array: int, done: str, changed: int, refusals: list[str]) -> str:
    """The line `gpuq hold --array` (`release`, `update --array`) prints: how many tasks were held
    (released, updated), and how many were not, by why: ``held 1,200 jobs of array 7; not 600
    running, 200 already held``."""
    line = f"{done} {changed:,} job{'' if changed == 1 else 's'} of array {array}"
    why = Counter(_why_not(r) for r in refusals)
    if not why:
        return line
    return f"{line}; not " + ", ".join(f"{n:,} {state}" for state, n in sorted(why.items(), key=lambda kv: -kv[1]))


def _why_not(refusal: str) -> str:
    """A task's refusal without its job id, so that an array's are counted by why:
    "job 5 is running; only a pending job can be held" → "running"."""
    found = _NOT_CHANGED.fullmatch(refusal)
    if found is None:
        return refusal
    state, more = found.groups()
    return state if more is None or _SAID_BY_STATE.fullmatch(more) else f"{state}: {more}"


@app.command()
def update(job_ids: JobIds = None, array: Array = None,
           priority: Annotated[int | None, typer.Option(help="A pending job's new priority (higher first).",
                                                        parser=numbers.integer)] = None,
           time: Annotated[str | None, typer.Option("--time", help="The new time limit (2h, 30m, or SLURM's 90, "
                                                   "1:30:00, 2-0:00); once a job has started, only root and "
                                                   "the admins may raise it.")] = None,
           name: Annotated[str | None, typer.Option(help="A new name (one job at a time).")] = None,
           retries: Annotated[int | None, typer.Option(help="How many times a failure runs it again.",
                                                       parser=numbers.whole(0))] = None,
           array_limit: Annotated[int | None, typer.Option(
               "--array-limit", help="How many of an array's tasks may run at once (as --array 0-99%4; "
                                     "0: no limit).", parser=numbers.whole(0))] = None,
           begin: Annotated[str | None, typer.Option("--begin", help="A pending job's new begin time (as "
                                                     "submit's; now: at once).")] = None,
           deadline: Annotated[str | None, typer.Option("--deadline", help="A pending job's new deadline (as "
                                                        "submit's; none: no deadline).")] = None,
           gpus: Annotated[numbers.GpuAsk | None, typer.Option(
               "--gpus", "-G", help="A pending job's new number of GPUs; TYPE:COUNT (a100:2) with its type.",
               show_default=False, parser=numbers.gpu_count)] = None,
           gpu_type: Annotated[str | None, typer.Option("--gpu-type", help="A pending job's new GPU model (any: "
                                                        "no type).")] = None,
           mem: Annotated[str | None, typer.Option("--mem", help="A pending job's new GPU memory per GPU, e.g. 20G "
                                                   "(a shared job's share; none: no memory asked).")] = None,
           node: Annotated[str | None, typer.Option("--node", help="A pending job's new node (any: no node "
                                                    "asked).")] = None,
           shared: Annotated[bool | None, typer.Option("--shared/--whole", help="A pending job shares its GPU "
                                                       "by its --mem with other --shared jobs, or runs on "
                                                       "whole GPUs again.", show_default=False)] = None,
           preemptible: Annotated[bool | None, typer.Option("--preemptible/--no-preemptible", help="The job runs on "
                                                            "GPUs no other job waits for and is requeued when one "
                                                            "does, or no longer (a started one: its owner may make "
                                                            "it preemptible, only an admin not).",
                                                            show_default=False)] = None,
           cpus: Annotated[str | None, typer.Option("--cpus", "-c", help="A pending command's CPU cores, e.g. 4 "
                                                    "or 0.5 (none: no limit).")] = None,
           host_mem: Annotated[str | None, typer.Option("--host-mem", help="A pending command's host memory, "
                                                        "e.g. 8G (none: no limit).")] = None,
           requeue: Annotated[bool | None, typer.Option("--requeue/--no-requeue", help="Run it again (or never) "
                                                        "when the machinery fails under it (its worker or GPU "
                                                        "lost, its GPU failed).", show_default=False)] = None,
           after: Annotated[str | None, typer.Option(help="A pending job starts after these jobs succeeded "
                                                     "(ID[,ID]), instead of what it waited for.")] = None,
           after_any: Annotated[str | None, typer.Option(help="A pending job starts after these jobs ended, "
                                                         "in any state.")] = None,
           exclude: Annotated[str | None, typer.Option("--exclude", "-x", help="A pending job's nodes it may not "
                                                       "run on (NODE[,NODE]; none: none).")] = None,
           dependency: Annotated[str | None, typer.Option("--dependency", "-d", help="sbatch's form: "
                                                          "afterok:ID[:ID], afterany:, afternotok:, after:, "
                                                          "singleton; none: wait for nothing.")] = None,
           ) -> None:
    """Change jobs after their submit: a pending job's priority, GPUs, GPU type, memory, node,
    sharing, CPU cores, host memory, dependencies and deadline, a time limit, preemptibility,
    requeue, a name, retries, an array's tasks at once (as `scontrol update job`)."""
    from gpuq.cli.submit import typed

    if begin is not None:  # the user's own clock and zone read it
        from gpuq.service.units import begin_here

        begin = begin_here(begin)
    if deadline is not None and deadline.strip().lower() != "none":
        from gpuq.service.units import begin_here

        deadline = begin_here(deadline, "--deadline")
    count, gpu_type = typed(gpus, gpu_type)
    changes = {k: v for k, v in (("priority", priority), ("time", time), ("name", name), ("retries", retries),
                                 ("array_limit", array_limit), ("begin", begin), ("deadline", deadline),
                                 ("gpus", count),
                                 ("gpu_type", gpu_type), ("mem", mem), ("node", node), ("shared", shared),
                                 ("preemptible", preemptible), ("cpus", cpus), ("host_mem", host_mem),
                                 ("requeue", requeue), ("after", after),
                                 ("after_any", after_any),
                                 ("dependency", dependency), ("exclude", exclude))
               if v is not None}
    if not changes:
        raise InvalidSpec(c.UPDATE_ASK)  # before a round trip; the server asks the same
    client = Client()
    targets = selected(client, job_ids, array)
    answer = client.post("/jobs/update", {"ids": targets, **changes})["jobs"]
    _report(answer, set(job_ids or []), array, _changed, "updated", _not_updated)


def _limit(seconds: int | None) -> str:
    """A time limit as every front-end writes it (``display.time_limit``), or "none"."""
    return "none" if seconds is None else time_limit(seconds)


# How `gpuq update` names each field it changed, and writes its values.
_FIELDS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "priority": ("priority", str), "time_limit_s": ("time limit", _limit), "name": ("name", str),
    "max_retries": ("retries", str), "array_limit": ("array limit", lambda v: "none" if v is None else str(v)),
    "begin_at": ("begin", lambda v: "none" if v is None else timestamp(v)),
    "deadline_at": ("deadline", lambda v: "none" if v is None else timestamp(v)), "gpus": ("GPUs", str),
    "gpu_type": ("GPU type", lambda v: "any" if v is None else v),
    "mem_mib": ("GPU memory", lambda v: "none" if v is None else mib(v)),
    "on_node": ("node", lambda v: "any" if v is None else v),
    "shared": ("sharing", lambda v: "shared" if v else "whole GPUs"),
    "preemptible": ("preemptible", lambda v: "yes" if v else "no"),
    "requeue": ("requeue", lambda v: "as its retries say" if v is None else "yes" if v else "no"),
    "cpus": ("CPU cores", lambda v: "none" if v is None else f"{v:g}"),
    "host_mem_mib": ("host memory", lambda v: "none" if v is None else mib(v)),
    "dependency": ("dependency", lambda v: "none" if v is None else v),
    "exclude_nodes": ("excluded nodes", lambda v: "none" if not v else ",".join(v))}


def _changed(outcome: dict[str, Any]) -> str:
    parts = [f"{_FIELDS[f][0]} {_FIELDS[f][1](old)} → {_FIELDS[f][1](new)}"
             for f, (old, new) in outcome["changed"].items()]
    return f"job {outcome['id']}: " + (", ".join(parts) if parts else "unchanged (it has these values already)")


def _not_updated(outcome: dict[str, Any]) -> str | None:
    """Why an array's task was not updated, or None. One that has these values already refused nothing
    (named by id it is "unchanged", no error), but the array's line counts it apart from those updated."""
    return outcome["not"] or (None if outcome["changed"] else "with these values already")


def _report(answer: list[dict[str, Any]], named: set[int], array: int | None,
            done: Callable[[dict[str, Any]], str], verb: str, why_not: Callable[[dict[str, Any]], str | None]) -> None:
    """Each job's outcome of one request on many (``answer``). A job named by its id that refused the
    change (it runs, or is held already) is an error: a line on stderr and, once the others are done,
    exit 4, as scontrol exits non-zero when one job of its list fails. An array's other tasks are one
    line (``array_changed``: ``verb``, those ``why_not`` gives no reason for, and the others counted by
    it), as `gpuq cancel --array` counts them (10,000 tasks were 10,000 lines): its running and ended
    tasks are expected, and exit 4 only when every one of them refused."""
    refused = []
    for outcome in answer:
        if outcome["id"] not in named:
            continue
        if outcome["not"] is None:
            typer.echo(done(outcome))
        else:
            refused.append(outcome["not"])
    tasks = [o for o in answer if o["id"] not in named]
    if array is not None:
        reasons = [why for why in map(why_not, tasks) if why is not None]
        typer.echo(array_changed(array, verb, len(tasks) - len(reasons), reasons))
    for why in refused:
        typer.echo(f"gpuq: {why}", err=True)
    if refused or (tasks and all(o["not"] is not None for o in tasks)):
        raise typer.Exit(c.EXIT_CONFLICT)  # nothing of the array could change, as for one job that could not be


@app.command()
def drain(nodes: Annotated[list[str], typer.Argument(help="The nodes' names: one, or several at once; ALL for "
                                                        "every node.")],
          reason: Annotated[str | None, typer.Option(help="Why, for `gpuq why` and `gpuq status`.")] = None,
          at: Annotated[str | None, typer.Option(
              "--at", help="Drain them then, not now (a maintenance window's start): until then only jobs whose "
                           "time limit ends by then start there. A time of day (09:00), a date and time "
                           "(2026-12-24T09:00) or a wait (2h).")] = None,
          until: Annotated[str | None, typer.Option(
              "--until", help="The window's end, from which the nodes are in service again by themselves: a time "
                              "(its next coming after --at), or a length from --at, else from now (3h). Alone, it "
                              "moves the end of the window a node has, or makes one from now. Without it the nodes "
                              "stay drained until `gpuq resume`.")] = None,
          ) -> None:
    """Let nodes' running jobs finish and start nothing new there, now or from --at on, until
    resumed or --until: all the nodes named, or none (an admin command: it uses the database)."""
    if at is not None or until is not None:
        _plan_drains(nodes, at, until, reason)
        return
    for node, only_reason in _set_drained(nodes, True, reason):
        if only_reason:
            typer.echo(f"node {node} was drained already; its reason is now: {printable(reason or '')}")
        else:
            typer.echo(f"node {node} drained: running jobs finish, nothing new starts there")


@app.command()
def resume(nodes: Annotated[list[str], typer.Argument(help="The nodes' names: one, or several at once; ALL for "
                                                         "every node.")]) -> None:
    """Undo `gpuq drain`: ends a drain or a maintenance window, or calls one to come off, on all the
    nodes named or none (an admin command: it uses the database)."""
    for node, _ in _set_drained(nodes, False, None):
        typer.echo(f"node {node} resumed")


@app.command()
def retire(node: Annotated[str, typer.Argument(help="The node's name.")],
           gpu: Annotated[list[int] | None, typer.Option("--gpu", help="Only this GPU (an index; again for more).",
                                                         parser=numbers.whole(0))] = None) -> None:
    """Take a node's GPUs (or one) off gpuq's lists once their workers are gone for good (an admin
    command: it uses the database)."""
    from gpuq.service import inventory
    from gpuq.service.db import write_scope

    settings, admin = _admin_database("retire")
    with write_scope(settings) as session:
        gone = inventory.retire(session, settings, node, gpu)
    which = f"GPU{'s' if len(gone) != 1 else ''} {','.join(map(str, gone))} of node {printable(node)}"
    _audit(settings, f"retire by {admin} (uid {os.getuid()}): {which}")
    typer.echo(f"retired {which}: no longer listed or counted; a worker that starts on one brings it back")


def _admin_database(command: str) -> tuple[Settings, str]:
    """An admin command's settings, its database's schema checked (one line and 78 where it is
    not there), and who runs it: the process's user (only root and gpuq's own account open the
    database), and the one who became root through sudo (sudo sets SUDO_USER for root's process)."""
    from gpuq.cli.stack import admin_settings
    from gpuq.service.db import require_schema
    from gpuq.service.rights import Caller

    settings = admin_settings(command)
    require_schema(settings)
    me = Caller.of_uid(os.getuid()).user
    via = os.environ.get("SUDO_USER")
    return settings, f"{via} via sudo" if os.getuid() == 0 and via and via != me else me


def _plan_drains(nodes: list[str], at: str | None, until: str | None, reason: str | None) -> None:
    from datetime import datetime

    from gpuq.service import broker, node_drains
    from gpuq.service.db import write_scope
    from gpuq.service.display import window_span
    from gpuq.service.units import parse_begin

    now = datetime.now().astimezone()
    start = parse_begin(at, now, "--at") if at is not None else None
    # The end's time of day is its next coming after --at; a length counts from --at, else from now.
    end = parse_begin(until, (start or now).astimezone(), "--until") if until is not None else None
    settings, admin = _admin_database("drain")
    with write_scope(settings) as session:  # every node's window, or none
        nodes = node_drains.named(session, nodes)
        planned = [(node, node_drains.plan(session, node, start, end, reason, by=admin)) for node in nodes]
        windows = {node: node_drains.window_of(session, node) for node in nodes}
    broker.wake_scheduler(settings)
    for node, before in planned:
        begins, ends = windows[node]
        span = window_span(begins, ends)
        _audit(settings, f"drain by {admin} (uid {os.getuid()}): node {printable(node)} {span}"
               + (f" (reason: {printable(reason)})" if reason else ""))
        was = ""
        if before is not None:
            was = f" (it was to drain {window_span(*before)})"
        then = ("until then only jobs whose time limit ends by then start there"
                if begins > datetime.now().astimezone() else "running jobs finish, nothing new starts there")
        back = "it is in service again at its end" if ends is not None else "`gpuq resume` ends it"
        typer.echo(f"node {node} drains {span}{was}: {then}; {back}")


def _set_drained(nodes: list[str], drained: bool, reason: str | None) -> list[tuple[str, bool]]:
    """Drain (or resume) every node named, or none; each node and whether only its reason changed."""
    from gpuq.service import broker, node_drains
    from gpuq.service.db import write_scope

    action = "drain" if drained else "resume"
    settings, admin = _admin_database(action)
    with write_scope(settings) as session:
        nodes = node_drains.named(session, nodes)
        done = [(node, node_drains.set_drained(session, node, drained, reason, by=admin)) for node in nodes]
    for node, _ in done:
        _audit(settings, f"{action} by {admin} (uid {os.getuid()}): node {printable(node)}"
               + (f" (reason: {printable(reason)})" if drained and reason else ""))
    if not drained:
        broker.wake_scheduler(settings)
    return done


def _audit(settings: Any, line: str) -> None:
    """The change in the server's audit trail (``gpuq.audit`` in logs/server.log, server/audit.py),
    where the stack on this host keeps it; a host with no stack's logs gets none. The change is
    made: a line that cannot be written is said on stderr, not an error."""
    from gpuq.service.logs import append_line

    log = settings.log_dir / "server.log"
    if not settings.log_dir.is_dir():
        return
    try:
        append_line(log, "gpuq.audit", line)
    except OSError as e:
        typer.echo(f"gpuq: the change is made, but its audit line could not be written to {log}: "
                   f"{e.strerror or e}", err=True)
