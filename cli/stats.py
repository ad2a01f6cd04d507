"""`gpuq stats`: accounting as SLURM's sacct and sreport give it, per user and node over a period,
or for one job; as a table, JSON, CSV or a plot. `gpuq stats --rollup` rolls old samples up."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from gpuq.cli.render import duration, print_json, timestamp
from gpuq.service import accounting, samples, usage
from gpuq.service import constants as c
from gpuq.service.db import require_schema, session_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.jobs import get_job
from gpuq.service.models import utcnow
from gpuq.service.settings import get_settings

app = typer.Typer()

_COLUMNS = ("jobs", "gpu_hours", "utilization_mean", "energy_j", "idle_hours")


def _num(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


@app.command()
def stats(
    job_id: Annotated[Optional[int], typer.Argument(help="One job's summary instead of the report.", min=1)] = None,
    since: Annotated[str, typer.Option(help="Start: a date, a time or an age (7d, 12h).")] = "7d",
    until: Annotated[str, typer.Option(help="End: a date, a time, an age or now.")] = "now",
    as_json: Annotated[bool, typer.Option("--json")] = False,
    as_csv: Annotated[bool, typer.Option("--csv")] = False,
    plot: Annotated[Optional[Path], typer.Option(help="Also draw it to this PNG file.")] = None,
    rollup: Annotated[bool, typer.Option("--rollup", help="Roll raw samples past retention into "
                                                          "1-minute aggregates, and do nothing else.")] = False,
) -> None:
    """GPU-hours, jobs, mean utilisation and energy per user and node; or one job's summary."""
    settings = get_settings()
    if as_json and as_csv:
        raise InvalidSpec("--json and --csv cannot be used together: pick one")
    now = utcnow()
    start, end = accounting.parse_when(since, "--since", now), accounting.parse_when(until, "--until", now)
    if start >= end:
        raise InvalidSpec(f"--since {since} is not before --until {until}")
    require_schema(settings)
    if rollup:
        n = samples.rollup(settings, now)
        typer.echo(f"rolled {n} raw samples older than {settings.sample_retention_days:g} days into "
                   "1-minute aggregates")
        return
    if job_id is not None:
        _job(job_id, as_json, as_csv, plot)
        return
    with session_scope(settings) as session:
        rep = accounting.report(session, start, end, now)
        series = accounting.utilization_by_user(session, start, end) if plot else None
    if plot:
        from gpuq.cli.plots import cluster_plot

        cluster_plot(*series, plot, f"GPU use by user, {timestamp(start)} to {timestamp(end)}")
    if as_json:
        print_json({"since": start.isoformat(), "until": end.isoformat(),
                    "users": [r.as_dict() for r in rep["users"]], "nodes": [r.as_dict() for r in rep["nodes"]]})
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


def _report_tables(rep, start, end) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200)
    console.print(f"from {timestamp(start)} to {timestamp(end)}")
    for part, title in (("users", "USER"), ("nodes", "NODE")):
        t = Table(box=None, header_style="bold", title_justify="left")
        for col in (title, "JOBS", "GPU-HOURS", "MEAN UTIL", "ENERGY kWh", "IDLE GPU-HOURS"):
            t.add_column(col, justify="left" if col == title else "right")
        for r in rep[part]:
            t.add_row(r.name, str(r.jobs), f"{r.gpu_hours:.2f}", _num(r.utilization_mean, ".0f") + "%",
                      f"{r.energy_j / 3.6e6:.3f}", f"{r.idle_hours:.2f}")
        console.print()
        console.print(t if rep[part] else f"no {part} with GPU use in this period")


def _job(job_id: int, as_json: bool, as_csv: bool, plot: Path | None) -> None:
    settings = get_settings()
    with session_scope(settings) as session:
        job = get_job(session, job_id)
        u = usage.job_usage(session, job_id)
        series = accounting.job_series(session, job_id) if plot else None
        info = dict(job_id=job.id, name=job.name, user=job.user, state=job.state, node=job.node, gpus=job.gpus)
    data = info | dict(wall_s=u.wall_s, gpu_hours=u.gpu_hours, memory_peak_mib=u.memory_peak_mib,
                       memory_mean_mib=u.memory_mean_mib, utilization_mean=u.utilization_mean,
                       energy_j=u.energy_j, idle_s=u.idle_s, samples=u.samples)
    if plot:
        from gpuq.cli.plots import job_plot

        job_plot(series, plot, f"job {job_id} ({info['name']}, {info['user']})")
    if as_json:
        print_json(data)
    elif as_csv:
        out = csv.DictWriter(sys.stdout, fieldnames=list(data), lineterminator="\n")
        out.writeheader()
        out.writerow(data)
    else:
        from datetime import timedelta

        lines = [("job", f"{job_id}  {info['name']}  ({info['user']}, {info['state']})"),
                 ("wall time", duration(timedelta(seconds=u.wall_s))),
                 ("GPU-hours", f"{u.gpu_hours:.4f}  ({info['gpus']} GPU{'s' if info['gpus'] > 1 else ''})"),
                 ("mean util", _num(u.utilization_mean, ".1f") + "%"),
                 ("memory", f"peak {_num(u.memory_peak_mib, 'd')} MiB, mean {_num(u.memory_mean_mib, '.0f')} MiB"),
                 ("energy", "n/a" if u.energy_j is None else f"{u.energy_j:.0f} J ({u.energy_j / 3.6e6:.4f} kWh)"),
                 ("idle", f"{u.idle_s:.0f} GPU-seconds below {c.IDLE_UTILIZATION}% utilisation"),
                 ("samples", str(u.samples))]
        for key, value in lines:
            typer.echo(f"{key:>10}  {value}")
    if plot:
        typer.echo(f"plot written to {plot}", err=as_json or as_csv)
