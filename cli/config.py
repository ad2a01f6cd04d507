"""`gpuq config`: the effective settings, where each came from, secrets masked."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from gpuq.cli.render import print_json
from gpuq.service.settings import ENV_PREFIX, Settings, masked, setting_sources

app = typer.Typer()

# Fields whose empty default means "derived": shown as the value gpuq really uses.
_EFFECTIVE = {"database_url": "database", "broker_url": "broker", "snapshot_dir": "snapshots"}


def _value(settings: Settings, name: str) -> Any:
    value = getattr(settings, _EFFECTIVE.get(name, name))
    return str(value) if isinstance(value, Path) else value


@app.command()
def config(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Every setting as gpuq sees it, and where it came from: env (GPUQ_*), file, or default.

    Passwords in URLs, and settings named like a password, secret or token, are masked.
    """
    settings, path, sources = setting_sources()
    rows = [(f.name, ENV_PREFIX + f.name.upper(), masked(f.name, _value(settings, f.name)), sources[f.name])
            for f in dataclasses.fields(settings)]
    if as_json:
        print_json({"config_file": str(path), "config_file_exists": path.is_file(),
                    "settings": {name: {"value": value, "source": source, "env": env}
                                 for name, env, value, source in rows}})
        return
    typer.echo(f"config file: {path}" + ("" if path.is_file() else " (none there)"))
    width = max(len(env) for _, env, _, _ in rows)
    for _, env, value, source in rows:
        typer.echo(f"{env:<{width}}  {source:<7}  {value}")
