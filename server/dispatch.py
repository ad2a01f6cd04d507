"""The server sends the messages of jobs placed at submit itself: it keeps a Celery app for its
lifetime, so a submit's job reaches its worker without waiting for the scheduler to pass it on."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from gpuq.service.settings import Settings

if TYPE_CHECKING:
    from celery import Celery

    from gpuq.service.submitting import Sender

log = logging.getLogger("gpuq.server")


@functools.lru_cache(maxsize=4)
def _app(settings: Settings) -> Celery:
    from gpuq.service.celery_app import make_app

    return make_app(settings)


def sender(settings: Settings) -> Sender:
    """``submitting.submit_all``'s ``send`` for this server: sends each placed job's message, and
    returns those it could not (the scheduler sends them, or sends them again once unclaimed)."""

    def send(messages: list[tuple[int, str]]) -> list[tuple[int, str]]:
        from gpuq.service.celery_app import send_run_job

        unsent = []
        for job_id, queue in messages:
            try:
                send_run_job(_app(settings), queue, job_id)
            except Exception as exc:  # noqa: BLE001 - any broker failure: the scheduler's to send
                log.warning("job %s: could not send to %s (%s); the scheduler will", job_id, queue, exc)
                unsent.append((job_id, queue))
        return unsent

    return send
