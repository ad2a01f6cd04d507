"""Simulated GPU memory: where a process on a simulated GPU says "I hold N MiB on simulated GPU i".

A simulated GPU has no memory of its own to measure, so its processes declare what they hold: one
file ``gpu<INDEX>.<PID>`` per GPU and process in the node's directory, holding ``MIB START`` (START:
the process's start time in clock ticks, from /proc, so a file left by a dead process is never
taken for a new process that got its pid). Read back, they are the NVML-shaped per-process list a
real GPU gives (``nvmlDeviceGetComputeRunningProcesses``), so whatever reads that list (the probe,
the share watchdog) works the same on simulated GPUs.

A file counts only while its process lives and only if the file's owner is that process's real
uid: a user cannot make someone else's process look like it uses memory. Files that fail either
test are removed when read. The directory is world-writable and sticky like /tmp, because on a
root stack jobs run as many users and gpuq's home is theirs to read neither.

Jobs import this module (``python -m gpuq.workers.simulated_memory``): nothing heavy here.
"""

from __future__ import annotations

import errno
import os
import pwd
import re
import shutil
import stat
import uuid
from pathlib import Path

from gpuq.service.devices import GpuProcess
from gpuq.service.errors import ConfigError
from gpuq.service.settings import Settings

# The variable a job on simulated GPUs finds the directory in (workers/execute.py's job_env).
ENV_VARIABLE = "GPUQ_SIMULATED_MEMORY_DIR"
# The directory's mode: everyone may add files, only a file's owner (and root) may remove them.
DIRECTORY_MODE = 0o1777
# A holding file is a few bytes; anything longer is not one.
MAX_FILE_BYTES = 64

_NAME = re.compile(r"gpu(\d+)\.(\d+)")
_TEMPORARY = re.compile(r"\.gpu(\d+)\.(\d+)\.[0-9a-f]+\.tmp")


def memory_dir(settings: Settings) -> Path:
    """The node's directory of holding files: ``fake_gpu_memory_dir``, else ``simulated-gpu-memory``
    in the stack's home, its own (two stacks on one machine never share one). Not in /tmp, where its
    name could be known: another user who made it first kept a root stack's workers from starting.
    A root stack's home is 0711, so the users whose jobs write here reach it without listing the home."""
    if settings.fake_gpu_memory_dir:
        return Path(settings.fake_gpu_memory_dir).expanduser()
    return Path(settings.home).expanduser() / "simulated-gpu-memory"


def remove_default_dir(settings: Settings) -> None:
    """Remove the default directory (``memory_dir`` without ``fake_gpu_memory_dir``) once its stack
    is down: whatever is left there is of processes gone. A directory an admin named is theirs."""
    if settings.fake_gpu_memory_dir or not settings.fake_gpus:
        return
    directory = memory_dir(settings)
    try:
        if directory.lstat().st_uid == os.geteuid() and stat.S_ISDIR(directory.lstat().st_mode):
            shutil.rmtree(directory, ignore_errors=True)
    except OSError:
        pass  # not there


