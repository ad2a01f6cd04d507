"""The ends of jobs: the jobs a command names (ids, an array, all of yours, or yours by name and
state), waiting for them to end (`gpuq wait`) and ending them (`gpuq cancel`)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from typer.core import TyperCommand

from gpuq.cli import numbers
from gpuq.cli.client import Client, Overdue, Refused
from gpuq.cli.progress import bar, wanted
from gpuq.cli.render import print_json
from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.errors import InvalidSpec

if TYPE_CHECKING:
    import click

app = typer.Typer()


def selected(client: Client, job_ids: list[int] | None, array: int | None, mine: bool = False,
             ride_out: bool = False, deadline: float | None = None, name: str | None = None,
             state: str | None = None, user: str | None = None) -> list[int]:
    """The jobs a command acts on: ids, an array's jobs, or (cancel) the caller's active jobs
    (``user``'s, where root or an admin names another), of ``name`` and in ``state`` where given.
    ``ride_out`` and ``deadline`` as for ``Client.get``."""
    if mine and (job_ids or array is not None):
        # scancel -u USER ID narrows to that user's; a union here would cancel every job of theirs.
        whose = f"-u {user} cancels all of {user}'s jobs" if user else "--me cancels all your jobs"
        raise InvalidSpec(f"{whose}: give it alone, without job ids or --array")
    chosen = list(job_ids or [])
    if chosen:
        states_of(client, chosen, ride_out, deadline)  # every id must exist
    if array is not None:
        chosen += [r["id"] for r in client.get(f"/arrays/{array}", ride_out=ride_out, deadline=deadline)["jobs"]]
    if mine:
        chosen += client.get("/jobs/active", name=name, state=state, user=user)["ids"]
    if not chosen and not mine:
        raise InvalidSpec("name the jobs: ids, --array ID")
    return list(dict.fromkeys(chosen))


# Jobs `gpuq wait` names when it gives up: the line stays one line for an array of 10,000.
WAITING_SHOWN = 5
# Job ids asked about in one request: a query string of 500 ids stays under the server's 8 KiB
# request line (an array of 10,000 tasks is 20 requests a look).
STATES_PER_REQUEST = 500


def states_of(client: Client, job_ids: list[int], ride_out: bool = False,
              deadline: float | None = None) -> dict[int, str]:
    """Each job's state; Refused (exit 3) if one does not exist. ``ride_out``: wait for a server
    that restarts, until ``deadline`` at most (``Client.get``)."""
    states: dict[int, str] = {}
    for start in range(0, len(job_ids), STATES_PER_REQUEST):
        chunk = job_ids[start:start + STATES_PER_REQUEST]
        answer = client.get("/jobs/states", ride_out=ride_out, deadline=deadline,
                            ids=",".join(map(str, chunk)))["states"]
        states.update((int(k), v) for k, v in answer.items())
    return states


def until_ended(client: Client, job_ids: list[int], deadline: float | None,
                 advance: Callable[[int, str], None] | None = None) -> dict[int, str]:
    """The jobs' states once all have ended, or as last seen when ``deadline`` (time.monotonic())
    passed; ``advance(ended, text)`` is told how many have ended after each look. A server that
    restarts meanwhile is waited for (client.RIDE_OUT_SECONDS), but not past the deadline: the
    jobs go on without it, and the caller's timeout is its own. A job never seen has no state."""
    states: dict[int, str] = {}
    while True:
        # An end state is final: each look asks only about the jobs that had not ended.
        try:
            states.update(states_of(client, [j for j in job_ids if states.get(j) not in c.END_STATES],
                                    ride_out=True, deadline=deadline))
        except Overdue:
            return states
        if advance is not None:
            ended = sum(s in c.END_STATES for s in states.values())
            advance(ended, f"{ended} of {len(job_ids)} jobs ended")
        if all(s in c.END_STATES for s in states.values()):
            return states
        if deadline is not None and time.monotonic() >= deadline:
            return states
        time.sleep(c.CLIENT_POLL_SECONDS)


@app.command()
def wait(job_ids: Annotated[list[int] | None, typer.Argument(help="Job ids.", parser=numbers.job_id)] = None,
         array: Annotated[int | None, typer.Option(help="Every job of this array.", parser=numbers.job_id)] = None,
         timeout: Annotated[float | None, typer.Option(min=0, help="Give up after this many seconds.")] = None,
         quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
         progress: Annotated[bool | None, typer.Option("--progress/--no-progress", show_default=False,
                                                       help="A bar of jobs ended (default: on a terminal).")]
         = None,
         as_json: Annotated[bool, typer.Option("--json", help="The jobs' end states as JSON.")] = False) -> None:
    """Block until the jobs end; exit 0 only if all of them succeeded."""
    # The timeout is the whole command's: a server away meanwhile does not stretch it.
    deadline = None if timeout is None else time.monotonic() + timeout
    client = Client()
    try:
        # A wait is a follower from its first read: a server restarting as it begins is waited for.
        job_ids = selected(client, job_ids, array, ride_out=True, deadline=deadline)
    except Overdue:
        # Timed out before the server answered once: the jobs, if named, with no state seen.
        if as_json:
            print_json({str(j): None for j in job_ids or []})
        _timed_out(timeout or 0.0, _still_waiting(list(job_ids or []), {}) or f"the jobs of array {array}")
    show = not quiet and not as_json and wanted(progress, sys.stderr)
    try:
        with bar(len(job_ids), f"0 of {len(job_ids)} jobs ended", show=show, stream=sys.stderr) as advance:
            states = until_ended(client, job_ids, deadline, advance)
    except KeyboardInterrupt:
        typer.echo("gpuq: stopped waiting; the jobs go on", err=True)  # a wait changes nothing of them
        raise typer.Exit(c.EXIT_RUN_CANCELLED) from None
    if as_json:
        print_json({str(j): states.get(j) for j in job_ids})
    left = _still_waiting(job_ids, states)
    if left:
        _timed_out(timeout or 0.0, left)
    if not quiet and not as_json:
        for job_id in job_ids:
            typer.echo(f"job {job_id} {states[job_id]}")
    if any(s != State.SUCCEEDED for s in states.values()):
        raise typer.Exit(c.EXIT_JOB_FAILED)


def _still_waiting(job_ids: list[int], states: dict[int, str]) -> str:
    """The jobs not ended, as the timed-out line names them ("job 4 (running), 5 (unknown)"); "" if none."""
    left = [f"{j} ({states.get(j, 'unknown')})" for j in job_ids if states.get(j) not in c.END_STATES]
    more = f" and {len(left) - WAITING_SHOWN} more" if len(left) > WAITING_SHOWN else ""
    return f"job {', '.join(left[:WAITING_SHOWN])}{more}" if left else ""


def _timed_out(timeout: float, left: str) -> NoReturn:
    """End as a wait whose --timeout ran out ends: one line naming what it still waited for, exit 5."""
    typer.echo(f"gpuq: still waiting after {timeout:g} s: {left}", err=True)
    raise typer.Exit(c.EXIT_TIMEOUT)


class CancelCommand(TyperCommand):
    """`gpuq cancel`'s command line: ``-u``/``--user`` names a user, as scancel's does; bare (at the
    end, before an option or an id), as gpuq's ``--user`` flag was, it is ``--me``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = list(args)
        for at, word in enumerate(args):
            if word == "--":
                break
            following = args[at + 1] if at + 1 < len(args) else None
            if word in ("-u", "--user") and (following is None or following.startswith("-") or following.isdigit()):
                args[at] = "--me"
        return super().parse_args(ctx, args)


@app.command(cls=CancelCommand)
def cancel(job_ids: Annotated[list[int] | None, typer.Argument(help="Job ids.", parser=numbers.job_id)] = None,
           array: Annotated[int | None, typer.Option(help="Every job of this array (one summary line).",
                                                     parser=numbers.job_id)]
           = None,
           me: Annotated[bool, typer.Option("--me", help="All my waiting and running jobs (as scancel --me).")]
           = False,
           user: Annotated[str | None, typer.Option("--user", "-u", help="All this user's waiting and running jobs "
                                                    "(as scancel -u): yours, or anyone's for root and the admins.",
                                                    show_default=False, metavar="USER")] = None,
           name: Annotated[str | None, typer.Option("--name", "-n", help="My jobs (or -u's) of this name (an array's "
                                                    "tasks too), or a pattern with * and ? (as scancel -n).")] = None,
           state: Annotated[str | None, typer.Option("--state", "-t", help="My jobs (or -u's) in this state: "
                                                     "pending or running (as scancel -t).")] = None,
           no_wait: Annotated[bool, typer.Option("--no-wait", help="Do not wait for running jobs to stop.")] = False,
           signal: Annotated[str | None, typer.Option("--signal", "-s", help="Send this signal to the running "
                                                      "jobs instead ([B:]SIG, e.g. USR1; B: to the main process "
                                                      "alone), as scancel -s; they go on running.")] = None,
           ) -> None:
    """Cancel jobs: a waiting one at once, a running one by stopping its whole process tree. With
    --signal, send running jobs a signal instead (to save a checkpoint now, say)."""
    if user is not None and not user.strip():
        raise InvalidSpec("-u needs a user name")
    mine = me or user is not None or name is not None or state is not None
    if not job_ids and array is None and not mine:
        raise InvalidSpec("name the jobs: ids, --array ID, --me for all of yours (-u USER for root and the admins), "
                          "or --name / --state")
    if (name is not None or state is not None) and (job_ids or array is not None):
        # scancel narrows ids by them; a union here would cancel every job of that name.
        raise InvalidSpec("--name and --state choose among all your jobs: give them without job ids or --array")
    if signal is not None:
        from gpuq.service.units import JobSignal

        JobSignal.parse_now(signal)  # bad input is refused before any request
    client = Client()
    targets = selected(client, job_ids, array, mine, name=name, state=state, user=user)
    if signal is not None:
        _signal(client, targets, signal, array, set(job_ids or []) if array is not None else set(targets))
        return
    if not targets:
        typer.echo("no active jobs to cancel")
        return
    # One request for them all: the server checks every job before it cancels any.
    answer = client.post("/jobs/cancel", {"ids": targets})
    grace = answer["kill_grace_s"]
    ended = [o for o in answer["jobs"] if o["ended"]]
    if len(targets) == 1 and ended:
        raise Refused(f"job {ended[0]['id']} already ended ({ended[0]['state']})", c.EXIT_CONFLICT)
    # An array's tasks are counted in one line (10,000 of them were 10,000 lines); jobs named by id,
    # or --me's, a line each.
    named = set(targets) if array is None else set(job_ids or [])
    tasks: dict[int, str] = {}  # an array's task → what became of it: its state, or "ended" before the cancel
    stopping = []
    for outcome in answer["jobs"]:
        job_id, state = outcome["id"], outcome["state"]
        if job_id not in named:
            tasks[job_id] = "ended" if outcome["ended"] else state
        elif outcome["ended"]:
            typer.echo(f"job {job_id}: already ended ({state})")
        elif state == State.CANCELLED:
            typer.echo(f"job {job_id} cancelled")
        if not outcome["ended"] and state != State.CANCELLED:
            stopping.append(job_id)
    # Every job had ended, named by id or an array's: nothing was cancelled, as for one such job
    # (exit 4), and as `hold --array` says of an array none of whose tasks changed. Some ended among
    # others is no error.
    conflict = len(ended) == len(targets)
    if stopping and no_wait:
        for job_id in stopping:
            if job_id in named:
                typer.echo(f"job {job_id} cancelling")
    elif stopping:
        # The worker sends SIGTERM, waits kill_grace, then SIGKILLs: wait a little longer than that.
        states = until_ended(client, stopping, time.monotonic() + grace + 15)
        for job_id in stopping:
            state = states.get(job_id)
            if job_id not in named:
                tasks[job_id] = state if state in c.END_STATES else "stopping"
            else:
                typer.echo(f"job {job_id} {state}" if state in c.END_STATES else
                           f"job {job_id} still stopping: its worker has not confirmed yet")
    if array is not None:
        typer.echo(array_cancelled(array, list(tasks.values())))
    if conflict:
        raise typer.Exit(c.EXIT_CONFLICT)


def _signal(client: Client, targets: list[int], signal: str, array: int | None, named: set[int]) -> None:
    """`gpuq cancel --signal`: ask the workers of the running jobs among ``targets`` to send them
    ``signal``; a line for each job in ``named`` (by id, or --me's), one for an array's tasks,
    exit 4 where none of them was running."""
    if not targets:
        typer.echo("no active jobs to signal")
        return
    answer = client.post("/jobs/signal", {"ids": targets, "signal": signal})
    sig, main = answer["signal"], answer["main_only"]
    others: Counter[str | None] = Counter()
    for outcome in answer["jobs"]:
        job_id, why = outcome["id"], outcome["not"]
        if job_id in named:
            typer.echo(f"job {job_id}: {sig} sent" + (" to its main process" if main else "") if why is None
                       else f"job {job_id}: no signal sent: {why}")
        else:
            others[why] += 1
    if others:  # an array's tasks (jobs named by id, or --me's, have a line each)
        sent = others.pop(None, 0)
        rest = "".join(f"; not to {n:,} ({why})" for why, n in sorted(others.items()))
        typer.echo(f"{sig} sent to {'the main processes of ' if main else ''}{sent:,} running "
                   f"job{'' if sent == 1 else 's'} of array {array}{rest}")
    if all(o["not"] is not None for o in answer["jobs"]):
        raise typer.Exit(c.EXIT_CONFLICT)


def array_cancelled(array: int, outcomes: list[str]) -> str:
    """The line `gpuq cancel --array` prints: how many of the array's tasks were cancelled, and
    what became of the others. ``outcomes``: each task's state after the cancel, "ended" for one
    that had ended before it, "stopping" for one whose worker has not confirmed its stop."""
    counts = Counter(outcomes)
    if counts["ended"] == len(outcomes):
        which = "its job" if len(outcomes) == 1 else f"all {len(outcomes):,} of its jobs"
        return f"nothing to cancel in array {array}: {which} had already ended"
    cancelled = counts.pop(State.CANCELLED, 0)
    line = f"cancelled {cancelled:,} job{'' if cancelled == 1 else 's'} of array {array}"
    others = []
    if counts[c.CANCELLING]:
        others.append(f"{counts.pop(c.CANCELLING):,} running, being stopped")
    if counts["stopping"]:
        others.append(f"{counts.pop('stopping'):,} still stopping: their worker has not confirmed yet")
    before = counts.pop("ended", 0)
    # A running task that ended on its own while its worker was being asked to stop it.
    others += [f"{n:,} {state} meanwhile" for state, n in sorted(counts.items()) if n]
    if before:
        others.append(f"{before:,} had already ended")
    return "; ".join([line, *others])
