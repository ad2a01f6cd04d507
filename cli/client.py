"""The client's one way to the server: JSON over HTTP on the server's Unix socket (the kernel tells
the server who we are), or over TCP with a MUNGE credential bound to each request.

Only the standard library and gpuq's light modules (settings, errors, constants) are imported:
every `gpuq` command that a user runs pays for this module and nothing heavier.
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import stat
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from gpuq.service import constants as c
from gpuq.service.errors import ConfigError, GpuqError, NotAllowed, Unreachable
from gpuq.service.settings import SYSTEM_SOCKET, load_settings

if TYPE_CHECKING:
    import http.client


class Refused(GpuqError):
    """The server answered with an error: its line, and the exit code it gave."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Overdue(Unreachable):
    """A read riding out a server that went away reached its caller's deadline (`gpuq wait
    --timeout`) with the server still away; the caller ends as its deadline says."""


# Set by the `gpuq` command itself (cli/app.main): its one process may do without ssl.
LEAN = False

# A command that follows a job (`gpuq run`, `attach`, `wait`, `logs -f`, `alloc`) rides out a restart
# of its server (the stack's supervisor brings it back within about 2 s): a read that finds the
# server gone is asked again this often, for at most this long (or until the command's own
# deadline), before exit 69; quietly at first, then with one line on stderr.
RIDE_OUT_SECONDS = 30.0
RIDE_OUT_QUIET_SECONDS = 5.0
RIDE_OUT_RETRY_SECONDS = 0.25
# Seconds instead of RIDE_OUT_SECONDS: longer for a server slow to come back, 0 for none, a few
# for tests. The client's own knob, read by each request that may ride out: not a server setting.
RIDE_OUT_ENV = "GPUQ_RIDE_OUT"


@functools.lru_cache(maxsize=1)
def _http() -> ModuleType:
    """http.client; in the `gpuq` command's own process, without the ssl module it imports to offer
    HTTPS, which the client never speaks (a sixth of the client's imports). Elsewhere (tests, a
    benchmark) it is imported as usual."""
    if not LEAN or "ssl" in sys.modules or "http.client" in sys.modules:
        import http.client

        return http.client
    sys.modules["ssl"] = None  # type: ignore[assignment]  # `import ssl` fails inside http.client
    try:
        import http.client
    finally:
        del sys.modules["ssl"]
    return http.client


def unix_connection(path: str, timeout: float) -> http.client.HTTPConnection:
    """An HTTP connection over the Unix socket ``path``."""
    return _unix_connection_class()(path, timeout)


@functools.lru_cache(maxsize=1)
def _unix_connection_class() -> Callable[[str, float], http.client.HTTPConnection]:
    _http()  # http.client, imported as this process imports it (without ssl in the `gpuq` command)
    import http.client

    class UnixConnection(http.client.HTTPConnection):
        def __init__(self, path: str, timeout: float) -> None:
            super().__init__("localhost", timeout=timeout)
            self.path = path

        def connect(self) -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
            except BaseException:
                sock.close()
                raise
            self.sock = sock

    return UnixConnection


def server_address() -> str:
    """Where the server is: GPUQ_SERVER, else GPUQ_SOCKET, else the machine's socket
    (/run/gpuq/gpuq.sock) when it exists, else this user's own stack's (home/gpuq.sock)."""
    settings = load_settings()
    if settings.server:
        return settings.server
    if settings.socket:
        return settings.socket
    if os.path.exists(SYSTEM_SOCKET):
        return SYSTEM_SOCKET
    return str(settings.server_socket)


