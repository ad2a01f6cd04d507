"""How many connections one user, or one address over TCP, may hold open on the server.

Every request is a connection of its own (the CLI's client), so a user's share is a few at a time:
a `gpuq wait` or `run` follower holds one, a script's loop of submits one after the other. Without
a limit one user held thousands open, sending nothing, until the server had no file descriptor
left and every other user's `gpuq status` hung (found by an audit as a hostile user). Past
``MAX_PER_USER`` a user's new connection is closed at once, before it is read; root's never are.

The TCP listener's callers are known only once their request's MUNGE credential is read, which
anyone who reaches the port can put off (a body sent half, then nothing): there, each peer address
may hold ``MAX_PER_ADDRESS`` and all of them together ``MAX_TCP``, far below the descriptors the
server has, so the Unix socket's users are never starved by strangers on the network.
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
# Over TCP: one peer address (a node's gpuq clients, all its users), and every address together.
MAX_PER_ADDRESS = 256
MAX_TCP = 2048
# A user refused is logged at most this often.
SAY_EVERY = 60.0


class PerPeerLimit:
    """Counts the open connections on ``server`` (aiohttp's low-level server, which each
    connection's handler tells of its start and end) of each Unix-socket peer uid and each TCP
    peer address, and all TCP ones together; closes a new one past its limit."""

    def __init__(self, server: web.Server, limit: int = MAX_PER_USER, per_address: int = MAX_PER_ADDRESS,
                 tcp: int = MAX_TCP) -> None:
        self.limit, self.per_address, self.tcp = limit, per_address, tcp
        # By peer: a uid (the Unix socket) or an address (TCP); and by handler, its peer.
        self.open: dict[int | str, set[Any]] = defaultdict(set)
        self.peer_of: dict[Any, int | str] = {}
        self.tcp_open = 0
        self.said: dict[int | str, float] = {}
        self._made, self._lost = server.connection_made, server.connection_lost
        # The handler calls its server's connection_made and connection_lost: taken over on this one
        # server object (aiohttp has no hook for a connection before its first request).
        server.connection_made = self.connection_made  # type: ignore[method-assign]
        server.connection_lost = self.connection_lost  # type: ignore[method-assign]

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        peer = _peer_of(transport)
        if peer is not None and (why := self._over(peer)):
            now = time.monotonic()
            if now - self.said.get(peer, -SAY_EVERY) >= SAY_EVERY:
                self.said[peer] = now
                log.warning("%s: its new connections are closed", why)
            transport.close()  # its handler's connection_lost follows, and ends it
            return
        if peer is not None:
            self.open[peer].add(handler)
            self.peer_of[handler] = peer
            if isinstance(peer, str):
                self.tcp_open += 1
        self._made(handler, transport)

    def _over(self, peer: int | str) -> str | None:
        """Why ``peer`` may open no more connections now; None while it may."""
        held = len(self.open.get(peer, ()))
        if isinstance(peer, int):
            return f"uid {peer} holds {held} connections open, the most one user may" \
                if peer != 0 and held >= self.limit else None
        if held >= self.per_address:
            return f"{peer} holds {held} TCP connections open, the most one address may"
        if self.tcp_open >= self.tcp:
            return f"{self.tcp_open} TCP connections are open, the most the listener takes ({peer} asked)"
        return None

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        peer = self.peer_of.pop(handler, None)
        if peer is not None:
            handlers = self.open[peer]
            handlers.discard(handler)
            if not handlers:
                del self.open[peer]
            if isinstance(peer, str):
                self.tcp_open -= 1
        self._lost(handler, exc)


def _peer_of(transport: asyncio.Transport) -> int | str | None:
    """A connection's peer: its uid on the Unix socket, its address over TCP; None for a socket
    gone meanwhile."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    if sock.family != socket.AF_UNIX:
        peer = transport.get_extra_info("peername")
        return str(peer[0]) if peer else None
    try:
        return peer_uid(sock)
    except OSError:
        return None
