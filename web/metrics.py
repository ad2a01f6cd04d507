"""Prometheus metrics, read from the server's API (GET /v1/metrics) on each scrape: the GPUs under
DCGM exporter's names and labels (so the usual Grafana dashboards work unchanged) and gpuq's own
job metrics.

What every user may see, as the dashboard's pages (asked in the public view, web/read.py): states,
users, reasons, resources and times; never a job's output, recorded diff or environment values.

A custom collector on a registry of its own: nothing is kept in process globals, so two dashboards
(or two tests) in one process never mix their numbers, and a scrape always shows the queue as the server reads it now.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from gpuq.cli.client import Client
from gpuq.web.read import obj

# Seconds; the bounds of the queue-wait and job-duration histograms (from a no-op job to a week's training).
WAIT_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)
DURATION_BUCKETS = (1, 10, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 3 * 24 * 3600, 7 * 24 * 3600)

# DCGM exporter's labels for one GPU, in its spelling; `node` as well, gpuq's own word for Hostname.
GPU_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname", "node")


class GpuqCollector:
    """Collects every metric from the server ``api`` reads when asked (each scrape)."""

    def __init__(self, api: Client) -> None:
        self.api = api

    def collect(self) -> Iterator[Metric]:
        m = self.api.get("/metrics", wait_le=_bounds(WAIT_BUCKETS), duration_le=_bounds(DURATION_BUCKETS))
        yield from _gpu_metrics([obj(d) for d in m["gpus"]])
        yield from _node_metrics(m)
        jobs = GaugeMetricFamily("gpuq_jobs", "Jobs in gpuq's database, by state and user.", labels=["state", "user"])
        for row in m["jobs"]:
            jobs.add_metric([row["state"], row["user"]], row["count"])
        yield jobs
        waiting = GaugeMetricFamily("gpuq_pending_jobs", "Pending jobs, by the reason they wait.", labels=["reason"])
        for row in m["pending"]:
            waiting.add_metric([row["reason"] or "not yet scheduled"], row["count"])
        yield waiting
        share = GaugeMetricFamily("gpuq_user_fairshare_gpu_hours", "Each user's recent GPU-hours, each counting half "
                                  "after the fair share's half-life: at equal priority, fewer goes first.",
                                  labels=["user"])
        for u in self.api.get("/share")["users"]:
            share.add_metric([u["user"]], u["gpu_hours"])
        yield share
        cpu = CounterMetricFamily("gpuq_user_cpu_seconds", "CPU time used by each user's commands that ended "
                                  "(sacct's TotalCPU: a command's processes that were waited for).", labels=["user"])
        for row in m["cpu"]:
            cpu.add_metric([row["user"]], row["cpu_s"])
        yield cpu
        reruns = CounterMetricFamily("gpuq_job_reruns", "Attempts that ended with their job queued to run again, by "
                                     "user and cause: preempted, requeued (gpuq requeue), or the failure that retried "
                                     "or requeued it (exit, worker_lost, ...).", labels=["user", "cause"])
        for row in m.get("reruns", ()):  # a server from before reruns sends none
            reruns.add_metric([row["user"], row["cause"]], row["count"])
        yield reruns
        yield _histogram("gpuq_job_queue_wait_seconds", "Time from submission to start, of every job that started.",
                         m["wait"])
        yield _histogram("gpuq_job_duration_seconds", "Run time (start to end) of every job that ended after starting.",
                         m["duration"])


def _node_metrics(m: dict[str, Any]) -> Iterator[Metric]:
    """Each node's drain (SLURM exporters' node state): drained now, and a maintenance window to
    come, from the server's /metrics answer (``m``: its GPUs, drained nodes and windows)."""
    from datetime import datetime

    drained = GaugeMetricFamily("gpuq_node_drained", "1 while the node is drained (gpuq drain, or a maintenance "
                                "window under way), else 0.", labels=["node"])
    starts = GaugeMetricFamily("gpuq_node_drain_start_seconds", "When the node's maintenance window to come starts "
                               "(gpuq drain --at; Unix time).", labels=["node"])
    ends = GaugeMetricFamily("gpuq_node_drain_end_seconds", "When the node's maintenance window to come ends "
                             "(gpuq drain --until; Unix time); absent where it has no end.", labels=["node"])
    ahead, now = m.get("drains_ahead") or {}, m.get("drained") or {}  # a server from before sends neither
    for node in sorted({d["node"] for d in m["gpus"]} | set(now) | set(ahead)):
        drained.add_metric([node], 1.0 if node in now else 0.0)
    for node, window in sorted(ahead.items()):
        starts.add_metric([node], datetime.fromisoformat(window["at"]).timestamp())
        if window.get("until"):
            ends.add_metric([node], datetime.fromisoformat(window["until"]).timestamp())
    yield from (drained, starts, ends)
    # What each node offers jobs and what they reserve of it (`--cpus`, `--host-mem`), as SLURM's
    # exporters give a node's CPUs and memory, total and allocated; only where its workers report it.
    offered = {"node_cpus": GaugeMetricFamily("gpuq_node_cpus", "CPU cores the node offers jobs (GPUQ_NODE_CPUS).",
                                              labels=["node"]),
               "node_cpus_reserved": GaugeMetricFamily("gpuq_node_cpus_reserved", "CPU cores its started jobs "
                                                       "reserve (--cpus).", labels=["node"]),
               "node_host_mem_mib": GaugeMetricFamily("gpuq_node_host_mem_mib", "Host memory the node offers jobs "
                                                      "(GPUQ_NODE_HOST_MEM_MIB; in MiB).", labels=["node"]),
               "node_host_mem_reserved_mib": GaugeMetricFamily("gpuq_node_host_mem_reserved_mib", "Host memory "
                                                               "its started jobs reserve (--host-mem; in MiB).",
                                                               labels=["node"])}
    for node, d in sorted({d["node"]: d for d in m["gpus"]}.items()):
        for key, family in offered.items():
            total = "node_cpus" if key.startswith("node_cpus") else "node_host_mem_mib"
            if d.get(total) is not None:  # a node, or a server, from before sends none
                family.add_metric([node], float(d.get(key) or 0))
    yield from offered.values()


