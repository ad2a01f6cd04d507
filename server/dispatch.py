"""The server sends the messages of jobs placed at submit itself: it keeps a Celery app for its
lifetime, so a submit's job reaches its worker without waiting for the scheduler to pass it on.
They are sent once the client has its answer (``moves_api.submit``), so publishing them, a fifth
of a submit's CPU here, is no part of the request's round trip."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from gpuq.service import broker
from gpuq.service.settings import Settings

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger("gpuq.server")


@functools.lru_cache(maxsize=4)
def _app(settings: Settings) -> Celery:
    from gpuq.service.celery_app import make_app

    return make_app(settings)


def send(settings: Settings, messages: list[tuple[int, str]]) -> None:
    """Send each placed job's message, (job id, queue) each; those the broker would not take go to
    the scheduler, which sends them (or, if Redis is down, sends them again once unclaimed)."""
    from gpuq.service.celery_app import send_run_job

    unsent = []
    for job_id, queue in messages:
        try:
            send_run_job(_app(settings), queue, job_id)
        except Exception as exc:  # noqa: BLE001 - any broker failure: the scheduler's to send
            log.warning("job %s: could not send to %s (%s); the scheduler will", job_id, queue, exc)
            unsent.append((job_id, queue))
    if unsent:
        broker.hand_over(settings, unsent)