class Client:
    """Requests to one server; each opens its own connection (a command makes a few at most)."""

    def __init__(self, address: str | None = None, timeout: float = c.CLIENT_TIMEOUT_SECONDS,
                 headers: dict[str, str] | None = None) -> None:
        self.address = address or server_address()
        self.timeout = timeout
        self.headers = dict(headers or {})  # sent with every request (the dashboard's public view)
        self.answered = False  # whether the server has answered this client once: a later loss is a restart
        self.tls = False
        if self.address.startswith(("http://", "https://")):
            try:  # urlsplit and .port raise ValueError on a bracket left open or a port past 65535
                parts = urlsplit(self.address)
                hostname, port = parts.hostname, parts.port
            except ValueError:
                hostname = port = None
            if not hostname:
                raise Unreachable(f"GPUQ_SERVER {self.address[:200]}: use http(s)://host:port (MUNGE), a socket "
                                  "path or unix:PATH")
            self.tls = parts.scheme == "https"
            if self.tls:
                import ssl  # noqa: F401 - before http.client, which then offers HTTPS (see _http)
            self.tcp: tuple[str, int] | None = (hostname, port or (443 if self.tls else 80))
            self.socket_path = ""
        else:
            self.tcp = None
            self.socket_path = self.address.removeprefix("unix:")

    def _connection(self) -> http.client.HTTPConnection:
        if self.tcp is not None and self.tls:
            import ssl

            # The server's certificate, checked against the lab's CA (GPUQ_TLS_CA) or the system's.
            context = ssl.create_default_context(cafile=load_settings().tls_ca or None)
            return _http().HTTPSConnection(*self.tcp, timeout=self.timeout, context=context)
        if self.tcp is not None:
            return _http().HTTPConnection(*self.tcp, timeout=self.timeout)
        return unix_connection(self.socket_path, self.timeout)

    def get(self, path: str, *, ride_out: bool = False, deadline: float | None = None, **query: Any) -> Any:
        """``ride_out``: a server restarting (see ``request``) is asked again for up to
        RIDE_OUT_SECONDS, as a command that follows a job needs; ``deadline`` (time.monotonic())
        ends that sooner, with Overdue."""
        return self.request("GET", path, query=query, ride_out=ride_out, deadline=deadline)

    def post(self, path: str, body: dict[str, Any] | None = None, *, retries: int = 0,
             ride_out: bool = False) -> Any:
        """``ride_out`` as for ``get``: only for a post that is safe to send again (a keepalive, a
        submit with its idempotency key)."""
        return self.request("POST", path, body=body, retries=retries, ride_out=ride_out)

    def request(self, method: str, path: str, *, body: dict[str, Any] | None = None,
                query: dict[str, Any] | None = None, retries: int = 0, ride_out: bool = False,
                deadline: float | None = None) -> Any:
        """The answer's JSON; Refused for an error answer, Unreachable when no server answers
        (after ``retries`` more tries, for a request that is safe to send again, or, with
        ``ride_out``, after RIDE_OUT_SECONDS of a server restarting), Overdue when ``deadline``
        came first."""
        target = c.API_PREFIX + path
        q = {k: v for k, v in (query or {}).items() if v is not None}
        if q:
            target += "?" + urlencode(q)
        # ASCII JSON: text that is not UTF-8 (a lone surrogate from the OS) reaches the server as
        # the escape it is, and the server names it, rather than an undecodable body.
        data = b"" if body is None else json.dumps(body).encode("ascii")
        attempt = 0
        outage = _Outage(self.address, deadline) if ride_out else None
        timed_out = False
        while True:
            try:
                return self._once(method, target, data)
            except (OSError, _http().HTTPException) as exc:
                if self.tls and _tls_failed(exc):
                    raise Unreachable(f"the gpuq server at {self.address} failed TLS: {_reason(exc)} (GPUQ_TLS_CA "
                                      "names the CA that signed its certificate)") from None
                # A request safe to send again that timed out is asked once more at once: this
                # process may have been stopped (Ctrl-Z) past the timeout while its answer waited,
                # and the clock ran on; that is no server hanging. One that hangs times out twice.
                if isinstance(exc, socket.timeout) and (method == "GET" or ride_out) and not timed_out:
                    timed_out = True
                    continue
                # A follower's read waits for a server on its way back, until its ride-out or its
                # caller's deadline is over.
                if outage is not None and self._restarting(exc):
                    if outage.wait(exc):
                        continue
                    if outage.overdue:
                        raise Overdue(f"no gpuq server answers at {self.address}: {_reason(exc)}") from None
                if isinstance(exc, PermissionError) and self.tcp is None:
                    # Not a server that is down: one this user may not reach, as a stack of
                    # another user's own (its socket in their 0700 home): that user's alone.
                    raise NotAllowed(f"the gpuq server at {self.address} is closed to you (permission denied on "
                                     "its socket or a folder above it): it is another user's; use the machine's "
                                     "queue or one of your own (`gpuq up`)") from None
                # No server there at the first try: say so at once. A connection lost mid-request
                # (a server restarting) is tried again, for a request that is safe to repeat.
                never_there = attempt == 0 and isinstance(exc, (FileNotFoundError, ConnectionRefusedError))
                if attempt == retries or never_there:
                    raise Unreachable(f"no gpuq server answers at {self.address}: {_reason(exc)} "
                                      f"{_what_to_do(self.address)}") from None
                attempt += 1
                time.sleep(c.SUBMIT_RETRY_SECONDS)

    def _restarting(self, exc: BaseException) -> bool:
        """Whether ``exc`` looks like a server on its way back, which a ride-out waits for: one that
        answered this client before and is gone now; or, before any answer, a Unix socket that is
        there but refuses, since a server that dies (or is starting) leaves its socket and one
        that stops removes it (server/app.py). No socket at all, or TCP refused (a restart and a
        wrong port look alike), is no server: said at once."""
        if not _server_gone(exc):
            return False
        return self.answered or (isinstance(exc, ConnectionRefusedError) and self.tcp is None
                                 and _is_socket(self.socket_path))

    def _once(self, method: str, target: str, data: bytes) -> Any:
        headers = {**self.headers, "Content-Type": "application/json", "Content-Length": str(len(data))}
        if self.tcp is not None:
            from gpuq.service import munge

            settings = load_settings()
            headers["Authorization"] = f"{c.MUNGE_SCHEME} " + munge.encode(
                munge.payload(method, target, data), settings.munge_socket)
        conn = self._connection()
        try:
            conn.request(method, target, body=data or None, headers=headers)
            response = conn.getresponse()
            self.answered = True
            raw = response.read()
        finally:
            conn.close()
        try:
            answer = json.loads(raw or b"null")
        except ValueError:
            if 400 <= response.status < 500:  # refused by the HTTP layer before gpuq saw it (aiohttp's limits)
                said = raw.decode("utf-8", "replace").strip().splitlines()[:1] or [""]
                raise Refused(f"the server refused the request ({response.status} {said[0][:60]}): "
                              "a value too long?", c.EXIT_USAGE) from None
            raise Refused(f"the server gave a non-JSON answer ({response.status})", c.EXIT_SOFTWARE) from None
        if response.status >= 400:
            if isinstance(answer, dict) and "error" in answer:
                raise Refused(str(answer["error"]), int(answer.get("exit_code", c.EXIT_SOFTWARE)))
            raise Refused(f"the server answered {response.status}", c.EXIT_SOFTWARE)
        return answer