def _bounds(bounds: tuple[float, ...]) -> str:
    return ",".join(str(float(b)) for b in bounds)


def _gpu_metrics(devices: list[SimpleNamespace]) -> Iterator[Metric]:
    util = GaugeMetricFamily("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", labels=GPU_LABELS)
    used = GaugeMetricFamily("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", labels=GPU_LABELS)
    free = GaugeMetricFamily("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", labels=GPU_LABELS)
    temp = GaugeMetricFamily("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", labels=GPU_LABELS)
    power = GaugeMetricFamily("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", labels=GPU_LABELS)
    clock = GaugeMetricFamily("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", labels=GPU_LABELS)
    # DCGM's counter is millijoules since the driver loaded; gpuq's is the millijoules it sampled,
    # which only grows too (samples rolled into minutes keep their energy), so rate() works alike.
    # Typed gauge: prometheus_client names a counter's TYPE line `..._total`, and DCGM's name has none.
    total = GaugeMetricFamily("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                              "Total energy consumption while gpuq sampled the GPU (in mJ); only grows.",
                              labels=GPU_LABELS)
    up = GaugeMetricFamily("gpuq_gpu_up", "1 when the GPU's worker is alive (heart-beating), else 0.",
                           labels=GPU_LABELS)
    drained = GaugeMetricFamily("gpuq_gpu_drained", "1 while the GPU is given out no more on its own (lost, "
                                "unhealthy, its worker did not start; gpuq status says why), else 0.",
                                labels=GPU_LABELS)
    held = GaugeMetricFamily("gpuq_gpu_allocated", "1 while a job holds the GPU (or a share of it), labelled with "
                             "the job and user.", labels=[*GPU_LABELS, "job", "user"])
    share = GaugeMetricFamily("gpuq_gpu_share_mib", "A shared job's share of the GPU's memory, with its context "
                              "reserve (in MiB).", labels=[*GPU_LABELS, "job", "user"])
    share_used = GaugeMetricFamily("gpuq_gpu_share_used_mib", "GPU memory a shared job's processes use (in MiB), "
                                   "as its worker last measured.", labels=[*GPU_LABELS, "job", "user"])
    for d in devices:
        labels = [str(d.index), d.uuid or "", f"nvidia{d.index}", d.name, d.node, d.node]
        up.add_metric(labels, 1.0 if d.online else 0.0)
        drained.add_metric(labels, 1.0 if getattr(d, "drain_reason", None) else 0.0)
        if d.job_id is not None:
            held.add_metric([*labels, str(d.job_id), d.user or ""], 1.0)
        for s in getattr(d, "shares", None) or []:
            job = [*labels, str(s["job_id"]), s["user"] or ""]
            held.add_metric(job, 1.0)
            share.add_metric(job, float(s["share_mib"]))
            if s["used_mib"] is not None:
                share_used.add_metric(job, float(s["used_mib"]))
        if d.energy_j is not None:
            total.add_metric(labels, d.energy_j * 1000.0)
        if not d.online:
            continue  # no reading is better than an old one shown as now
        for family, value in ((util, d.utilization), (used, d.memory_used_mib), (temp, d.temperature_c),
                              (power, d.power_w), (clock, d.sm_clock_mhz),
                              (free, None if d.memory_used_mib is None else d.memory_total_mib - d.memory_used_mib)):
            if value is not None:
                family.add_metric(labels, float(value))
    yield from (util, used, free, temp, power, clock, total, up, drained, held, share, share_used)


def _histogram(name: str, doc: str, h: dict[str, Any]) -> HistogramMetricFamily:
    """The family of the server's cumulative counts at each bound, its count and its sum."""
    buckets = [(str(float(b)), n) for b, n in zip(h["le"], h["counts"], strict=False)] + [("+Inf", h["count"])]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h["sum"])


def registry(api: Client) -> CollectorRegistry:
    """A registry holding only gpuq's collector, reading through ``api``."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(GpuqCollector(api))
    return reg


def exposition(api: Client) -> tuple[bytes, str]:
    """The metrics in Prometheus's text format, and its content type."""
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry(api)), CONTENT_TYPE_LATEST
