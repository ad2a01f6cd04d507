"""Where a submit that copies a work tree (`--snapshot`) runs: a thread pool of its own, and at most
``PER_USER`` of one user's at once.

Every request's blocking work runs in the event loop's default pool, a handful of threads (six on
two cores). A snapshot's copy may take minutes (a work tree up to GPUQ_SNAPSHOT_MAX_BYTES, git
listing a large one, a slow disk), so a few such submits held every thread, and every other
user's `gpuq status` waited on them (found by an audit as a hostile user). Here they wait on their
own pool; a user's third waits for one of their two to end, and no other user's request waits.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")

# One user's snapshot submits that copy at once: a script submitting from two work trees goes on,
# a loop of a hundred waits its turn, two by two.
PER_USER = 2
# Copies of all users at once: past it a copy waits for a thread (the others' requests do not).
THREADS = 16


class Copies:
    """The pool snapshot submits run in, and each user's turn at it (by uid). Used from the
    event loop's thread only."""

    def __init__(self, threads: int = THREADS, per_user: int = PER_USER) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="gpuq-snapshot")
        self.per_user = per_user
        # By uid: the user's turns, and how many of their requests hold or wait for one.
        self._users: dict[int, tuple[asyncio.Semaphore, int]] = {}

    @asynccontextmanager
    async def turn(self, uid: int) -> AsyncIterator[None]:
        """Meanwhile, one of the user's ``per_user`` turns is this request's (it waits for one)."""
        turns, waiting = self._users.get(uid) or (asyncio.Semaphore(self.per_user), 0)
        self._users[uid] = (turns, waiting + 1)
        try:
            async with turns:
                yield
        finally:
            turns, waiting = self._users[uid]
            if waiting == 1:
                del self._users[uid]  # a user with nothing in flight holds no entry
            else:
                self._users[uid] = (turns, waiting - 1)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in this pool, with the caller's context (as ``asyncio.to_thread``)."""
        bound = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, bound)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


COPIES = web.AppKey("copies", Copies)


def install(app: web.Application) -> None:
    """Give ``app`` its pool for snapshot submits, shut down with it."""
    copies = Copies()
    app[COPIES] = copies

    async def close(_: web.Application) -> None:
        copies.close()

    app.on_cleanup.append(close)
