"""`gpuq dashboard`: the read-only web dashboard and the Prometheus metrics, served until stopped.

A client of the server's API, as the CLI is: it needs no database or broker credentials, only the
server's socket (GPUQ_SOCKET, GPUQ_SERVER, or where the CLI looks)."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Annotated

import typer

from gpuq.cli import numbers
from gpuq.service.errors import InvalidSpec
from gpuq.service.logs import configure as configure_logging

app = typer.Typer()

# The dashboard's default port: not Ray's dashboard (8265), Flower (5555), Prometheus (9090) or
# Grafana (3000), which a lab's machines may run too.
DEFAULT_PORT = 8642
# Seconds to wait at start for a server not answering yet: one started beside the dashboard (docker
# compose starts both at once) takes a few to listen.
DEFAULT_WAIT = 20.0


@app.command()
def dashboard(
    host: Annotated[str, typer.Option(help="Address to listen on; 0.0.0.0 shows it to the network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free one).",
                                      parser=numbers.whole(0, 65535, "port"))] = DEFAULT_PORT,
    wait: Annotated[float, typer.Option(min=0, help="Seconds to wait at start for the gpuq server to answer.")
                    ] = DEFAULT_WAIT,
) -> None:
    """Serve the dashboard (queue, GPUs, jobs, usage) and /metrics for Prometheus; read-only."""
    # Imported here: `gpuq status` and `submit` never load the web server or prometheus_client.
    from gpuq.web.read import client, wait_for_server
    from gpuq.web.server import serve

    api = client()
    wait_for_server(api, wait)

    configure_logging(logging.INFO)
    try:
        server = serve(api, host, port)
    except OSError as exc:
        raise InvalidSpec(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound_host, bound_port = server.server_address[:2]
    typer.echo(f"gpuq dashboard at http://{bound_host}:{bound_port}/ (metrics at /metrics); Ctrl-C stops it")

    def stop(*_: object) -> None:
        # shutdown() waits for serve_forever() to return, which runs in this (the main) thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
