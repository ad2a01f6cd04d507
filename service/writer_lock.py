"""SQLite's writers' queue: a kernel lock beside the database file that every gpuq process takes
around its write transactions (service/db.py joins it at a write scope's first statement)."""

from __future__ import annotations

import fcntl
import os
import threading

from gpuq.service.dialect import sqlite_file


class WriterLock:
    """One SQLite database's writers queue here, in the kernel, before they BEGIN IMMEDIATE.

    SQLite's own busy handler polls: a writer that finds the lock taken sleeps 1, 2, 5, 10 ms
    and more before it looks again, so under a few busy workers the lock often sits free while
    everyone sleeps. A blocking flock() on a file beside the database wakes the next writer the
    moment the last one lets go. Every gpuq process takes it around its write transactions, from
    their BEGIN to their COMMIT; anything else writing to the file still gets SQLite's busy
    handler, as before.
    """

    def __init__(self, database_path: str) -> None:
        self.path = database_path + "-writer"
        self._fd: int | None = None
        self._pid = os.getpid()
        # flock() is per open file, so this process's threads queue on a lock of their own first.
        self._threads = threading.Lock()
        self._owner: int | None = None

    def held_here(self) -> bool:
        return self._owner == threading.get_ident()

    def acquire(self) -> None:
        self._threads.acquire()
        try:
            if self._fd is None or self._pid != os.getpid():
                self._fd, self._pid = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600), os.getpid()
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._threads.release()
            raise
        self._owner = threading.get_ident()

    def close(self) -> None:
        """Close the lock file (its flock with it), once no writer of this process holds it."""
        with self._threads:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        self._owner = None
        try:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._threads.release()


_writer_locks: dict[str, WriterLock] = {}


def of_database(url: str) -> WriterLock | None:
    """The writers' queue of a SQLite database file; None for another database (its server queues)."""
    path = sqlite_file(url)
    if path is None:
        return None
    if url not in _writer_locks:
        _writer_locks[url] = WriterLock(path)
    return _writer_locks[url]


def close_all() -> None:
    """Close every writers' lock file this process opened, and forget them."""
    for lock in _writer_locks.values():
        lock.close()
    _writer_locks.clear()


def forget() -> None:
    """Forget them without closing (a forked child: a thread lock may have been held by a thread it lacks)."""
    _writer_locks.clear()