def ride_out_seconds() -> float:
    """How long a ride-out lasts: GPUQ_RIDE_OUT if set, else RIDE_OUT_SECONDS; ConfigError for a
    value that is not a number of seconds."""
    raw = os.environ.get(RIDE_OUT_ENV, "").strip()
    if not raw:
        return RIDE_OUT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"{RIDE_OUT_ENV} must be seconds (0 or more), got {raw[:40]!r}")
    return seconds


class _Outage:
    """One read's wait for a server that went away: how long it has lasted, whether it was said,
    and whether the caller's deadline is what ended it."""

    def __init__(self, address: str, deadline: float | None = None) -> None:
        self.address = address
        self.deadline = deadline
        self.limit = ride_out_seconds()
        self.began: float | None = None
        self.said = False
        self.overdue = False

    def wait(self, exc: BaseException) -> bool:
        """Sleep before the next try and return True, or False once the ride-out's time has passed
        (``overdue`` if the deadline came before it). Past RIDE_OUT_QUIET_SECONDS, says once on
        stderr that the server is not answering."""
        now = time.monotonic()
        if self.began is None:
            self.began = now
        until = self.began + self.limit
        by_deadline = self.deadline is not None and self.deadline < until
        if self.deadline is not None and by_deadline:
            until = self.deadline
        if now >= until:
            self.overdue = by_deadline
            return False
        if not self.said and now - self.began >= RIDE_OUT_QUIET_SECONDS:
            self.said = True
            # On a terminal, below whatever line is being rewritten (a waiting job's, a bar).
            try:
                sys.stderr.write(("\n" if sys.stderr.isatty() else "") + f"gpuq: the server at {self.address} is "
                                 f"not answering ({_reason(exc)}); trying again for up to "
                                 f"{round(until - self.began, 1):g} s\n")
                sys.stderr.flush()
            except (OSError, ValueError):  # the terminal is gone: nothing to tell it
                pass
        time.sleep(min(RIDE_OUT_RETRY_SECONDS, until - now))
        return True


def _server_gone(exc: BaseException) -> bool:
    """Whether ``exc`` is what a server that stopped or restarts looks like: the connection refused,
    reset or closed without an answer, its socket missing. Not a timeout (a server that hangs), not
    a permission refused."""
    http = _http()
    return isinstance(exc, (ConnectionError, FileNotFoundError, http.BadStatusLine, http.IncompleteRead))


def _what_to_do(address: str) -> str:
    """The advice after "no gpuq server answers": start one, unless this is a machine whose queue
    is root's (its socket's folder is there) and this user's own socket was looked at only because
    the machine's was missing a moment: then that queue is down or restarting, and a stack of one's
    own (what "start one with `gpuq up`" led to) is not the queue the others use."""
    if address.startswith(("http://", "https://")):
        # A TLS listener asked in plain HTTP closes the connection, and the reverse fails TLS.
        return "(is its server up, listening there, and speaking the scheme GPUQ_SERVER gives, http or https?)"
    settings = load_settings()
    if address != SYSTEM_SOCKET and os.path.isdir(os.path.dirname(SYSTEM_SOCKET)) and not (
            settings.server or settings.socket):
        return (f"(nor at the machine's {SYSTEM_SOCKET}: its gpuq is down or restarting; try again in a moment, or "
                "ask whoever runs it)")
    return "(start one with `gpuq up`, or set GPUQ_SERVER)"


def _is_socket(path: str) -> bool:
    """Whether a socket file is at ``path`` (not a file named by mistake, which refuses too)."""
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _tls_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is TLS's own failure (an unverified certificate, a handshake), not the network's."""
    import ssl  # imported already where TLS was spoken

    return isinstance(exc, ssl.SSLError)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "no socket there"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, PermissionError):
        return "permission denied"
    if isinstance(exc, socket.timeout):
        return "timed out"
    return " ".join(str(exc).split()) or type(exc).__name__
