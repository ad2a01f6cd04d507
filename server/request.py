"""What every route does with its request: the server's settings, the caller, the JSON body, and
blocking service calls run off the event loop."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from aiohttp import web
from sqlalchemy.orm import Session

from gpuq.service.constants import API_PREFIX
from gpuq.service.db import read_scope, require_schema
from gpuq.service.errors import InvalidSpec, JobNotFound, NotAllowed
from gpuq.service.rights import Caller
from gpuq.service.settings import Settings
from gpuq.service.units import MAX_JOB_ID

SETTINGS = web.AppKey("settings", Settings)
# Who is asking, set by the identity middleware (server/app.py); None for the public view.
CALLER = web.RequestKey[Caller | None]("caller")
T = TypeVar("T")
MAX_IDS = 100_000  # job ids one request may name
JOB = API_PREFIX + r"/jobs/{id:\d+}"  # one job's routes


def context(request: web.Request) -> tuple[Settings, Caller | None]:
    """The server's settings and who is asking (set by the identity middleware): None for a
    request that asked for the public view (the dashboard's), which may read what all may see."""
    return request.app[SETTINGS], request[CALLER]


def acting(request: web.Request) -> tuple[Settings, Caller]:
    """``context`` for what acts as the caller in person (a change, the caller's own jobs): the
    identity middleware refuses these to the public view, and so does this, should a route forget."""
    settings, caller = context(request)
    if caller is None:
        raise NotAllowed(f"{request.method} {request.path} acts as a user, and this request asked for the public view")
    return settings, caller


async def call(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking service call (SQLAlchemy, Redis) in the thread pool, off the event loop."""
    return await asyncio.to_thread(fn, *args)


# What a body's field is to a user, for the line that refuses it.
_FIELD_WORDS = {"cwd": "the current directory's path", "command": "the command", "args": "a workload parameter",
                "env": "an --env value", "name": "--name"}
# JSON's escape for half of a UTF-16 pair: a lone one (what Python's json writes for bytes of another
# encoding in an argument) decodes to text that no database or pipe can encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


# How deep a request body may nest: gpuq's own requests go three or four levels down.
MAX_DEPTH = 32


def _deeper_than(data: Any, limit: int) -> bool:
    """Whether ``data`` (parsed JSON) nests deeper than ``limit``, looked at without recursion."""
    level = [data]
    for _ in range(limit + 1):
        level = [v for item in level if isinstance(item, (dict, list))
                 for v in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return False
    return True


async def body_of(request: web.Request) -> dict[str, Any]:
    """The request's JSON object; InvalidSpec for anything else, or for text that is not UTF-8."""
    raw = await request.read() or b"{}"
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidSpec("the request body is not JSON") from None
    except RecursionError:  # a body nested thousands deep: was a 500 and a traceback a request
        raise InvalidSpec(f"the request body is nested more than {MAX_DEPTH} deep") from None
    if not isinstance(data, dict):
        raise InvalidSpec("the request body must be a JSON object")
    if _deeper_than(data, MAX_DEPTH):
        # Nothing gpuq takes nests past a few levels; what does would recurse later (json.dumps
        # into a row, a copy of the spec) where a RecursionError is nobody's error to report.
        raise InvalidSpec(f"the request body is nested more than {MAX_DEPTH} deep")
    if _SURROGATE_ESCAPE.search(raw):  # rare: checked in full only then
        for key, value in data.items():
            try:
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidSpec(f"{_FIELD_WORDS.get(key, key)} is not valid UTF-8 text "
                                  "(bytes of another encoding)") from None
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


def job_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidSpec(f"ids must be job ids separated by commas, got {text[:60]!r}") from None
    return bounded(ids)


def bounded(ids: list[int]) -> list[int]:
    """``ids``, if a request may name that many; InvalidSpec otherwise, and JobNotFound for one
    no job can have."""
    if not 1 <= len(ids) <= MAX_IDS:
        raise InvalidSpec(f"name between 1 and {MAX_IDS:,} job ids")
    for job_id in ids:
        if not 1 <= job_id <= MAX_JOB_ID:
            raise JobNotFound(f"no job {job_id}")
    return ids
