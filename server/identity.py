"""Who is asking: the uid the kernel gives for a Unix socket's peer (SO_PEERCRED), or the one
munged vouches for in a MUNGE credential bound to this very request. Nothing the request says
about itself (a header, a field, a variable) changes it."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from gpuq.service import constants as c
from gpuq.service import munge
from gpuq.service.errors import InvalidSpec, NotAllowed
from gpuq.service.peer import peer_of
from gpuq.service.rights import Caller
from gpuq.service.settings import Settings

# Seconds a TCP request's body may take to arrive, before its credential is checked.
BODY_SECONDS = 10.0
# MUNGE credentials decoded at once, by the app's turns (each an `unmunge` process in a thread of
# the default pool): garbage credentials by the hundred took every thread.
DECODING = web.AppKey("decoding", asyncio.Semaphore)
DECODING_AT_ONCE = 4


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
    if (request.content_length or 0) > c.MAX_REQUEST_BYTES:
        raise InvalidSpec(f"the request body is larger than {c.MAX_REQUEST_BYTES} bytes")
    try:
        # A body sent half, then nothing, held its connection (a descriptor) for as long as its
        # sender liked, before anyone knew who it was.
        body = await asyncio.wait_for(request.read(), BODY_SECONDS)
    except TimeoutError:
        raise NotAllowed(f"the request's body did not arrive within {BODY_SECONDS:g} s") from None
    async with request.app[DECODING]:
        decoded = await asyncio.to_thread(munge.decode, credential.strip(), settings.munge_socket)
    expected = munge.payload(request.method, request.raw_path, body)
    if decoded.payload != expected:
        # A credential captured from another request (or made for another body) is no good here.
        raise NotAllowed("the MUNGE credential was made for another request")
    return Caller.of_uid(decoded.uid)
