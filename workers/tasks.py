"""The Celery tasks: thin adapters from a message to ``runner.run_job`` or ``ranks.run_rank``."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from gpuq.service import constants as c
from gpuq.workers.ranks import run_rank
from gpuq.workers.runner import run_job
from gpuq.workers.state import WorkerState

log = logging.getLogger("gpuq.worker")


def register(app: Celery, state: WorkerState) -> None:
    @app.task(name=c.RUN_JOB_TASK, ignore_result=True, acks_late=True)
    def run_job_task(job_id: Any) -> None:
        # The message is only a pointer into SQL; anything but a job id is dropped.
        if type(job_id) is not int:
            log.warning("%s: dropped a message with job id %r", state.name, job_id)
            return
        run_job(state, job_id)

    @app.task(name=c.RUN_RANK_TASK, ignore_result=True, acks_late=True)
    def run_rank_task(job_id: Any, rank: Any) -> None:
        if type(job_id) is not int or type(rank) is not int:
            log.warning("%s: dropped a rank message %r/%r", state.name, job_id, rank)
            return
        run_rank(state, job_id, rank)
