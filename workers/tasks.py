"""The Celery task: a thin adapter from a message to ``runner.run_job``."""

from __future__ import annotations

import logging

from celery import Celery

from gpuq.service import constants as c
from gpuq.workers.runner import WorkerState, run_job, run_rank

log = logging.getLogger("gpuq.worker")


def register(app: Celery, state: WorkerState) -> None:
    @app.task(name=c.RUN_JOB_TASK, ignore_result=True, acks_late=True)
    def run_job_task(job_id):
        # The message is only a pointer into SQL; anything but a job id is dropped.
        if type(job_id) is not int:
            log.warning("%s: dropped a message with job id %r", state.name, job_id)
            return
        run_job(state, job_id)

    @app.task(name=c.RUN_RANK_TASK, ignore_result=True, acks_late=True)
    def run_rank_task(job_id, rank):
        if type(job_id) is not int or type(rank) is not int:
            log.warning("%s: dropped a rank message %r/%r", state.name, job_id, rank)
            return
        run_rank(state, job_id, rank)
