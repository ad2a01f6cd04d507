"""MUNGE credentials for requests across nodes, the way SLURM's daemons prove a uid.

The client asks its node's munged for a credential whose payload names the request (method, path
and the SHA-256 of its body); the server asks its own munged (same key) to decode it, which gives
the uid of the process that asked for it. munged refuses a credential decoded before (its replay
cache) or past its time-to-live, and the server refuses one whose payload names another request.
Debian's ``munge`` and ``unmunge`` programs do the work: nothing here handles the key or the MAC.
"""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass

from gpuq.service import constants as c
from gpuq.service.errors import NotAllowed, Unreachable


def payload(method: str, path: str, body: bytes) -> str:
    """What a credential for this request vouches for: ``POST /v1/jobs sha256:<hex of the body>``."""
    return f"{method.upper()} {path} sha256:{hashlib.sha256(body).hexdigest()}"


def encode(text: str, socket: str) -> str:
    """A credential for ``text`` from the munged at ``socket``, as this process's uid."""
    try:
        done = subprocess.run(["munge", "-S", socket, "-s", text], capture_output=True,
                              timeout=c.MUNGE_TIMEOUT_SECONDS, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise Unreachable("the munge program is not installed (Debian's munge package)") from None
    except subprocess.TimeoutExpired:
        raise Unreachable(f"munged at {socket} did not answer") from None
    if done.returncode != 0:
        raise Unreachable(f"munged at {socket} gave no credential: {_last_line(done.stderr)}")
    return done.stdout.decode().strip()


@dataclass(frozen=True)
class Decoded:
    uid: int
    gid: int
    payload: str


def decode(credential: str, socket: str) -> Decoded:
    """The uid, gid and payload munged vouches for; NotAllowed for a credential it refuses
    (forged, replayed, expired, another realm's key), Unreachable when munged cannot be asked."""
    try:
        done = subprocess.run(["unmunge", "-S", socket], input=credential.encode(), capture_output=True,
                              timeout=c.MUNGE_TIMEOUT_SECONDS)
    except FileNotFoundError:
        raise Unreachable("the unmunge program is not installed (Debian's munge package)") from None
    except subprocess.TimeoutExpired:
        raise Unreachable(f"munged at {socket} did not answer") from None
    head, _, body = done.stdout.partition(b"\n\n")
    fields = {}
    for line in head.decode(errors="replace").splitlines():
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    status = fields.get("STATUS", "")
    if done.returncode != 0 or not status.startswith("Success"):
        why = status or _last_line(done.stderr)
        if "socket" in why.lower() and "connect" in why.lower():
            raise Unreachable(f"munged at {socket} cannot be reached: {why}")
        raise NotAllowed(f"the MUNGE credential was refused: {why}")
    try:
        uid = int(fields["UID"].rsplit("(", 1)[1].rstrip(")"))
        gid = int(fields["GID"].rsplit("(", 1)[1].rstrip(")"))
    except (KeyError, IndexError, ValueError):
        raise NotAllowed("the MUNGE credential carries no uid") from None
    return Decoded(uid, gid, body.decode("utf-8", errors="replace"))


def _last_line(data: bytes) -> str:
    lines = [ln for ln in data.decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else "no message"
