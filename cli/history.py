"""`gpuq history`: the jobs that ended over a period, as sacct lists them: yours by default, any
user's or everyone's, narrowed by end state, name or array, with a count of each state."""

from __future__ import annotations

from typing import Annotated

import typer

from gpuq.cli import job_fields, numbers
from gpuq.cli.client import Client
from gpuq.cli.job_fields import coloured
from gpuq.cli.render import duration, job, job_name, one_line, print_json, result_summary, seconds, timestamp
from gpuq.cli.table import colours_wanted, delimited, render
from gpuq.service.display import exit_status, state_counts
from gpuq.service.errors import InvalidSpec

app = typer.Typer()


@app.command()
def history(
    since: Annotated[str, typer.Option(help="Start: a date, a time or an age (12h, 7d).")] = "1d",
    until: Annotated[str, typer.Option(help="End: a date, a time, an age or now.")] = "now",
    user: Annotated[str | None, typer.Option(help="This user's jobs (default: yours).")] = None,
    everyone: Annotated[bool, typer.Option("--all", "-a", help="Every user's jobs.")] = False,
    state: Annotated[list[str] | None, typer.Option(
        "--state", "-s", help="Only jobs that ended so: succeeded, failed, cancelled, timed_out (repeat, or "
                              "separate by commas).")] = None,
    name: Annotated[str | None, typer.Option(help="Only jobs of this name (an array's tasks too), or a "
                                                  "pattern with * and ?.")] = None,
    array: Annotated[int | None, typer.Option(help="Only the tasks of this array.", parser=numbers.job_id)] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", help="List at most this many, newest first.",
                                       parser=numbers.whole(1))] = 100,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    noheader: Annotated[bool, typer.Option("--noheader", "-h", help="The job lines alone: no title, header or "
                                           "counts (as sacct -n), for a script to count or cut.")] = False,
    parsable: Annotated[bool, typer.Option("--parsable", "-P", help="Columns separated by | with no padding (as "
                                           "sacct -P), under a header line unless -h.")] = False,
    fields: Annotated[str | None, typer.Option("--format", "-o", metavar="FIELDS",
                                               help="The table's columns, comma-separated (as sacct --format): "
                                                    "id, state, exit_code, elapsed, cpu_time, host_mem_peak, "
                                                    "gpu_mem_peak... (a wrong one lists them all).")] = None,
) -> None:
    """The jobs that ended over a period, newest first: how each ended, where, how long it waited and ran."""
    if user is not None and not user.strip():
        raise InvalidSpec("--user needs a user name (or --all for everyone's jobs)")
    if everyone and user:
        raise InvalidSpec("--all and --user cannot be used together: pick one")
    chosen = job_fields.parse(fields, used=True) if fields is not None else None
    if chosen is not None and as_json:
        raise InvalidSpec("--format picks the table's columns: not with --json (every field)")
    if as_json and (noheader or parsable):
        raise InvalidSpec("--noheader and --parsable are the table's; --json has neither: give one of them")
    states = ",".join(s for part in state or [] for s in part.split(",")) or None
    answer = Client().get("/jobs/history", since=since, until=until, state=states, name=name, array=array,
                          limit=limit, user=user, mine=None if everyone or user else 1)
    rows = answer["jobs"]
    if as_json:
        print_json(answer)
        return
    period = f"from {timestamp(answer['since'])} to {timestamp(answer['until'])}"
    if not rows and not (noheader or parsable):
        typer.echo(f"no job ended {period}")
        return
    if chosen is not None:
        header, right = job_fields.columns(chosen)
        table = [job_fields.cells(chosen, j, whole=parsable) for j in rows]
    else:
        header = ("ID", "USER", "NAME", "STATE", "EXIT", "GPUS", "NODE", "ENDED", "WAITED", "RAN", "RESULT / REASON")
        right = frozenset({"ID", "EXIT", "GPUS"})
        cut = job_fields.WHOLE if parsable else 50  # a script's lines carry the whole name and reason
        table = [[str(j["id"]), j["user"], job_name(j["name"], cut), coloured(j["state"]),
                  exit_status(j["exit_code"]), str(j["gpus"]), j["node"] or "-",
                  timestamp(j["ended_at"]), duration(seconds(j["waited_s"])), duration(seconds(j["elapsed_s"])),
                  one_line(result_summary(job(j)), cut)]
                 for j in rows]
    if parsable:
        text = delimited(header, table, headed=not noheader)
        typer.echo(text, nl=bool(text))
        return
    if noheader:
        typer.echo(render("ended jobs", header, table, right, colours_wanted(), headed=False), nl=bool(table))
        return
    typer.echo(render("ended jobs", header, table, right, colours_wanted()))
    counts = state_counts(answer["counts"])
    total = answer["total"]
    typer.echo(f"\n{total} job{'s' if total != 1 else ''} ended {period}: {counts}"
               + (f" (the {len(rows)} newest listed: -n for more)" if total > len(rows) else ""))
