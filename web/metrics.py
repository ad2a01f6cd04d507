"""Prometheus metrics, read from SQL on each scrape: the GPUs under DCGM exporter's names and labels
(so the usual Grafana dashboards work unchanged) and gpuq's own job metrics.

What every user may see, as the dashboard's pages (its scrapers are nobody in particular,
``rights.ANYONE``): states, users, reasons, resources and times; never a job's output, recorded
diff or environment values.

A custom collector on a registry of its own: nothing is kept in process globals, so two dashboards
(or two tests) in one process never mix their numbers, and a scrape always shows SQL as it is now.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from sqlalchemy import func, select

from gpuq.service import constants as c
from gpuq.service.device_status import device_status
from gpuq.service.models import DeviceMinute, DeviceSample, Gpu, Job
from gpuq.service.settings import Settings
from gpuq.web.read import read_session

# Seconds; the bounds of the queue-wait and job-duration histograms (from a no-op job to a week's training).
WAIT_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)
DURATION_BUCKETS = (1, 10, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 3 * 24 * 3600, 7 * 24 * 3600)

# DCGM exporter's labels for one GPU, in its spelling; `node` as well, gpuq's own word for Hostname.
GPU_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname", "node")


class GpuqCollector:
    """Collects every metric from the database of ``settings`` when asked (each scrape)."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def collect(self) -> Iterator[Metric]:
        with read_session(self.settings) as session:
            devices = device_status(session, self.settings)
            gpus = {(g.node, g.index): g for g in session.scalars(select(Gpu))}
            energy = _energy_by_gpu(session)
            by_state_user = session.execute(select(Job.state, Job.user, func.count()).group_by(Job.state, Job.user)).all()
            pending = session.execute(select(Job.reason, func.count()).where(Job.state == c.PENDING)
                                      .group_by(Job.reason)).all()
            times = session.execute(select(Job.state, Job.submitted_at, Job.started_at, Job.ended_at)
                                    .where(Job.started_at.is_not(None))).all()
        yield from _gpu_metrics(devices, gpus, energy)
        jobs = GaugeMetricFamily("gpuq_jobs", "Jobs in gpuq's database, by state and user.", labels=["state", "user"])
        for state, user, n in by_state_user:
            jobs.add_metric([state, user], n)
        yield jobs
        waiting = GaugeMetricFamily("gpuq_pending_jobs", "Pending jobs, by the reason they wait.", labels=["reason"])
        for reason, n in pending:
            waiting.add_metric([reason or "not yet scheduled"], n)
        yield waiting
        yield _histogram("gpuq_job_queue_wait_seconds", "Time from submission to start, of every job that started.",
                         [(start - sub).total_seconds() for _, sub, start, _ in times], WAIT_BUCKETS)
        yield _histogram("gpuq_job_duration_seconds", "Run time (start to end) of every job that ended after starting.",
                         [(end - start).total_seconds() for state, _, start, end in times
                          if end is not None and state in c.END_STATES], DURATION_BUCKETS)


def _energy_by_gpu(session) -> dict[int, float]:
    """Joules each GPU used while gpuq sampled it: raw samples plus the minute aggregates."""
    out: Counter[int] = Counter()
    for t in (DeviceSample, DeviceMinute):
        for gpu_id, joules in session.execute(select(t.gpu_id, func.sum(t.energy_j)).group_by(t.gpu_id)):
            out[gpu_id] += float(joules or 0.0)
    return dict(out)


def _gpu_metrics(devices, gpus, energy) -> Iterator[Metric]:
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
    held = GaugeMetricFamily("gpuq_gpu_allocated", "1 while a job holds the GPU, labelled with the job and user.",
                             labels=[*GPU_LABELS, "job", "user"])
    for d in devices:
        gpu = gpus.get((d.node, d.index))
        labels = [str(d.index), gpu.uuid if gpu else "", f"nvidia{d.index}", d.name, d.node, d.node]
        up.add_metric(labels, 1.0 if d.online else 0.0)
        if d.job_id is not None:
            held.add_metric([*labels, str(d.job_id), d.user or ""], 1.0)
        if gpu is not None and gpu.id in energy:
            total.add_metric(labels, energy[gpu.id] * 1000.0)
        if not d.online:
            continue  # no reading is better than an old one shown as now
        for family, value in ((util, d.utilization), (used, d.memory_used_mib), (temp, d.temperature_c),
                              (power, d.power_w), (clock, d.sm_clock_mhz),
                              (free, None if d.memory_used_mib is None else d.memory_total_mib - d.memory_used_mib)):
            if value is not None:
                family.add_metric(labels, float(value))
    yield from (util, used, free, temp, power, clock, total, up, held)


def _histogram(name: str, doc: str, values: list[float], bounds: tuple[float, ...]) -> HistogramMetricFamily:
    counts = [sum(1 for v in values if v <= b) for b in bounds]
    buckets = [(_bound(b), n) for b, n in zip(bounds, counts)] + [("+Inf", len(values))]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=sum(values))


def _bound(b: float) -> str:
    return str(float(b))


def registry(settings: Settings) -> CollectorRegistry:
    """A registry holding only gpuq's collector for these settings."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(GpuqCollector(settings))
    return reg


def exposition(settings: Settings) -> tuple[bytes, str]:
    """The metrics in Prometheus's text format, and its content type."""
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry(settings)), CONTENT_TYPE_LATEST
