"""The dashboard's pages, each read from the server's API, the same routes and answers the CLI
renders (`gpuq status`, `devices`, `show`, `why`, `stats`, `history`), so page and command never disagree.

Every request asks for the public view (web/read.py): the server answers as for nobody in
particular (``rights.ANYONE``), so a page shows what every user may see (states, names, users,
resources, results), a job's output only where the server opens it to anyone
(``GPUQ_SHARED_LOGS``), and never a recorded diff or environment values."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from html import escape
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlencode

from gpuq.cli.client import Client
from gpuq.service import constants as c
from gpuq.service import display, efficiency
from gpuq.service.display import duration, gpu_hours_text, result_summary
from gpuq.web import svg
from gpuq.web.html import facts, mib, page, state, table, value, when
from gpuq.web.read import obj, seconds
from gpuq.web.read import when as parse_when

# The queue page reloads itself this often, seconds; `gpuq devices --watch` for a faster view.
QUEUE_REFRESH_SECONDS = 5
# Ended jobs the queue page lists below the active ones.
ENDED_SHOWN = 25
# Output lines a job's page shows (the end of it); `gpuq logs` has all of it.
OUTPUT_TAIL_LINES = 200
PERIODS = {"day": "1d", "week": "7d"}
# Slices of the usage page's busy-GPU chart (a quarter of an hour each over a day).
USAGE_BUCKETS = 96
# Ended jobs the history page lists at most (its counts cover the whole period); `gpuq history -n`.
HISTORY_SHOWN = 200


def _shares(shares: list[dict[str, Any]]) -> str:
    """A shared GPU's jobs, each linked, with what it uses of its share."""
    if not shares:
        return "-"
    lines = []
    for s in shares:
        link = _job_link(s["job_id"], f"{s['job_id']} {s['job_name']}")
        lines.append(f"{link} {escape(mib(s['used_mib']))} of {escape(mib(s['share_mib']))}")
    return "<br>".join(lines)


def _job_link(job_id: int | None, text: str | None = None) -> str:
    return "-" if job_id is None else f'<a href="/jobs/{job_id}">{escape(text or str(job_id))}</a>'


def queue(api: Client) -> str:
    """The queue (active jobs, then the newest ended ones) and every GPU with its bars."""
    now = datetime.now(UTC)
    answer = api.get("/jobs", ended=ENDED_SHOWN, arrays="collapsed")
    gpus = api.get("/devices")
    # An array's pending tasks are one row for each reason they wait (linked to the first task).
    listed = display.in_queue_order(answer["jobs"], answer.get("arrays") or [])
    rows = [obj(j) for j in listed]
    devices = [obj(d) for d in gpus["devices"]]
    drained = gpus.get("drained") or {}
    counts: Counter[str] = Counter()
    for j in listed:
        if j["state"] in c.ACTIVE_STATES:
            counts[j["state"]] += j.get("count", 1)
    exempt = set(answer.get("idle_limit_exempt") or ())

    def idle_cell(user: str) -> str:
        limit = None if user in exempt else answer.get("idle_limit_s")  # GPUQ_IDLE_LIMIT_EXEMPT's users
        return f'<span class="s-cancelled">{escape(display.idle_note(answer.get("idle_window_s") or 0, limit))}</span>'

    job_rows = [[_job_link(getattr(j, "first_id", None) or j.id, getattr(j, "ids", None)), escape(j.user),
                 escape(j.name), state(j.state), str(j.gpus), escape(j.node or "-"), when(j.submitted_at),
                 duration(seconds(j.elapsed_s)),
                 idle_cell(j.user) if j.idle else escape(display.with_tasks(vars(j), result_summary(j)))]
                for j in rows]
    gpu_rows = []
    for d in devices:
        shares = getattr(d, "shares", None) or []
        label = ("offline" if not d.online else "busy" if d.job_id else f"shared by {len(shares)}" if shares
                 else "idle")
        if d.node in drained or getattr(d, "drain_reason", None):
            label += " (drained)"
        mem_pct = None if d.memory_used_mib is None else 100.0 * d.memory_used_mib / max(d.memory_total_mib, 1)
        gpu_rows.append([escape(d.node), str(d.index), escape(d.name), state(label), svg.bar(d.utilization),
                         svg.bar(mem_pct, f"{mib(d.memory_used_mib)} / {mib(d.memory_total_mib)}", width=200),
                         "n/a" if d.temperature_c is None else f"{d.temperature_c} C",
                         "n/a" if d.power_w is None else f"{d.power_w:.0f} W",
                         _job_link(d.job_id, f"{d.job_id} {d.job_name}") if d.job_id else _shares(shares),
                         escape(d.user or ", ".join(sorted({s["user"] or "?" for s in shares})) or "-"),
                         escape(", ".join(f"{p.get('name') or '?'}[{p.get('pid')}] of {p.get('user') or '?'}"
                                          for p in d.foreign) or "-")])
    summary = ", ".join(f"{counts[s]} {s}" for s in c.ACTIVE_STATES if counts[s]) or "nothing waiting or running"
    body = (f"<h1>Queue</h1><p>{escape(summary)} <span class=\"muted\">(as of {when(now)}, refreshed every "
            f"{QUEUE_REFRESH_SECONDS} s)</span></p>"
            + (table(["ID", "user", "name", "state", "GPUs", "node", "submitted", "elapsed", "result / reason"],
                     job_rows, numeric={0, 4}, cls="jobs") if rows else "<p>no jobs</p>")
            + "<h2>GPUs</h2>"
            + (table(["node", "GPU", "name", "state", "utilisation", "memory", "temp", "power", "job", "user",
                      "foreign processes"], gpu_rows, numeric={1, 6, 7}, cls="gpus") if devices
               else "<p>no GPUs registered: start the workers (<code>gpuq up</code>)</p>")
            + "".join(f'<p class="muted">drained: {escape(where)}: {escape(why)}</p>'
                      for where, why in display.drained(gpus["devices"], drained))
            + "".join(f'<p class="muted">{escape(display.drain_ahead(node, d))}</p>'
                      for node, d in sorted((gpus.get("drains_ahead") or {}).items()))
            + "".join(f'<p class="muted">{escape(line)}</p>' for line in display.reserved_lines(gpus["devices"])))
    return page("queue", body, refresh=QUEUE_REFRESH_SECONDS)


