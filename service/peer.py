"""Who is at the other end of a Unix socket, as the kernel recorded it when that process connected
(SO_PEERCRED): the server's way to know its caller (server/identity.py), and `gpuq reconfigure`'s
to know which server answers (cli/stack.py)."""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Peer(NamedTuple):
    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer:
    """The process connected at the other end of the Unix socket ``sock``."""
    return Peer(*_UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))
