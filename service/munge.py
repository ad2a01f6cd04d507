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
    if done.returncode in _DAEMON_FAULTS:
        # munged is down or failed: the server cannot tell who asks, which is not the caller's fault.
        raise Unreachable(f"munged at {socket} cannot be asked: {status or _last_line(done.stderr)}")
    if done.returncode != 0 or not status.startswith("Success"):
        raise NotAllowed(f"the MUNGE credential was refused: {status or _last_line(done.stderr)}")
    try:
        uid = int(fields["UID"].rsplit("(", 1)[1].rstrip(")"))
        gid = int(fields["GID"].rsplit("(", 1)[1].rstrip(")"))
    except (KeyError, IndexError, ValueError):
        raise NotAllowed("the MUNGE credential carries no uid") from None
    return Decoded(uid, gid, body.decode("utf-8", errors="replace"))


# unmunge's exit codes (munge.h's munge_err_t) that say munged could not be asked, rather than
# that the credential is bad: EMUNGE_SNAFU, EMUNGE_NO_MEMORY, EMUNGE_SOCKET, EMUNGE_TIMEOUT. A
# bad credential is 8 (EMUNGE_BAD_CRED) to 18 (EMUNGE_CRED_UNAUTHORIZED), 15 expired, 17 replayed.
_DAEMON_FAULTS = frozenset({1, 5, 6, 7})


def _last_line(data: bytes) -> str:
    """The last line a munge program wrote to stderr, without its ``munge: Error:`` prefix."""
    lines = [ln for ln in data.decode(errors="replace").splitlines() if ln.strip()]
    if not lines:
        return "no message"
    return lines[-1].split("Error:", 1)[-1].strip() if lines[-1].startswith(("munge:", "unmunge:")) else lines[-1]