def job(api: Client, job_id: int) -> str:
    """One job: what it runs, where and when, why it waits, its result, per-epoch metrics, the
    device plots of its GPUs and its usage summary. Raises Refused (exit code 3) for no such job."""
    shown = api.get(f"/jobs/{job_id}")
    j = obj(shown)
    metrics = shown.get("metrics") or []
    # The server says whether the public may read the output: not even asked for otherwise.
    readable = bool(shown.get("output_readable"))
    output = "".join(ch[1] for ch in api.get(f"/jobs/{job_id}/output")["chunks"]) if readable else ""
    reason = api.get(f"/jobs/{job_id}/why")["why"]
    stats = api.get(f"/jobs/{job_id}/stats", plot=1) if j.started_at else None
    series = [p | {"at": parse_when(p["at"])} for p in (stats or {}).get("series", [])]
    used = obj(stats) if stats else None
    gpu_names = {int(k): f"GPU {g['node']}:{g['index']}" for k, g in (stats or {}).get("series_gpus", {}).items()}
    gpus = j.gpu_indices or []
    what = (j.workload or "") if j.kind == c.KIND_WORKLOAD else " ".join(j.argv or [])
    pairs = [("job", escape(f"{j.id}  {j.name}")), ("user", escape(j.user)), ("state", state(j.state)),
             ("why", escape(reason)), ("runs", f"<code>{escape(what)}</code>"), ("kind", escape(j.kind)),
             ("directory", escape(j.cwd or "-")),
             ("GPUs", escape(f"{j.gpus}" + (f" on {j.node}: " + ", ".join(str(g) for g in gpus) if gpus
                                            else (f" on {j.node}" if j.node else "")))),
             ("worker", escape(j.worker or "-")), ("priority", str(j.priority)),
             ("submitted", when(j.submitted_at)), ("started", when(j.started_at)), ("ended", when(j.ended_at)),
             ("elapsed", duration(seconds(j.elapsed_s)))]
    if j.exit_code is not None:
        pairs.append(("exit code", str(j.exit_code)))
    for n, attempt in enumerate(j.attempts or [], 1):
        pairs.append((f"attempt {n}",
                      escape(f"{attempt.get('state')}: {attempt.get('reason')} on {attempt.get('worker')}")))
    body = [f"<h1>Job {j.id}: {escape(j.name)}</h1>", facts(pairs)]
    if j.params:
        body += ["<h2>Parameters</h2>", facts([(k, value(v)) for k, v in j.params.items()])]
    if j.result:
        body += ["<h2>Result</h2>", facts([(k, value(v)) for k, v in j.result.items()])]
    if metrics:
        body += ["<h2>Metrics per epoch</h2>", _metrics(metrics)]
    body += ["<h2>Devices</h2>", _device_plots(series, gpu_names, j)]
    if used is not None:
        body += ["<h2>Usage</h2>", facts([
            ("wall time", duration(timedelta(seconds=used.wall_s))), ("GPU-hours", f"{used.gpu_hours:.4f}"),
            ("memory peak", mib(used.memory_peak_mib)), ("memory mean", mib(used.memory_mean_mib)),
            ("utilisation mean", "n/a" if used.utilization_mean is None else f"{used.utilization_mean:.1f}%"),
            ("energy", "n/a" if used.energy_j is None else f"{used.energy_j:.1f} J"),
            ("idle GPU time", f"{used.idle_s:.1f} s"), ("samples", str(used.samples)),
            *((k, escape(v)) for k, v in [*efficiency.cpu_use(used), *efficiency.host_memory_use(used)])])]
    if not readable:
        body += [f"<h2>Output</h2><p class=\"muted\">the output is {escape(j.user)}'s: <code>gpuq logs {j.id}</code> "
                 f"as them (or an admin) shows it</p>"]
    elif output:
        tail = "\n".join(output.splitlines()[-OUTPUT_TAIL_LINES:])
        body += [f"<h2>Output</h2><p class=\"muted\">the last {OUTPUT_TAIL_LINES} lines at most; "
                 f"<code>gpuq logs {j.id}</code> has all of it</p><pre>{escape(tail)}</pre>"]
    return page(f"job {j.id}", "".join(body), refresh=QUEUE_REFRESH_SECONDS if j.state in c.ACTIVE_STATES else None)


