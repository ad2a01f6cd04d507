"""Who is asking: the uid the kernel gives for a Unix socket's peer (SO_PEERCRED), or the one
munged vouches for in a MUNGE credential bound to this very request. Nothing the request says
about itself (a header, a field, a variable) changes it."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from gpuq.service import constants as c
from gpuq.service import munge
from gpuq.service.errors import NotAllowed
from gpuq.service.peer import peer_of
from gpuq.service.rights import Caller
from gpuq.service.settings import Settings


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel recorded it when
    that process connected."""
    return peer_of(sock).uid


async def caller_of(request: web.Request, settings: Settings) -> Caller:
    """The caller of ``request``; NotAllowed for a TCP request without a good credential."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None and sock.family == socket.AF_UNIX:
        return Caller.of_uid(peer_uid(sock))
    scheme, _, credential = request.headers.get("Authorization", "").partition(" ")
    if scheme != c.MUNGE_SCHEME or not credential.strip():
        raise NotAllowed("a request over TCP needs a MUNGE credential (Authorization: MUNGE ...)")
    body = await request.read()
    decoded = await asyncio.to_thread(munge.decode, credential.strip(), settings.munge_socket)
    expected = munge.payload(request.method, request.raw_path, body)
    if decoded.payload != expected:
        # A credential captured from another request (or made for another body) is no good here.
        raise NotAllowed("the MUNGE credential was made for another request")
    return Caller.of_uid(decoded.uid)
