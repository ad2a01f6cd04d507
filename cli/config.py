"""`gpuq config`: the settings that matter, where each came from, secrets masked.

With a server answering: the settings it runs the queue with (``GET /v1/config``, what this user
may see of them), and this client's own that say which server that is. A user's own settings (a
home, a SQLite file in it) are not what the machine's queue runs with, and printing them as if they
were misled. With no server answering: this client's own settings, said to be only that.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from gpuq.cli.client import Client
from gpuq.cli.render import print_json
from gpuq.service.errors import Unreachable
from gpuq.service.settings import setting_sources, shown_settings

app = typer.Typer()

# The client's own settings that matter beside a server's: which server it talks to, and how.
CLIENT_SETTINGS = ("server", "socket", "tls_ca", "munge_socket")
# What a setting the server keeps from this caller shows in its place.
WITHHELD = "(root and admins only)"


@app.command()
def config(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """The settings of the gpuq server this client talks to (what the queue runs with) and this
    client's own that find it; with no server answering, this client's local settings.

    Each with where it came from: env (GPUQ_*), file, or default. Passwords in URLs, and settings
    named like a password, secret or token, are masked; where the database and the broker are is
    shown to root and the admins only.
    """
    settings, path, sources = setting_sources()
    local: dict[str, Any] = {"config_file": str(path), "config_file_exists": path.is_file(),
                             "settings": shown_settings(settings, sources)}
    try:
        client = Client()
        served = client.get("/config")
    except Unreachable as exc:
        _local_view(local, exc, as_json)
        return
    mine: dict[str, Any] = {**local, "settings": {name: local["settings"][name] for name in CLIENT_SETTINGS}}
    if as_json:
        print_json({"view": "server", "server": client.address, **served, "client": mine})
        return
    width = max(len(s["env"]) for s in [*served["settings"].values(), *mine["settings"].values()])
    typer.echo(f"gpuq server at {client.address}: the settings the queue runs with ({_file(served)})")
    _rows(served["settings"], width)
    typer.echo(f"this client: how it finds the server ({_file(mine)})")
    _rows(mine["settings"], width)


def _local_view(local: dict[str, Any], why: Unreachable, as_json: bool) -> None:
    """This client's own settings, said to be only that: no server answered to say its own."""
    typer.echo(f"gpuq: {why}; so this is the local view: this client's own settings, not those a server runs "
               "the queue with", err=True)
    if as_json:
        print_json({"view": "local", "unreachable": str(why), **local})
        return
    typer.echo(f"config file: {local['config_file']}" + ("" if local["config_file_exists"] else " (none there)"))
    _rows(local["settings"], max(len(s["env"]) for s in local["settings"].values()))


def _file(view: dict[str, Any]) -> str:
    return f"config file: {view['config_file']}" + ("" if view["config_file_exists"] else ", none there")


def _rows(shown: dict[str, dict[str, Any]], width: int) -> None:
    for s in shown.values():
        source, value = ("-", WITHHELD) if s.get("withheld") else (s["source"], s["value"])
        if s.get("also"):  # a user's own stack: its user is admin whatever the setting says
            value = f"{value} (and {s['also']}, whose stack this is)".lstrip()
        typer.echo(f"{s['env']:<{width}}  {source:<7}  {value}".rstrip())