def _metrics(rows: list[dict[str, Any]]) -> str:
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)]
    out = table(keys, [[value(r.get(k)) for k in keys] for r in rows], numeric=set(range(len(keys))), cls="metrics")
    x = [r.get("epoch", n + 1) for n, r in enumerate(rows)]
    numeric = [k for k in keys if k != "epoch" and all(isinstance(r.get(k), (int, float)) for r in rows)]
    losses = {k: list(zip(x, [r[k] for r in rows], strict=True)) for k in numeric if "loss" in k}
    accs = {k: list(zip(x, [r[k] for r in rows], strict=True)) for k in numeric if "acc" in k}
    if losses:
        out += svg.line_chart("loss", losses, x_label="epoch", y_label="loss")
    if accs:
        out += svg.line_chart("accuracy", accs, x_label="epoch", y_label="accuracy", y_max=1.0)
    return out


def _device_plots(series: list[dict[str, Any]], names: dict[int, str], j: SimpleNamespace) -> str:
    if not series:
        return "<p class=\"na\">no device samples for this job</p>"
    start = j.started_at or series[0]["at"]
    charts = []
    for key, title, unit, top in (("utilization", "GPU utilisation", "%", 100.0),
                                  ("memory_used_mib", "GPU memory used", "MiB", None),
                                  ("power_w", "GPU power", "W", None)):
        lines: dict[str, list[tuple[float, float | None]]] = {}
        for p in series:
            lines.setdefault(names.get(p["gpu_id"], f"GPU {p['gpu_id']}"), []).append(
                ((p["at"] - start).total_seconds(), p[key]))
        charts.append(svg.line_chart(title, lines, x_label="seconds since start", y_label=unit, y_max=top))
    return "".join(charts) + f'<p class="muted">{len(series)} samples</p>'


def usage_page(api: Client, period: str) -> str:
    """GPU-hours, jobs, mean utilisation, energy and CPU-hours per user and per node over the last day or week
    (`gpuq stats --since 1d` / `7d`), with each user's busy GPUs over the period."""
    rep = api.get("/stats", since=PERIODS[period], until="now", plot=1, buckets=USAGE_BUCKETS)
    since, now = parse_when(rep["since"]), parse_when(rep["until"])
    edges = [parse_when(e) for e in rep["series"]["edges"]]
    by_user = rep["series"]["by_user"]
    links = " | ".join(f"<b>last {p}</b>" if p == period else f'<a href="/usage?period={p}">last {p}</a>'
                       for p in PERIODS)
    body = [f"<h1>Usage, last {period}</h1><p>{links} <span class=\"muted\">({when(since)} to {when(now)})</span></p>"]
    parts = {part: [obj(r) for r in rep[part]] for part in ("users", "nodes")}
    total = sum(r.gpu_hours for r in parts["users"]) or 1.0
    for part, title in (("users", "per user"), ("nodes", "per node")):
        rows = [[escape(r.name), str(r.jobs), f"{r.gpu_hours:.3f}",
                 svg.bar(100 * r.gpu_hours / total, f"{100 * r.gpu_hours / total:.0f}%", 120, "#8ab6e0"),
                 "n/a" if r.utilization_mean is None else f"{r.utilization_mean:.1f}%",
                 f"{r.energy_j / 3.6e6:.4f}", f"{r.idle_hours:.3f}", f"{r.cpu_hours:.3f}"] for r in parts[part]]
        body.append(f"<h2>{title}</h2>" + (table([part[:-1], "jobs", "GPU-hours", "share", "mean utilisation",
                                                  "energy (kWh)", "idle GPU-hours", "CPU-hours"], rows,
                                                 numeric={1, 2, 4, 5, 6, 7},
                                                 cls=f"usage-{part}") if rows else "<p>no use in this period</p>"))
    body.append(_fair_share(api.get("/share")))
    hours = [(e - now).total_seconds() / 3600 for e in edges]
    body.append("<h2>busy GPUs by user</h2>" + svg.line_chart(
        f"GPUs kept busy, last {period}", {u: list(zip(hours, v, strict=False)) for u, v in sorted(by_user.items())},
        x_label="hours from now", y_label="GPUs"))
    return page(f"usage, last {period}", "".join(body))