class SimulatedMemory:
    """The holding files of one node's simulated GPUs, read as per-process lists of GPU memory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._users: dict[int, str | None] = {}

    @classmethod
    def open(cls, directory: Path) -> SimulatedMemory:
        """The registry in ``directory``, made (mode 1777) if missing. Raises ConfigError when the
        path is not a directory, or is someone else's (not this process's user's, not root's): its
        owner could remove other users' files."""
        try:
            directory.mkdir(parents=True, exist_ok=True)
            info = directory.lstat()
            if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != DIRECTORY_MODE:
                directory.chmod(DIRECTORY_MODE)  # mkdir's mode is cut by the umask
        except OSError as exc:
            raise ConfigError(f"fake_gpu_memory_dir: cannot make {directory}: {exc.strerror}") from None
        if not stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"fake_gpu_memory_dir: {directory} is not a directory")
        if info.st_uid not in (os.geteuid(), 0):
            raise ConfigError(f"fake_gpu_memory_dir: {directory} belongs to uid {info.st_uid}, not to gpuq's "
                              "user: remove it, or set another")
        return cls(directory)

    def processes(self, index: int) -> tuple[GpuProcess, ...]:
        """The live processes holding memory on simulated GPU ``index``; files of dead processes,
        and files whose owner is not their process's real uid, are removed."""
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return ()  # removed under us: nobody holds anything
        out = []
        for entry in entries:
            temporary = _TEMPORARY.fullmatch(entry.name)
            named = _NAME.fullmatch(entry.name)
            try:
                if temporary:  # a writer killed between its write and its rename
                    if _process(int(temporary[2])) is None:
                        _remove(entry.path)
                elif named is not None and int(named[1]) == index:
                    held = self._held(entry.path, int(named[2]))
                    if held is not None:
                        out.append(held)
            except OSError:
                continue  # a process /proc will not show us: neither counted nor removed
        return tuple(sorted(out, key=lambda p: p.pid))

    def _held(self, path: str, pid: int) -> GpuProcess | None:
        process = _process(pid)
        try:
            # O_NOFOLLOW: a link planted in the shared directory is never followed (the reader may be root).
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                _remove(path)  # a link, not a holding file
            return None
        try:
            info = os.fstat(fd)
            text = os.read(fd, MAX_FILE_BYTES + 1) if stat.S_ISREG(info.st_mode) else b""
        finally:
            os.close(fd)
        if process is None:
            _remove(path)  # its process is gone
            return None
        uid, start, name = process
        fields = text.split()
        try:
            mib, written_start = int(fields[0]), int(fields[1])
        except (IndexError, ValueError):
            mib, written_start = -1, -1
        if info.st_uid != uid or written_start != start or mib < 0 or len(text) > MAX_FILE_BYTES:
            # Someone else's claim on this process, a dead process's file that its pid's new
            # process inherited, or not a holding file at all.
            _remove(path)
            return None
        return GpuProcess(pid=pid, memory_mib=mib, name=name, user=self._user(uid))

    def _user(self, uid: int) -> str | None:
        if uid not in self._users:
            try:
                self._users[uid] = pwd.getpwuid(uid).pw_name
            except KeyError:
                self._users[uid] = None
        return self._users[uid]


def hold(directory: Path, index: int, mib: int, pid: int | None = None) -> Path:
    """Say that process ``pid`` (default: this one) holds ``mib`` MiB on simulated GPU ``index``,
    replacing what it said before; written whole (a reader never sees half a file). Returns the
    file. Raises OSError when the directory cannot take it, ValueError for a negative ``mib``."""
    if mib < 0:
        raise ValueError(f"memory held must not be negative, got {mib} MiB")
    pid = os.getpid() if pid is None else pid
    process = _process(pid)
    if process is None:
        raise ProcessLookupError(f"no process {pid}")
    path = directory / f"gpu{index}.{pid}"
    temporary = directory / f".gpu{index}.{pid}.{uuid.uuid4().hex[:12]}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, f"{mib} {process[1]}\n".encode())
    finally:
        os.close(fd)
    try:
        os.replace(temporary, path)
    except OSError:
        _remove(str(temporary))
        raise
    return path


def release(directory: Path, index: int, pid: int | None = None) -> None:
    """Say that process ``pid`` (default: this one) holds nothing on simulated GPU ``index`` any more."""
    _remove(str(directory / f"gpu{index}.{os.getpid() if pid is None else pid}"))


def _process(pid: int) -> tuple[int, int, str] | None:
    """Process ``pid``'s real uid, start time (clock ticks since boot) and name; None when it is
    gone. Raises OSError when it cannot be told (/proc hides other users' processes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            line = f.read()
        with open(f"/proc/{pid}/status") as f:
            uid = next(int(s.split()[1]) for s in f if s.startswith("Uid:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration, ValueError, IndexError):
        return None
    # The name is in parentheses and may hold spaces and parentheses itself: fields follow the last ")".
    name = line[line.find("(") + 1:line.rfind(")")]
    after = line[line.rfind(")") + 2:].split()
    if len(after) < 20 or after[0] == "Z":  # a zombie holds no memory
        return None
    return uid, int(after[19]), name


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # gone already, or another reader's to remove
