"""The dashboard's reads: the server's API (``/v1/...``), as the CLI reads it, always in the public
view (``X-Gpuq-View: public``), so the server answers every page and scrape as it would for nobody
in particular (``rights.ANYONE``), whoever runs the dashboard. The dashboard holds no database or
broker credentials; the server checks every right.

Answers come back as objects with attributes (``job.state``), their ``*_at`` times as datetimes,
so the pages read them as they read the ORM's rows before.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any, overload

from gpuq.cli.client import Client
from gpuq.service import constants as c
from gpuq.service.errors import Unreachable


def client(address: str | None = None) -> Client:
    """A client of the server at ``address`` (default: where the CLI looks) each of whose requests
    asks for the public view: the server then lowers the caller's rights (never raises them), so a
    dashboard run by root shows no more than one run by anyone else."""
    return Client(address, headers={c.VIEW_HEADER: c.PUBLIC_VIEW})


def wait_for_server(api: Client, seconds: float) -> None:
    """Return once the server answers a read that needs its database at the schema's head; raise
    Unreachable after ``seconds`` without an answer (a server may start beside the dashboard, as in
    docker compose), and the server's own error (Refused: the schema is behind, ...) at once."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            api.get("/devices")
            return
        except Unreachable:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def obj(data: dict[str, Any]) -> SimpleNamespace:
    """An answer's object with attributes, its ISO ``*_at`` times as datetimes."""
    return SimpleNamespace(**{k: (when(v) if k.endswith("_at") and isinstance(v, str) else v)
                              for k, v in data.items()})


@overload
def when(text: str) -> datetime: ...
@overload
def when(text: None) -> None: ...
def when(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def seconds(value: float | None) -> timedelta | None:
    return None if value is None else timedelta(seconds=value)