def _fair_share(share: dict[str, Any]) -> str:
    """Each user's standing in the fair share now (`gpuq share`): what orders users at equal priority."""
    rows = [[str(u["order"]), escape(u["user"]), gpu_hours_text(u["gpu_hours"]), f"{u['gpus']:g}", str(u["running"]),
             str(u["pending"])] for u in share["users"]]
    note = (f'<p class="muted">recent GPU-hours, each counting half after {share["half_life_h"]:g} h: at equal '
            "priority the user with fewer goes first</p>")
    return "<h2>fair share now</h2>" + (table(["order", "user", "GPU-hours", "GPUs", "running", "pending"], rows,
                                              numeric={0, 2, 3, 4, 5}, cls="fair-share") + note
                                        if rows else "<p>no recent GPU-hours and no jobs: every user starts even</p>")


def history_page(api: Client, period: str, user: str | None, ended: str | None) -> str:
    """The jobs that ended over the last day or week (`gpuq history --all`), newest first, with a
    count of each end state; narrowed to one ``user`` or one end state (``ended``) by the links."""
    answer = api.get("/jobs/history", since=PERIODS[period], user=user, state=ended, limit=HISTORY_SHOWN)
    since, until = parse_when(answer["since"]), parse_when(answer["until"])
    rows = [obj(j) for j in answer["jobs"]]

    def link(**change: str | None) -> str:
        chosen = {"period": period, "user": user, "state": ended} | change
        return "/history?" + urlencode({k: v for k, v in chosen.items() if v})

    job_rows = [[_job_link(j.id), f'<a href="{escape(link(user=j.user))}">{escape(j.user)}</a>', escape(j.name),
                 state(j.state), "-" if j.exit_code is None else str(j.exit_code), str(j.gpus), escape(j.node or "-"),
                 when(j.ended_at), duration(seconds(j.waited_s)), duration(seconds(j.elapsed_s)),
                 *_used(getattr(j, "usage", None)), escape(result_summary(j))] for j in rows]
    periods = " | ".join(f"<b>last {p}</b>" if p == period else f'<a href="{escape(link(period=p))}">last {p}</a>'
                         for p in PERIODS)
    states = " | ".join(f"<b>{s}</b>" if s == (ended or "") else f'<a href="{escape(link(state=s))}">{s or "all"}</a>'
                        for s in ("", *c.END_STATES))
    counts = display.state_counts(answer["counts"])
    who = f"of {escape(user)} " if user else ""
    shown = f" (the {len(rows)} newest listed)" if answer["total"] > len(rows) else ""
    body = (f"<h1>History</h1><p>{periods} &nbsp; {states}"
            + (f' &nbsp; user {escape(user)} (<a href="{escape(link(user=None))}">everyone</a>)' if user else "")
            + f"</p><p>{answer['total']} jobs {who}ended {when(since)} to {when(until)}"
            + (f": {escape(counts)}" if counts else "") + f"{shown}</p>"
            + (table(["ID", "user", "name", "state", "exit", "GPUs", "node", "ended", "waited", "ran",
                      "GPU-hours", "GPU mem peak", "CPU time", "host mem peak", "result / reason"], job_rows,
                     numeric={0, 4, 5, 10, 11, 12, 13}, cls="history") if rows else ""))
    return page(f"history, last {period}", body)


def _used(usage: dict[str, Any] | None) -> list[str]:
    """An ended job's usage cells (`gpuq history -o gpu_hours,gpu_mem_peak,cpu_time,host_mem_peak`):
    "-" where its summary has none of a figure, or there is no summary."""
    u = usage or {}
    return [escape(text) for text in (
        "-" if u.get("gpu_hours") is None else f"{u['gpu_hours']:.2f}",
        "-" if u.get("memory_peak_mib") is None else mib(u["memory_peak_mib"]),
        "-" if u.get("cpu_s") is None else duration(seconds(u["cpu_s"])),
        "-" if u.get("host_mem_peak_mib") is None else mib(u["host_mem_peak_mib"]))]
