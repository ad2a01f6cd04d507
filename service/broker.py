"""Redis as gpuq uses it beside Celery: reachability checks, and the scheduler's wake-up list."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuq.service import constants as c
from gpuq.service.errors import Unreachable
from gpuq.service.settings import Settings, mask_url


if TYPE_CHECKING:
    import redis


def client(settings: Settings, timeout: float = c.BROKER_CONNECT_TIMEOUT) -> redis.Redis:
    import redis  # only the commands that talk to Redis pay for importing it

    return redis.Redis.from_url(settings.broker, socket_connect_timeout=timeout, socket_timeout=timeout + 30)


def wake_key(settings: Settings) -> str:
    return f"{settings.key_prefix}:wake"


def reachable(settings: Settings, timeout: float = 1.0) -> bool:
    import redis

    try:
        return bool(client(settings, timeout).ping())
    except redis.RedisError:
        return False


def check(settings: Settings) -> None:
    """Raise Unreachable naming the broker URL (password masked) unless Redis answers."""
    import redis

    try:
        client(settings).ping()
    except redis.RedisError as exc:
        raise Unreachable(f"cannot reach the broker at {mask_url(settings.broker)}: {_first_line(exc)}") from None


def wake_scheduler(settings: Settings, conn: redis.Redis | None = None) -> None:
    """Tell the scheduler there is something to place (a job submitted, a GPU freed).

    Best effort: a scheduler that misses it still finds the job on its next timed pass.
    """
    import redis

    try:
        r = conn or client(settings)
        pipe = r.pipeline()
        pipe.lpush(wake_key(settings), 1)
        pipe.ltrim(wake_key(settings), 0, 0)  # one pending wake-up is as good as many
        pipe.execute()
    except redis.RedisError:
        pass


def wait_for_wake(conn: redis.Redis, settings: Settings, timeout: float) -> bool:
    """Block until woken or ``timeout`` seconds pass; True if woken."""
    return conn.blpop([wake_key(settings)], timeout=max(timeout, 0.01)) is not None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
