"""The dashboard's web server: a small WSGI app on the standard library's server, one thread per
request. Read-only: it answers GET and HEAD, and reads the server's API in its public view."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from html import escape
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from gpuq.cli.client import Client
from gpuq.service import constants as c
from gpuq.service.errors import GpuqError
from gpuq.web import metrics, pages
from gpuq.web.html import page

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

log = logging.getLogger("gpuq.dashboard")

_JOB = re.compile(r"^/jobs/(\d{1,18})/?$")
HTML = "text/html; charset=utf-8"


class App:
    """The WSGI application reading one gpuq server through ``api`` (a public-view client)."""

    def __init__(self, api: Client) -> None:
        self.api = api

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        method, path = environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO", "/")
        if method not in ("GET", "HEAD"):
            return self._send(start_response, "405 Method Not Allowed", HTML,
                              page("read-only", "<p>The dashboard is read-only.</p>").encode(),
                              [("Allow", "GET, HEAD")])
        query = parse_qs(environ.get("QUERY_STRING", ""))
        try:
            status, kind, body = self._route(path, query)
        except GpuqError as exc:
            if exc.exit_code == c.EXIT_NOT_FOUND:  # no such job: the server's line
                status, kind, body = "404 Not Found", HTML, page("not found", f"<p>{escape(str(exc))}</p>").encode()
            else:  # the server is down, or its database is: say so, as the CLI does
                log.warning("dashboard: %s", exc)
                status, kind, body = ("503 Service Unavailable", HTML,
                                      page("unavailable", f"<p>{escape(str(exc))}</p>").encode())
        return self._send(start_response, status, kind, body, head=method == "HEAD")

    def _route(self, path: str, query: dict[str, list[str]]) -> tuple[str, str, bytes]:
        if path == "/":
            return "200 OK", HTML, pages.queue(self.api).encode()
        if path == "/metrics":
            body, kind = metrics.exposition(self.api)
            return "200 OK", kind, body
        if path in ("/usage", "/usage/"):
            period = query.get("period", ["day"])[0]
            if period not in pages.PERIODS:
                return "400 Bad Request", HTML, page("bad period", "<p>period is day or week</p>").encode()
            return "200 OK", HTML, pages.usage_page(self.api, period).encode()
        if path in ("/history", "/history/"):
            period, user, ended = (query.get(k, [d])[0] for k, d in (("period", "day"), ("user", ""), ("state", "")))
            if period not in pages.PERIODS or (ended and ended not in c.END_STATES) or len(user) > 64:
                return "400 Bad Request", HTML, page("bad request", "<p>period is day or week; state an end "
                                                                    "state; user a user's name</p>").encode()
            return "200 OK", HTML, pages.history_page(self.api, period, user or None, ended or None).encode()
        match = _JOB.match(path)
        if match:
            return "200 OK", HTML, pages.job(self.api, int(match.group(1))).encode()
        return "404 Not Found", HTML, page("not found", "<p>no such page</p>").encode()

    @staticmethod
    def _send(start_response: StartResponse, status: str, kind: str, body: bytes,
              extra: list[tuple[str, str]] | None = None, head: bool = False) -> list[bytes]:
        start_response(status, [("Content-Type", kind), ("Content-Length", str(len(body))),
                                ("Cache-Control", "no-store"), *(extra or [])])
        return [b""] if head else [body]


class ThreadingServer(ThreadingMixIn, WSGIServer):
    """A page that waits on the server must not hold up a Prometheus scrape, nor the other way round."""

    daemon_threads = True
    allow_reuse_address = True
    server_address: tuple[str, int]  # an AF_INET socket's (host, port)


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.info("%s %s", self.address_string(), format % args)


def serve(api: Client, host: str, port: int) -> ThreadingServer:
    """A server for the dashboard bound to host:port (port 0: any free one); call serve_forever()."""
    return make_server(host, port, App(api), server_class=ThreadingServer, handler_class=QuietHandler)
