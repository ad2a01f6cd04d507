"""`gpuq stats`: accounting as SLURM's sacct and sreport give it, per user and node over a period,
or for one job; as a table, JSON, CSV or a plot. `gpuq stats --rollup` rolls old samples up."""

from __future__ import annotations

import csv
import sys
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import typer

from gpuq.cli import numbers
from gpuq.cli.client import Client
from gpuq.cli.render import duration, job, print_json, timestamp, when
from gpuq.service import constants as c
from gpuq.service import efficiency
from gpuq.service.display import share, state_counts, time_limit
from gpuq.service.errors import InvalidSpec

app = typer.Typer()

# cpu_hours last: a script that reads the CSV by position keeps its columns.
_COLUMNS = ("jobs", "gpu_hours", "utilization_mean", "energy_j", "idle_hours", "cpu_hours")


def _num(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def _percent(v: float | None, fmt: str) -> str:
    """A share in percent, or n/a where nothing was sampled (not "n/a%")."""
    return "n/a" if v is None else format(v, fmt) + "%"


@app.command()
def stats(
    job_id: Annotated[int | None, typer.Argument(help="One job's summary instead of the report.",
                                                 parser=numbers.job_id)] = None,
    array: Annotated[int | None, typer.Option(help="An array's tasks summed instead (--csv: a line for each task).",
                                              parser=numbers.job_id)] = None,
    since: Annotated[str, typer.Option(help="Start: a date, a time or an age (7d, 12h).")] = "7d",
    until: Annotated[str, typer.Option(help="End: a date, a time, an age or now.")] = "now",
    as_json: Annotated[bool, typer.Option("--json")] = False,
    as_csv: Annotated[bool, typer.Option("--csv")] = False,
    plot: Annotated[Path | None, typer.Option(help="Also draw it to this file, in the format its suffix "
                                                   "names: .png, .svg, .pdf...")] = None,
    rollup: Annotated[bool, typer.Option("--rollup", help="Roll raw samples past retention into "
                                                          "1-minute aggregates, and do nothing else.")] = False,
) -> None:
    """GPU-hours, jobs, mean utilisation, energy and CPU-hours per user and node; or one job's summary."""
    if as_json and as_csv:
        raise InvalidSpec("--json and --csv cannot be used together: pick one")
    if rollup and (job_id is not None or array is not None or as_json or as_csv or plot):
        raise InvalidSpec("--rollup does only the roll-up: give it alone")
    if array is not None and job_id is not None:
        raise InvalidSpec("give a job id or --array ID, not both")
    if array is not None and plot:
        raise InvalidSpec("--plot draws one job's samples: give a task's id, not --array")
    if plot:
        from gpuq.cli.plots import plot_format

        plot_format(plot)  # a suffix it cannot draw is refused before anything is asked or drawn
    client = Client()
    if rollup:
        done = client.post("/stats/rollup")
        typer.echo(f"rolled {done['rolled']} raw samples older than {done['retention_days']:g} days into "
                   "1-minute aggregates")
        return
    if job_id is not None:
        _job(client, job_id, as_json, as_csv, plot)
        return
    if array is not None:
        _array(client, array, as_json, as_csv)
        return
    answer = client.get("/stats", since=since, until=until, plot=1 if plot else None)
    start, end = when(answer["since"]), when(answer["until"])
    rep = {part: [job(r) for r in answer[part]] for part in ("users", "nodes")}
    if plot:
        from gpuq.cli.plots import cluster_plot

        series = answer["series"]
        cluster_plot([datetime.fromisoformat(e) for e in series["edges"]], series["by_user"], plot,
                     f"GPU use by user, {timestamp(start)} to {timestamp(end)}")
    if as_json:
        print_json({"since": answer["since"], "until": answer["until"], "users": answer["users"],
                    "nodes": answer["nodes"]})
    elif as_csv:
        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow(("by", "name", *_COLUMNS))
        for part, by in (("users", "user"), ("nodes", "node")):
            for r in rep[part]:
                out.writerow((by, r.name, *(getattr(r, col) for col in _COLUMNS)))
    else:
        _report_tables(rep, start, end)
    if plot:
        typer.echo(f"plot written to {plot}", err=as_json or as_csv)


def _report_tables(rep: dict[str, list[SimpleNamespace]], start: datetime | None, end: datetime | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200)
    console.print(f"from {timestamp(start)} to {timestamp(end)}")
    for part, title in (("users", "USER"), ("nodes", "NODE")):
        t = Table(box=None, header_style="bold", title_justify="left")
        for col in (title, "JOBS", "GPU-HOURS", "MEAN UTIL", "ENERGY kWh", "IDLE GPU-HOURS", "CPU-HOURS"):
            t.add_column(col, justify="left" if col == title else "right")
        for r in rep[part]:
            t.add_row(r.name, str(r.jobs), f"{r.gpu_hours:.2f}", _percent(r.utilization_mean, ".0f"),
                      f"{r.energy_j / 3.6e6:.3f}", f"{r.idle_hours:.2f}", f"{r.cpu_hours:.2f}")
        console.print()
        console.print(t if rep[part] else f"no {part} with GPU use in this period")
        if part == "nodes" and rep[part]:
            # The same columns, counted otherwise: a node's are every GPU of it, busy or not.
            console.print("per node, MEAN UTIL, ENERGY and IDLE GPU-HOURS count all its GPUs' samples, idle GPUs "
                          "included; per user, only their jobs'")
            console.print("CPU-HOURS are the CPU time of commands that ended in the period (built-in workloads' "
                          "and allocations' are not known)")


def gpu_names(gpus: dict[str, dict[str, Any]]) -> dict[int, str]:
    """A plot's name for each GPU its samples name by row id: ``GPU 2`` (its index on its node, as
    nvidia-smi numbers it), with the node where the job's GPUs are on several."""
    nodes = {g["node"] for g in gpus.values()}
    return {int(i): f"GPU {g['index']}" + (f" ({g['node']})" if len(nodes) > 1 else "") for i, g in gpus.items()}


def _job(client: Client, job_id: int, as_json: bool, as_csv: bool, plot: Path | None) -> None:
    data = client.get(f"/jobs/{job_id}/stats", plot=1 if plot else None)
    series = data.pop("series", None)
    gpus = data.pop("series_gpus", None) or {}  # which GPU each point is of, by its row's id: the legend's
    if plot:
        from gpuq.cli.plots import job_plot

        job_plot([p | {"at": when(p["at"])} for p in series], plot, f"job {job_id} ({data['name']}, {data['user']})",
                 gpu_names(gpus))
    if as_json:
        print_json(data)
    elif as_csv:
        out = csv.DictWriter(sys.stdout, fieldnames=list(data), lineterminator="\n")
        out.writeheader()
        out.writerow(data)
    else:
        from datetime import timedelta

        u = job(data)
        lines = [("job", f"{job_id}  {u.name}  ({u.user}, {u.state})"),
                 ("wall time", duration(timedelta(seconds=u.wall_s))),
                 ("time limit", _limit_used(u.time_limit_s, u.time_used)),
                 ("GPU-hours", f"{u.gpu_hours:.4f}  ({u.gpus} GPU{'s' if u.gpus > 1 else ''})"),
                 ("mean util", _percent(u.utilization_mean, ".1f")),
                 ("memory", f"peak {_num(u.memory_peak_mib, 'd')} MiB"
                  + (f" of its {u.share_mib} MiB share" if getattr(u, "share_mib", None) else "")
                  + f", mean {_num(u.memory_mean_mib, '.0f')} MiB"),
                 *efficiency.cpu_use(u),
                 *efficiency.host_memory_use(u),
                 *_energy_idle_samples(u)]
        _echo(lines, u.limit_hint)
    if plot:
        typer.echo(f"plot written to {plot}", err=as_json or as_csv)


def _array_host_use(a: SimpleNamespace) -> list[tuple[str, str]]:
    """An array's commands' CPU seconds, summed, and their highest host memory peak (a server from
    before sends neither; an array of workloads has neither)."""
    lines = []
    if getattr(a, "cpu_s", None) is not None:
        lines.append(("CPU", f"{a.cpu_s:.1f} s over its tasks"))
    if getattr(a, "host_mem_peak_mib", None) is not None:
        lines.append(("host memory", f"peak {a.host_mem_peak_mib} MiB (job {a.host_mem_peak_task})"))
    return lines


def _energy_idle_samples(u: SimpleNamespace) -> list[tuple[str, str]]:
    """A summary's last lines, a job's or an array's."""
    return [("energy", "n/a" if u.energy_j is None else f"{u.energy_j:.0f} J ({u.energy_j / 3.6e6:.4f} kWh)"),
            ("idle", f"{u.idle_s:.0f} GPU-seconds below {c.IDLE_UTILIZATION}% utilisation"),
            ("samples", str(u.samples))]


def _echo(lines: list[tuple[str, str]], hint: str | None) -> None:
    """A summary's lines, their names aligned right, and the nearer limit it suggests, if any."""
    for key, value in lines:
        typer.echo(f"{key:>10}  {value}")
    if hint:
        typer.echo(hint)


def _limit_used(limit_s: int | None, used: float | None) -> str:
    if not limit_s:
        return "none"
    return time_limit(limit_s) + ("" if used is None else f"  ({share(used)} of it used)")


# An array's per-task CSV columns, as sacct gives a line for each task.
_TASK_COLUMNS = ("job_id", "index", "state", "time_limit_s", "wall_s", "gpu_hours", "utilization_mean",
                 "memory_peak_mib", "memory_mean_mib", "energy_j", "idle_s", "samples", "cpu_s", "host_mem_peak_mib")


def _array(client: Client, array_id: int, as_json: bool, as_csv: bool) -> None:
    data = client.get(f"/arrays/{array_id}/stats")
    if as_json:
        print_json(data)
        return
    if as_csv:
        out = csv.DictWriter(sys.stdout, fieldnames=_TASK_COLUMNS, extrasaction="ignore", lineterminator="\n")
        out.writeheader()
        out.writerows(data["per_task"])
        return
    from datetime import timedelta

    a = job(data)
    wall = "none started" if a.wall_mean_s is None else (
        f"mean {duration(timedelta(seconds=a.wall_mean_s))}, longest "
        f"{duration(timedelta(seconds=a.wall_longest_s))} (job {a.longest_task})")
    lines = [("array", f"{array_id}  {a.name}  ({a.user})"),
             ("tasks", f"{a.tasks}: {state_counts(a.states)}"),
             ("wall time", wall),
             ("time limit", ("differs between tasks" if a.time_limits > 1 else _limit_used(a.time_limit_s, None))
              + ("" if a.time_used_max is None else f"  (the longest task used {share(a.time_used_max)} of it)")),
             ("GPU-hours", f"{a.gpu_hours:.4f}"),
             ("mean util", _percent(a.utilization_mean, ".1f")),
             ("memory", "n/a" if a.memory_peak_mib is None else
              f"peak {a.memory_peak_mib} MiB (job {a.memory_peak_task})"),
             *_array_host_use(a),
             *_energy_idle_samples(a)]
    _echo(lines, a.limit_hint)
