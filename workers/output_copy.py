"""A command's output copied to the user's own files (`--output`, `--error`, service/output_files.py).

The files are opened by the job's own process between fork and exec, once it is the user and in
its directory (``open_in_child``, called from ``command._in_child``), and handed to the worker over
a socket pair (SCM_RIGHTS): the kernel checks the user's rights on the path, every directory and
symbolic link on the way included, so a root worker never opens a path the user could not. The
worker then writes each chunk it reads from the job's pipes to gpuq's store and, as it came, to
the file (``Copy``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import threading
from dataclasses import dataclass

# The first byte of the child's message: the files follow, or why they could not be opened.
_OPENED, _REFUSED = b"+", b"!"


@dataclass(frozen=True)
class OutputFiles:
    """Where a command's stdout and stderr are copied (filled in for this job); a stream with None
    goes to gpuq's store alone, and stderr with None goes where stdout does."""

    stdout: str | None
    stderr: str | None
    # A first attempt starts the files afresh; a retry's output goes on after the earlier attempts'.
    truncate: bool = True

    @property
    def paths(self) -> list[str]:
        """The files to open, each once, stdout's first."""
        return list(dict.fromkeys(p for p in (self.stdout, self.stderr) if p is not None))

    def for_streams(self, fds: list[int]) -> tuple[int | None, int | None]:
        """The descriptors ``paths`` were opened as, by stream: (stdout's, stderr's)."""
        opened = dict(zip(self.paths, fds, strict=True))
        out = opened.get(self.stdout) if self.stdout is not None else None
        err = opened[self.stderr] if self.stderr is not None else out
        return out, err


def open_in_child(files: OutputFiles, sock_fd: int, user: str) -> None:
    """Between fork and exec, as the job's user: open ``files`` and send them to the worker over
    ``sock_fd``; one that cannot be opened sends why, and the child exits 126 (nothing ran)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK
    if files.truncate:
        flags |= os.O_TRUNC
    sock = socket.socket(fileno=sock_fd)
    fds = []
    for path in files.paths:
        try:
            fd = os.open(path, flags, 0o666)  # less the job's umask, as a shell's > makes it
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
                # A pipe stalls the copy when its reader stops reading; a file or a device such as
                # /dev/null does not.
                raise OSError(errno.EINVAL, "not a file")
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except OSError as exc:
            # O_NONBLOCK: a FIFO with no reader is refused (ENXIO) rather than blocking the job's start.
            why = "a pipe with no reader" if exc.errno == errno.ENXIO else os.strerror(exc.errno or 0)
            sock.send(_REFUSED + f"cannot open {path} as {user}: {why}".encode("utf-8", "replace"))
            os._exit(126)
        fds.append(fd)
    socket.send_fds(sock, [_OPENED], fds)
    for fd in fds:
        os.close(fd)
    sock.close()


def receive(sock: socket.socket, files: OutputFiles) -> tuple[int | None, int | None] | str:
    """What the child sent: the files' descriptors by stream (``OutputFiles.for_streams``), kept
    from the worker's own children; or why it could not open them."""
    sock.settimeout(10)  # sent before its exec, which Popen waited for: there already
    try:
        message, fds, _, _ = socket.recv_fds(sock, 4096, len(files.paths))
    except OSError as exc:
        return f"the job's process did not hand its output files over ({exc})"
    for fd in fds:
        os.set_inheritable(fd, False)
    if not message.startswith(_OPENED) or len(fds) != len(files.paths):
        for fd in fds:
            os.close(fd)
        return message[1:].decode("utf-8", "replace") or "the job's process could not open its output files"
    return files.for_streams(fds)


def copies_of(fds: tuple[int | None, int | None], files: OutputFiles) -> tuple[Copy | None, Copy | None]:
    """The copies of (stdout, stderr) to the descriptors ``receive`` gave."""
    out = Copy(fds[0], files.stdout or "") if fds[0] is not None else None
    if fds[1] is None:
        return out, None
    # One file for both streams: one Copy, so that a failed write ends the copy of both.
    return out, out if out is not None and fds[1] == fds[0] else Copy(fds[1], files.stderr or "")


class Copy:
    """A copy to the user's file (one stream's, or both streams' when they share the file): written
    as it comes; a write that fails (the disk is full, the quota reached) ends the copy, said once
    in gpuq's store, and the job goes on. Closed under its lock: a reader still copying when the
    job is over (its pipe held open by a process left behind) never writes to a number reused."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path
        self.failed: str | None = None
        self._lock = threading.Lock()

    def write(self, chunk: bytes) -> str | None:
        """Copy ``chunk``; the line to note in gpuq's store when this write ended the copy."""
        with self._lock:
            if self.failed is not None or self.fd < 0:
                return None
            view = memoryview(chunk)
            try:
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError as exc:
                self.failed = os.strerror(exc.errno or 0)
                return (f"[gpuq: writing the output to {self.path} failed ({self.failed}); the rest is in "
                        "`gpuq logs` only]")
            return None

    def close(self) -> None:
        with self._lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
