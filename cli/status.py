"""`gpuq status` (the queue and the GPUs) and `gpuq workloads` (what can be submitted)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer

from gpuq.cli import job_fields, numbers
from gpuq.cli.client import Client
from gpuq.cli.job_fields import coloured, gpus_cell
from gpuq.cli.render import (
    drain_reasons,
    job_name,
    json_text,
    mib,
    print_json,
    reserved_lines,
    timestamp,
)
from gpuq.cli.table import Cell, colours_wanted, delimited, render
from gpuq.service import units
from gpuq.service.display import idle_note as idle_note_of
from gpuq.service.display import in_queue_order
from gpuq.service.errors import InvalidSpec, Unreachable

app = typer.Typer()


@app.command()
def status(
    ended: Annotated[int, typer.Option("--ended", "-n", help="How many ended jobs to show.",
                                       parser=numbers.whole(0))] = 10,
    mine: Annotated[bool, typer.Option("--me", help="Only my jobs.")] = False,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Only this user's jobs (as squeue -u).")] = None,
    every_task: Annotated[bool, typer.Option("--array-tasks", "-r", help="A line for each pending task of an array "
                                             "(by default they are one line for each reason they wait, as in squeue).")]
    = False,
    state: Annotated[str | None, typer.Option("--state", "-t", help="Only jobs in these states: pending, running, "
                                              "failed... or squeue's PD, R, F..., comma-separated.")] = None,
    name: Annotated[str | None, typer.Option("--name", help="Only jobs of this name, or a pattern "
                                             "('train*'); an array's name takes its tasks.")] = None,
    ids: Annotated[str | None, typer.Option("--jobs", "-j", metavar="IDS", help="Only these jobs, comma-separated "
                                            "(an array's id takes its tasks), ended ones included (as squeue -j).")]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="Every job, each task of an array included.")] = False,
    noheader: Annotated[bool, typer.Option("--noheader", "-h", help="The job lines alone: no titles, headers, "
                                           "notes or GPUs (as squeue -h), for a script to count or cut.")] = False,
    parsable: Annotated[bool, typer.Option("--parsable", "-P", help="Job lines with their columns separated by | "
                                           "and nothing cut (as sacct -P), under a header line unless -h.")] = False,
    start: Annotated[bool, typer.Option("--start", help="Pending jobs only, with when each is expected to start "
                                        "(as squeue --start), earliest first.")] = False,
    iterate: Annotated[float | None, typer.Option("--iterate", "-i", metavar="SECONDS", min=0.1, max=86400,
                                                  help="Again every this many seconds until Ctrl-C (as squeue -i): "
                                                       "redrawn on a terminal, each under its time when piped.")]
    = None,
    fields: Annotated[str | None, typer.Option("--format", "-o", metavar="FIELDS",
                                               help="The job table's columns, comma-separated (as squeue -o, "
                                                    "sacct --format): id, user, state, cpus, time_left... "
                                                    "(a wrong one lists them all).")] = None,
) -> None:
    """The queue (waiting, running and recently ended jobs) and the GPUs."""
    if mine and user is not None:
        raise InvalidSpec("--me and --user cannot be used together: pick one")
    if user is not None and not user.strip():
        raise InvalidSpec("--user needs a user name (--me for yours)")
    if start:
        if state is not None or name is not None or every_task or ended != 10 or ids is not None:
            raise InvalidSpec("--start lists every pending job: it takes --me, --user and --json, not "
                              "--state, --name, --jobs, --array-tasks or --ended")
    if (noheader or parsable) and as_json:
        raise InvalidSpec("--noheader and --parsable are the table's; --json has neither: give one of them")
    chosen = job_fields.parse(fields) if fields is not None else None
    if chosen is not None and (as_json or start):
        raise InvalidSpec("--format picks the job table's columns: not with --json (every field) or --start")
    if ids is not None:
        units.parse_job_ids(ids, "--jobs")  # said here, before the server is asked (and again each -i)
    form = ("json" if as_json else "parsable lines" if parsable and noheader else "parsable" if parsable
            else "lines" if noheader else "table")
    if iterate is None:
        typer.echo(_listing(ended, mine, user, every_task, state, name, ids, form, start, chosen), nl=False)
        return
    _repeat(iterate, lambda: _listing(ended, mine, user, every_task, state, name, ids, form, start, chosen), as_json)


def _repeat(every: float, listing: Callable[[], str], as_json: bool) -> None:
    """`gpuq status -i`, as squeue -i: the listing again every ``every`` seconds until Ctrl-C. On a
    terminal the screen is redrawn under a line saying when (as watch does); piped, each listing
    follows its time line (with --json, one document a line), for a log of the queue."""
    import sys
    import time
    from datetime import UTC, datetime

    redraw = sys.stdout.isatty() and not as_json
    try:
        text = listing()  # a first that fails ends it, as a `gpuq status` would: the server named is wrong
        while True:
            if as_json:
                typer.echo(json.dumps(json.loads(text)))
            else:
                head = f"every {every:g}s: gpuq status    {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC (Ctrl-C stops)"
                typer.echo(("\x1b[H\x1b[2J" if redraw else "") + head + "\n\n" + text, nl=not redraw)
            sys.stdout.flush()
            time.sleep(every)
            try:  # asked before the screen is cleared: no blank screen while it waits
                text = listing()
            except Unreachable as gone:  # a server restarting: said in the listing's place, and asked again
                text = json_text({"error": str(gone)}) if as_json else f"gpuq: {gone}\n"
    except KeyboardInterrupt:
        pass


def _listing(ended: int, mine: bool, user: str | None, every_task: bool, state: str | None, name: str | None,
             ids: str | None, form: str, start: bool, chosen: list[str] | None = None) -> str:
    """What `gpuq status` prints once, asked of the server now: as a ``form`` of "table" (titles,
    headers, the GPUs), "lines" (the job lines alone, `-h`), "parsable" (split by |, `-P`: under
    their header; "parsable lines" without) or "json"; the job table's columns are
    the ``chosen`` fields (`-o`), else the default ones."""
    as_json = form == "json"
    if start:
        return _starts(Client().get("/jobs/start", mine=1 if mine else None, user=user), form)
    collapsed = not (every_task or as_json)
    answer = Client().get("/jobs", ended=ended, mine=1 if mine else None, user=user, state=state, name=name,
                          jobs=ids, arrays="collapsed" if collapsed else None)
    rows, gpus = answer["jobs"], answer["gpus"]
    if as_json:
        return json_text({"jobs": rows, "gpus": gpus})
    colour = colours_wanted()
    idle_note = (idle_note_of(answer["idle_window_s"], answer.get("idle_limit_s")), "yellow")
    exempt_note = (idle_note_of(answer["idle_window_s"], None), "yellow")  # GPUQ_IDLE_LIMIT_EXEMPT's users
    exempt = set(answer.get("idle_limit_exempt") or ())
    fields = chosen or job_fields.STATUS_DEFAULT
    header, right = job_fields.columns(fields)
    queue = []
    if form.startswith("parsable"):
        whole = [job_fields.cells(fields, j, whole=True) for j in in_queue_order(rows, answer.get("arrays") or [])]
        return _parsable(header, whole, form)
    for j in in_queue_order(rows, answer.get("arrays") or []):
        line = job_fields.cells(fields, j)
        if chosen is None and j["idle"]:  # the default table says so where the result would be
            line[-1] = exempt_note if j["user"] in exempt else idle_note
        queue.append(line)
    if form == "lines":
        return render("jobs", header, queue, right, colour, headed=False) + "\n" if queue else ""
    devices = [row for g in gpus for row in _gpu_rows(g)]
    lines = [render("jobs", header, queue, right, colour) if queue else "no jobs", "",
             render("gpus", ("NODE", "GPU", "NAME", "MEMORY", "UTIL", "STATE", "JOB"), devices,
                    frozenset({"GPU", "UTIL"}), colour) if gpus else
             "no GPUs registered: start the workers with `gpuq up`"]
    # A drained node's GPUs carry its reason: one line for the node.
    lines += drain_reasons(gpus, {g["node"]: g["drain_reason"] for g in gpus if g.get("node_drained")},
                           {g["node"]: g["node_drain_ahead"] for g in gpus if g.get("node_drain_ahead")})
    lines += reserved_lines(gpus)
    return "\n".join(lines) + "\n"


def _starts(answer: dict[str, Any], form: str) -> str:
    """`gpuq status --start`: each pending job and its expected start, or why none is known."""
    if form == "json":
        return json_text(answer)
    width = job_fields.WHOLE if form.startswith("parsable") else 30
    rows = [[str(j["id"]), j["user"], job_name(j["name"], width), gpus_cell(j),
             timestamp(j["start"]) if j["start"] else "n/a", j.get("planned_node") or "-", j["reason"] or "-"]
            for j in answer["jobs"]]
    columns = ("ID", "USER", "NAME", "GPUS", "START", "NODE", "REASON")
    if form.startswith("parsable"):
        return _parsable(columns, rows, form)
    if form == "lines":
        return render("pending", columns, rows, frozenset({"ID", "GPUS"}), colours_wanted(), headed=False) + "\n" \
            if rows else ""
    if not rows:
        return "no pending jobs\n"
    return (render("pending", columns, rows, frozenset({"ID", "GPUS"}), colours_wanted()) + "\n"
            + "START: expected if the jobs before each run to their time limits (jobs that end sooner bring it "
              "forward; n/a: a job before it has no limit, or it waits for something else); NODE: where it is "
              "planned (as squeue --start's SCHEDNODES)\n")


def _parsable(header: Sequence[str], rows: Sequence[Sequence[Cell]], form: str) -> str:
    """The job lines split by | (`-P`), under their header unless ``form`` is "parsable lines" (`-h`)."""
    text = delimited(header, rows, headed=form == "parsable")
    return text + "\n" if text else ""


def _gpu_rows(g: dict[str, Any]) -> list[list[Any]]:
    """A GPU's line, or on a GPU shared by small jobs a line for each, with what it uses of its share."""
    head = [g["node"], str(g["index"]), g["name"]]
    util = "n/a" if g["utilization"] is None else f"{g['utilization']}%"
    shares = g.get("shares") or []
    if not shares:
        return [[*head, f"{mib(g['memory_used_mib'])} / {mib(g['memory_total_mib'])}", util, coloured(_gpu_state(g)),
                 f"{g['job_id']} ({g['job_user'] or ''})" if g["job_id"] else "-"]]
    state = coloured(_gpu_state(g))
    return [[*head, f"{mib(s['used_mib'])} of {mib(s['share_mib'])} share", util, state,
             f"{s['job_id']} ({s['user'] or ''})"] for s in shares]


def _gpu_state(g: dict[str, Any]) -> str:
    shared = len(g.get("shares") or [])
    state = "offline" if not g["online"] else ("busy" if g["job_id"] else f"shared by {shared}" if shared else "idle")
    if g["drained"]:
        state += " (drained)"
    if g["foreign_mib"]:
        state += f" +{mib(g['foreign_mib'])} foreign"
    return state


@app.command()
def workloads(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """The built-in workloads, with their parameters and defaults."""
    catalogue = Client().get("/workloads")
    if as_json:
        print_json({name: w | {"params": {p: {k: v for k, v in spec.items() if k != "flag"}
                                          for p, spec in w["params"].items()}}
                    for name, w in catalogue.items()})
        return
    for name, w in catalogue.items():
        lo, hi = w["min_gpus"], w["max_gpus"]
        gpus = f"{lo}" if hi == lo else f"{lo}-{hi or 'any'}"
        typer.echo(f"{name}  ({gpus} GPU{'s' if gpus != '1' else ''})\n    {w['summary']}")
        for p in w["params"].values():
            extra = f" [{'|'.join(p['choices'])}]" if p["choices"] else ""
            typer.echo(f"    {p['flag']:<18} {p['help']}{extra} (default {p['default']})")
        typer.echo("")
