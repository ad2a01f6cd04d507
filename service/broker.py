"""Redis as gpuq uses it beside Celery: reachability checks, and the scheduler's wake-up list."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from gpuq.service import constants as c
from gpuq.service.errors import Unreachable
from gpuq.service.settings import Settings, mask_url

if TYPE_CHECKING:
    import redis


def client(settings: Settings, timeout: float = c.BROKER_CONNECT_TIMEOUT) -> redis.Redis:
    import redis  # only the commands that talk to Redis pay for importing it

    return redis.Redis.from_url(settings.broker, socket_connect_timeout=timeout, socket_timeout=timeout + 30)


_shared: dict[str, redis.Redis] = {}


def shared(settings: Settings) -> redis.Redis:
    """This process's one client of the broker for gpuq's own keys (its pool survives a fork:
    redis-py opens new connections in the child)."""
    if settings.broker not in _shared:
        _shared[settings.broker] = client(settings)
    return _shared[settings.broker]


def wake_key(settings: Settings) -> str:
    return f"{settings.key_prefix}:wake"


def reachable(settings: Settings, timeout: float = 1.0) -> bool:
    import redis

    try:
        return bool(client(settings, timeout).ping())
    except redis.RedisError:
        return False


def asks_no_password(settings: Settings, timeout: float = 1.0) -> bool:
    """Whether the Redis on the managed port answers a client that gives a wrong password: one that
    asks for none, so not a stack's own (each guards its Redis with a generated password). redis-py
    takes a Redis without a password for one that accepted any it was given."""
    import uuid

    import redis

    try:
        return bool(redis.Redis(host="127.0.0.1", port=settings.redis_port, password=uuid.uuid4().hex,
                                socket_connect_timeout=timeout, socket_timeout=timeout).ping())
    except redis.RedisError:
        return False


# When this process last heard from each broker (time.monotonic()): a long-lived process (the
# server) that did within BROKER_TRUSTED_SECONDS skips the ping, one Redis round trip a submit.
_heard: dict[str, float] = {}


def check(settings: Settings) -> None:
    """Raise Unreachable naming the broker URL (password masked) unless Redis answers (or answered
    this process a moment ago)."""
    import redis

    if time.monotonic() - _heard.get(settings.broker, -math.inf) < c.BROKER_TRUSTED_SECONDS:
        return
    try:
        shared(settings).ping()
    except redis.RedisError as exc:
        raise Unreachable(f"cannot reach the broker at {mask_url(settings.broker)}: {_first_line(exc)}") from None
    _heard[settings.broker] = time.monotonic()


def wake_scheduler(settings: Settings) -> None:
    """Tell the scheduler there is something to place (a job submitted, a GPU freed).

    Best effort: a scheduler that misses it still finds the job on its next timed pass.
    """
    import redis

    try:
        pipe = shared(settings).pipeline()
        _push_wake(pipe, settings)
        pipe.execute()
        _heard[settings.broker] = time.monotonic()
    except redis.RedisError:
        _heard.pop(settings.broker, None)


def _push_wake(pipe: Any, settings: Settings) -> None:
    pipe.lpush(wake_key(settings), 1)
    pipe.ltrim(wake_key(settings), 0, 0)  # one pending wake-up is as good as many


def dispatch_key(settings: Settings) -> str:
    return f"{settings.key_prefix}:dispatch"


def hand_over(settings: Settings, placed: list[tuple[int, str]], wake: bool = False) -> None:
    """Hand the scheduler jobs placed at submit, (job id, queue) each, to send; with ``wake``,
    wake it for a pass too (some jobs of the submission still wait).

    Best effort: a job whose message is never sent is sent again once it has waited
    ``resend_after`` seconds unclaimed, as any dispatched job."""
    import redis

    try:
        pipe = shared(settings).pipeline()
        pipe.rpush(dispatch_key(settings), *(f"{job_id} {queue}" for job_id, queue in placed))
        if wake:
            _push_wake(pipe, settings)
        pipe.execute()
        _heard[settings.broker] = time.monotonic()
    except redis.RedisError:
        _heard.pop(settings.broker, None)


# What ended the scheduler's wait: a wake-up (a pass is due), jobs handed over to send (no pass
# needed), or the timeout.
WOKEN, HANDED, TIMEOUT = "woken", "handed", "timeout"


def wait_for_wake(conn: redis.Redis, settings: Settings, timeout: float) -> tuple[str, list[str]]:
    """Block until woken, handed jobs, or ``timeout`` seconds pass. Returns which (WOKEN, HANDED,
    TIMEOUT), and the jobs handed over to send ("JOB_ID QUEUE" each, see ``hand_over``), taken
    off the list."""
    got = conn.blpop([dispatch_key(settings), wake_key(settings)], timeout=max(timeout, 0.01))
    if got is None:
        return TIMEOUT, []
    if got[0].decode() != dispatch_key(settings):  # type: ignore[union-attr] # bytes: no decode_responses
        return WOKEN, []
    pipe = conn.pipeline()  # the rest handed over meanwhile, in one round trip (MULTI/EXEC)
    pipe.lrange(dispatch_key(settings), 0, -1)
    pipe.delete(dispatch_key(settings))
    rest, _ = pipe.execute()
    return HANDED, [e.decode(errors="replace") for e in (got[1], *rest)]


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
