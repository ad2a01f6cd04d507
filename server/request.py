"""What every route does with its request: the server's settings, the caller, the JSON body, and
blocking service calls run off the event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from aiohttp import web
from sqlalchemy.orm import Session

from gpuq.service.db import read_scope, require_schema
from gpuq.service.errors import InvalidSpec, JobNotFound
from gpuq.service.rights import Caller
from gpuq.service.settings import Settings
from gpuq.service.units import MAX_JOB_ID

SETTINGS = web.AppKey("settings", Settings)
T = TypeVar("T")


def context(request: web.Request) -> tuple[Settings, Caller]:
    """The server's settings and who is asking (set by the identity middleware)."""
    return request.app[SETTINGS], request["caller"]


async def call(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking service call (SQLAlchemy, Redis) in the thread pool, off the event loop."""
    return await asyncio.to_thread(fn, *args)


async def body_of(request: web.Request) -> dict[str, Any]:
    """The request's JSON object; InvalidSpec for anything else."""
    try:
        data = json.loads(await request.read() or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise InvalidSpec("the request body is not JSON") from None
    if not isinstance(data, dict):
        raise InvalidSpec("the request body must be a JSON object")
    return data


@contextmanager
def reading(settings: Settings) -> Iterator[Session]:
    """A read-only session on a database at this gpuq's schema (SchemaOutOfDate otherwise): every
    read route's. It takes no write lock, so a read never waits behind the workers' writes."""
    require_schema(settings)
    with read_scope(settings) as session:
        yield session


def job_id_of(request: web.Request) -> int:
    """The job or array id in the path (digits, by the route). One larger than any id can be is
    no job, not a number the database cannot take (SQLite's 64 bits, PostgreSQL's 32)."""
    found = int(request.match_info["id"])
    if found > MAX_JOB_ID:
        what = "array" if "/arrays/" in request.path else "job"
        raise JobNotFound(f"no {what} {found}")
    return found
