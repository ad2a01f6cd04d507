"""The baseline for benchmarks/queue_speed.py: a bare Celery no-op task, configured as gpuq's
workers are (solo pool, prefetch 1, late acks, JSON), recording when it ran in Redis."""

import os
import time

import redis
from celery import Celery

BROKER = os.environ["BENCH_BROKER_URL"]
app = Celery("bare", broker=BROKER)
app.conf.update(task_serializer="json", accept_content=["json"], task_ignore_result=True,
                worker_prefetch_multiplier=1, task_acks_late=True, worker_hijack_root_logger=False)
_redis = redis.Redis.from_url(BROKER)


@app.task(name="bare.noop")
def noop(sent: float) -> None:
    _redis.rpush("bench:done", f"{sent} {time.time()}")
