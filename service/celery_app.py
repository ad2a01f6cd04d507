"""The Celery app: transport only. Truth is in SQL; a message carries nothing but a job id."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuq.service import constants as c
from gpuq.service.settings import Settings

if TYPE_CHECKING:
    from celery import Celery


def queue_name(settings: Settings, node: str, index: int) -> str:
    """The queue of the worker of GPU ``index`` on ``node``: each GPU has its own."""
    return f"{settings.key_prefix}.gpu.{node}.{index}"


def make_app(settings: Settings) -> Celery:
    # Celery is imported here, not above: a queue's name is all that the supervisor (which leaves a
    # GPU out under its queue's name) and the server's reads need of this module.
    from celery import Celery

    app = Celery("gpuq", broker=settings.broker, set_as_current=False)
    app.conf.update(
        # JSON only: a pickle pushed into Redis is refused, not unpickled.
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,
        # One job at a time per GPU, acknowledged when it ends: a worker that dies mid-job leaves
        # its message to be delivered again, and the SQL claim makes the redelivery harmless.
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=c.BROKER_CONNECT_TIMEOUT,
        # A GPU job may run for days; Redis must not hand its message to another consumer meanwhile.
        broker_transport_options={"visibility_timeout": settings.visibility_timeout},
        task_default_queue=f"{settings.key_prefix}.default",
        task_create_missing_queues=True,
    )
    return app


def send_run_job(app: Celery, queue: str, job_id: int) -> None:
    """Send the message that asks the worker listening on ``queue`` to run job ``job_id``."""
    app.send_task(c.RUN_JOB_TASK, args=[job_id], queue=queue, routing_key=queue, retry=False)


def send_run_rank(app: Celery, queue: str, job_id: int, rank: int) -> None:
    """Ask the worker listening on ``queue`` to run rank ``rank`` of job ``job_id``."""
    app.send_task(c.RUN_RANK_TASK, args=[job_id, rank], queue=queue, routing_key=queue, retry=False)
