"""How many connections one user may hold open on the server's Unix socket.

Every request is a connection of its own (the CLI's client), so a user's share is a few at a time:
a `gpuq wait` or `run` follower holds one, a script's loop of submits one after the other. Without
a limit one user held thousands open, sending nothing, until the server had no file descriptor
left and every other user's `gpuq status` hung (found by an audit as a hostile user). Past
``MAX_PER_USER`` a user's new connection is closed at once, before it is read; root's never are.
The TCP listener's callers are known only once their request's MUNGE credential is read, so it
is not limited here.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import defaultdict
from typing import Any

from aiohttp import web

from gpuq.server.identity import peer_uid

log = logging.getLogger("gpuq.server")

# Connections one user may hold open at once: far above what gpuq's own commands take (one each),
# far below the server's file descriptors (20,000 here).
MAX_PER_USER = 256
# A user refused is logged at most this often.
SAY_EVERY = 60.0


class PerUserLimit:
    """Counts the open Unix-socket connections of each peer uid on ``server`` (aiohttp's low-level
    server, which each connection's handler tells of its start and end) and closes a new one past
    ``limit``."""

    def __init__(self, server: web.Server, limit: int = MAX_PER_USER) -> None:
        self.limit = limit
        self.open: dict[int, set[Any]] = defaultdict(set)
        self.said: dict[int, float] = {}
        self._made, self._lost = server.connection_made, server.connection_lost
        # The handler calls its server's connection_made and connection_lost: taken over on this one
        # server object (aiohttp has no hook for a connection before its first request).
        server.connection_made = self.connection_made  # type: ignore[method-assign]
        server.connection_lost = self.connection_lost  # type: ignore[method-assign]

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        uid = _uid_of(transport)
        if uid is not None and uid != 0 and len(self.open[uid]) >= self.limit:
            now = time.monotonic()
            if now - self.said.get(uid, -SAY_EVERY) >= SAY_EVERY:
                self.said[uid] = now
                log.warning("uid %s holds %d connections open, the most one user may: its new ones are closed",
                            uid, self.limit)
            transport.close()  # its handler's connection_lost follows, and ends it
            return
        if uid is not None:
            self.open[uid].add(handler)
        self._made(handler, transport)

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        for uid, handlers in list(self.open.items()):
            if handler in handlers:
                handlers.discard(handler)
                if not handlers:
                    del self.open[uid]
                break
        self._lost(handler, exc)


def _uid_of(transport: asyncio.Transport) -> int | None:
    """The peer uid of a Unix-socket connection; None for TCP (or a socket gone meanwhile)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        return peer_uid(sock)
    except OSError:
        return None
