"""A job's own files (a train job's ``--checkpoint`` and ``--data-dir``), read and written with its
owner's rights, never the worker's.

A built-in workload runs inside the warm worker, which is root on a machine's stack: opened there, a
path the user names is opened as root (a checkpoint written into /root, another user's weights
read and overwritten). So a root worker hands each such read and write to a short process run as
the job's owner (their uid, gid and groups, as their command would run), and the kernel checks the
owner's rights. A worker that is not root, or a job of root's, opens them itself: the rights are
the same. A process of coreutils a file: a few milliseconds, once an epoch for a checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from gpuq.service import constants as c
from gpuq.workers.identity import Identity

# Run as the owner: coreutils, which every user can run (the worker's interpreter may live where
# they cannot, a root-only pyenv). Messages in the C locale, so that "no such file" can be told apart.
# At most one byte past the cap is read: a path to /dev/zero or a file of 100 GiB must not fill the
# warm worker's memory, which every job on its GPU shares.
_READ = ["head", "-c"]
# The most a job's file read by the worker may hold: a ResNet-18 checkpoint with its optimizer's
# state is about 0.1 GiB, Fashion-MNIST's largest file 47 MiB.
MAX_READ_BYTES = 1 << 30
# Written beside the file, then renamed over it: a crash mid-write leaves the previous one. A new
# file gets the job's umask; one that exists keeps its mode (a user's chmod 600 outlives a save).
_WRITE = ["sh", "-c", 'tmp="$1.tmp.$$"; cat > "$tmp" && { [ ! -e "$1" ] || chmod --reference="$1" -- "$tmp"; } '
          '&& mv -f -- "$tmp" "$1" || { rm -f -- "$tmp"; exit 1; }', "sh"]
# A job's files without a umask of its own (a job submitted before gpuq carried it): as before.
DEFAULT_UMASK = 0o022
_ENV = {"LC_ALL": "C", "PATH": "/usr/bin:/bin"}


class OwnerFileError(OSError):
    """A job's file could not be read or written with its owner's rights: the path and the reason."""


def umask_of(env: Mapping[str, str] | None) -> int | None:
    """The umask a job was submitted with (``c.UMASK_VARIABLE`` in its environment), None without
    one (a job from before gpuq carried it) or a bad one."""
    try:
        mask = int((env or {}).get(c.UMASK_VARIABLE, ""), 8)
    except ValueError:
        return None
    return mask if 0 <= mask <= 0o777 else None


@dataclass(frozen=True)
class OwnerFiles:
    """Reads and writes a job's files as ``identity`` (None: as this process, whose rights are the
    owner's already); a file it makes gets ``umask``, the submitter's (None: 022 as the owner, this
    process's own umask as this process)."""

    identity: Identity | None = None
    umask: int | None = None

    def read(self, path: str, limit: int = MAX_READ_BYTES) -> bytes | None:
        """The file's bytes; None when there is no such file. Raises OwnerFileError when it holds
        more than ``limit`` bytes (read no further than one past it)."""
        if self.identity is None:
            try:
                with open(path, "rb") as f:
                    data = f.read(limit + 1)
            except FileNotFoundError:
                return None
        else:
            done = self._as_owner([*_READ, str(limit + 1), "--"], path, None)
            if done.returncode != 0 and done.stderr.rstrip().endswith(b"No such file or directory"):
                return None
            self._check(done, path)
            data = done.stdout
        if len(data) > limit:
            raise OwnerFileError(f"{path}: larger than {limit >> 20} MiB, the most a job's file read by gpuq may hold")
        return data

    def write(self, path: str, data: bytes) -> None:
        """Replace the file with ``data``, atomically."""
        if self.identity is None:
            try:
                mode: int | None = stat.S_IMODE(os.stat(path).st_mode)
            except FileNotFoundError:
                mode = None if self.umask is None else 0o666 & ~self.umask
            tmp = f"{path}.tmp.{os.getpid()}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if mode is not None else 0o666)
                with open(fd, "wb") as f:
                    if mode is not None:
                        os.fchmod(f.fileno(), mode)
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            return
        self._check(self._as_owner(_WRITE, path, data), path)

    def _as_owner(self, argv: list[str], path: str, data: bytes | None) -> subprocess.CompletedProcess[bytes]:
        who = self.identity
        assert who is not None
        return subprocess.run([*argv, path], input=data if data is not None else b"", capture_output=True, cwd="/",
                              env=_ENV, user=who.uid, group=who.gid, extra_groups=list(who.groups),
                              umask=DEFAULT_UMASK if self.umask is None else self.umask,
                              check=False)

    def _check(self, done: subprocess.CompletedProcess[bytes], path: str) -> None:
        if done.returncode != 0:
            # "head: cannot open 'PATH' for reading: Permission denied": its last words are the reason.
            last = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            why = last[0].rsplit(": ", 1)[-1]
            raise OwnerFileError(f"{path}: {why} (as {self.identity.name if self.identity else 'this worker'})")
