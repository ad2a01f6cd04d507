"""`gpuq server`: the aiohttp application, its error and identity middlewares, and where it listens.

Every answer is JSON. An error is ``{"error": one line, "exit_code": N}`` with the HTTP status
that fits, so the client prints the line and exits with gpuq's code for it. Service calls are
blocking (SQLAlchemy), so they run in the default thread pool, never on the event loop; a submit
that copies a work tree, which may take minutes, in a pool of its own (server/copies.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from gpuq.server import cluster_api, config_api, copies, identity, jobs_api, metrics_api, moves_api
from gpuq.server.connections import PerPeerLimit
from gpuq.server.histograms import Settled
from gpuq.server.request import CALLER, SETTINGS
from gpuq.service import broker, kept_jobs, stack, system_home
from gpuq.service import constants as c
from gpuq.service.db import require_schema
from gpuq.service.errors import ConfigError, GpuqError, NotAllowed, StackError
from gpuq.service.rights import check_served
from gpuq.service.setting_checks import listen_address
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.server")


# gpuq's exit code → the HTTP status an answer carries (for curl users and proxies).
_STATUS = {c.EXIT_USAGE: 400, c.EXIT_NOT_FOUND: 404, c.EXIT_CONFLICT: 409, c.EXIT_OVER_LIMIT: 429,
           c.EXIT_NOT_ALLOWED: 403, c.EXIT_UNAVAILABLE: 503, c.EXIT_CONFIG: 500, c.EXIT_SOFTWARE: 500}


def error(message: str, exit_code: int, status: int | None = None) -> web.Response:
    """gpuq's JSON error; ``status`` where the HTTP layer gave its own, else the exit code's."""
    return web.json_response({"error": message, "exit_code": exit_code},
                             status=status or _STATUS.get(exit_code, 500))


@web.middleware
async def _answers(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
    """gpuq's errors (and aiohttp's own: no such path, wrong method, body too large) as JSON."""
    try:
        caller = request[CALLER] = await identity.caller_of(request, request.app[SETTINGS])
        check_served(caller)
        if request.headers.get(c.VIEW_HEADER, "").strip().lower() == c.PUBLIC_VIEW:
            request[CALLER] = None
            _check_public(request)
        return await handler(request)
    except GpuqError as exc:
        return error(str(exc), exc.exit_code)
    except web.HTTPException as exc:
        if exc.status >= 400:
            # With aiohttp's own status (404 no such path, 405 wrong method, 413 too large): a
            # client of the API, curl or a script, reads that, and the exit code is a usage error.
            return error(f"{request.method} {request.path}: {exc.reason}", c.EXIT_USAGE, exc.status)
        raise
    except Exception:  # a bug: logged in full, one line to the client
        log.exception("%s %s failed", request.method, request.path_qs)
        return error(f"the server failed on {request.method} {request.path}; see its log", c.EXIT_SOFTWARE)


def _check_public(request: web.Request) -> None:
    """NotAllowed for what a public view cannot ask: any change (it is nobody, so owns nothing and
    may submit nothing), and the reads that are about the caller in person."""
    personal = request.path == c.API_PREFIX + "/jobs/active" or request.query.get("mine") in ("1", "true")
    if request.method not in ("GET", "HEAD") or personal:
        raise NotAllowed(f"{request.method} {request.path} acts as a user, and this request asked for the "
                         f"public view ({c.VIEW_HEADER}: {c.PUBLIC_VIEW})")


def make_app(settings: Settings) -> web.Application:
    app = web.Application(middlewares=[_answers], client_max_size=c.MAX_REQUEST_BYTES)
    app[SETTINGS] = settings
    app[metrics_api.SETTLED] = Settled()
    copies.install(app)
    app[identity.DECODING] = asyncio.Semaphore(identity.DECODING_AT_ONCE)
    app.add_routes(jobs_api.routes)
    app.add_routes(moves_api.routes)
    app.add_routes(cluster_api.routes)
    app.add_routes(metrics_api.routes)
    app.add_routes(config_api.routes)
    return app


def _bind_unix(path: Path) -> socket.socket:
    """The server's socket at ``path``, connectable by every local user (who they are is the
    kernel's to say). A socket left by a dead server is replaced; a live one is refused."""
    system_home.socket_folder(path)
    if path.exists():
        if stack.answers(path):
            raise StackError(f"a gpuq server already answers on {path}")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o666)
    return sock


def _tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The TCP listener's TLS (GPUQ_TLS_CERT, GPUQ_TLS_KEY), or None for plain HTTP; ConfigError,
    one line, for a certificate or key that cannot be loaded."""
    if not settings.tls_cert:
        if settings.tls_key:
            raise ConfigError("GPUQ_TLS_KEY is set without GPUQ_TLS_CERT")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(settings.tls_cert, settings.tls_key or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"GPUQ_TLS_CERT {settings.tls_cert}: cannot load the certificate and key: "
                          f"{' '.join(str(exc).split())}") from None
    return context


# Seconds a connection may stay open between requests, or before its first.
IDLE_SECONDS = 15.0


async def serve(settings: Settings, stop: asyncio.Event, ready: Callable[[], None] | None = None) -> None:
    """Serve until ``stop`` is set: on the Unix socket, and on TCP with MUNGE if GPUQ_LISTEN says so."""
    tls = _tls_context(settings) if settings.listen else None  # a bad certificate: nothing starts
    # A connection that sends no request is closed after IDLE_SECONDS (aiohttp's keep-alive
    # timeout, which it also applies before a first request): the CLI opens one per request.
    runner = web.AppRunner(make_app(settings), access_log=None, handle_signals=False, keepalive_timeout=IDLE_SECONDS)
    await runner.setup()
    assert runner.server is not None
    PerPeerLimit(runner.server)  # no user, nor TCP peer, can take every descriptor the server has
    path = settings.server_socket
    sock = _bind_unix(path)
    try:
        await web.SockSite(runner, sock).start()
        where = [str(path)]
        if settings.listen:
            host, port = listen_address(settings.listen)
            await web.TCPSite(runner, host, port, reuse_address=True, ssl_context=tls).start()
            where.append(f"{host}:{port} (MUNGE{', TLS' if tls else ''})")
        log.info("gpuq server listening on %s", ", ".join(where))
        beating = asyncio.create_task(_beat(settings))
        if ready is not None:
            ready()
        await stop.wait()
        beating.cancel()
        await _say_up(settings, None)
    finally:
        await runner.cleanup()
        path.unlink(missing_ok=True)


async def _beat(settings: Settings) -> None:
    """Say that this server is up, and since when, for as long as it serves: the clients that keep
    jobs speak through it, so their silence counts only then (service/kept_jobs.py)."""
    since = time.time()
    while True:
        await _say_up(settings, since)
        await asyncio.sleep(kept_jobs.beat_every(settings))


async def _say_up(settings: Settings, since: float | None) -> None:
    try:
        await asyncio.to_thread(kept_jobs.beat, broker.shared(settings), settings, since)
    except Exception:
        log.warning("could not tell the broker this server is up", exc_info=True)


def run(settings: Settings) -> None:
    """`gpuq server`: serve in the foreground until SIGTERM or SIGINT."""
    require_schema(settings)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(settings, stop)

    asyncio.run(main())
