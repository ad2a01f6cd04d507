"""How gpuq's long-running processes (the supervisor, server, scheduler, workers, dashboard) log:
one format, a filter that keeps a failure repeated every second (a full disk, a database away)
from writing a traceback every second, and the rotation of a stack's log files by size
(``rotate_logs``, which the supervisor runs).

``configure(level)`` replaces each process's ``logging.basicConfig(...)``. Its filter lets the
first occurrence of a message through, traceback and all, then holds back the repeats of it for
``REPEAT_WINDOW`` seconds, and then logs one line saying how many it held back. A failure that goes
on thus logs its traceback and that line once a minute.

Only WARNING and above are held back. A repeat is a record of the same logger, level and message
template (``log.exception("job %s: could not store ...", job_id)`` is one message whatever the job)
when it carries a traceback: those are the loops that fail. A record without one is a repeat only
when its text is the same too, so that lines which differ in what they name ("worker-gpu0 exited",
"worker-gpu1 exited") are all kept.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuq.service.settings import Settings

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MIB = 1024 * 1024
# Rotation runs in the supervisor and logs as it (service/stack.py's SUPERVISOR_LOGGER).
log = logging.getLogger("gpuq.stack")
# Seconds the repeats of a message are held back after it was logged.
REPEAT_WINDOW = 60.0
# The attribute that marks the filter's own "suppressed" lines, which it always lets through.
_SUMMARY = "gpuq_suppressed"
# The most of the first occurrence's text quoted in the "suppressed" line.
_QUOTED = 200


@dataclass
class _Held:
    name: str  # the logger's
    level: int
    first: str  # the text of the occurrence let through, quoted in the summary
    until: float  # the end of its window (the filter's clock)
    suppressed: int = 0


class RepeatFilter(logging.Filter):
    """Lets the first occurrence of a message through, holds back its repeats for ``window``
    seconds of ``clock``, then logs how many it held back (see the module's docstring).

    The "suppressed" line is logged when the window is over: by the next record this filter sees,
    or, with ``background``, by a thread of its own (started at the first repeat held back) when
    the process logs nothing else, and at ``flush()`` (atexit)."""

    def __init__(self, window: float = REPEAT_WINDOW, clock: Callable[[], float] = time.monotonic,
                 background: bool = False) -> None:
        super().__init__()
        self.window = window
        self.clock = clock
        self.background = background
        # In the order the windows opened, which is the order they end (each is as long).
        self._held: OrderedDict[tuple, _Held] = OrderedDict()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _message(record: logging.LogRecord) -> str:
        try:
            return record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format: the handler says so when it formats it
            return f"{record.msg} {record.args!r}"

    @staticmethod
    def _key(record: logging.LogRecord, text: str) -> tuple:
        if record.exc_info is not None and record.exc_info[0] is not None:
            return record.name, record.levelno, str(record.msg)
        return record.name, record.levelno, str(record.msg), text

    def filter(self, record: logging.LogRecord) -> bool:
        # Below WARNING nothing is held: not a failure, and a busy server's INFO lines (an audit
        # line a submit) would each take a window's entry for nothing.
        if record.levelno < logging.WARNING or getattr(record, _SUMMARY, False):
            return True
        now = self.clock()
        text = self._message(record)
        key = self._key(record, text)
        with self._lock:
            due = self._due(now)
            held = self._held.get(key)
            if held is None:
                self._held[key] = _Held(record.name, record.levelno, _quoted(text), now + self.window)
                passes = True
            else:
                held.suppressed += 1
                passes = False
                if self.background:
                    self._start_thread()
        self._log(due)  # before this record: the end of the last window, then the first of the next
        return passes

    def after_fork(self) -> None:
        """In a forked child: a lock another thread of the parent held at the fork stays held there
        for ever, and the parent's thread is not the child's."""
        self._lock = threading.Lock()
        self._thread = None

    def flush(self) -> None:
        """Log the "suppressed" lines of every window, over or not (at exit)."""
        with self._lock:
            due = [held for held in self._held.values() if held.suppressed]
            self._held.clear()
        self._log(due)

    def _due(self, now: float) -> list[_Held]:
        """Forget the windows over at ``now``; those that held something back, to log (lock held).

        Every window is as long, and a message's entry goes in when its window opens and out when
        it ends: the dict's order is the windows' ends', and the first still open ends the look."""
        due = []
        while self._held:  # from the oldest, without copying the whole: this runs at every record
            held = next(iter(self._held.values()))
            if now < held.until:
                break
            self._held.popitem(last=False)
            if held.suppressed:
                due.append(held)
        return due

    def _log(self, due: list[_Held]) -> None:
        for held in due:
            logging.getLogger(held.name).log(
                held.level, "suppressed %d repeats of this message within %.0f s of it: %s", held.suppressed,
                self.window, held.first, extra={_SUMMARY: True})


    def _start_thread(self) -> None:
        # Lock held.
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="gpuq-log-repeats", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        """Log the "suppressed" lines as their windows end, while any window holds something back."""
        while True:
            with self._lock:
                now = self.clock()
                due = self._due(now)
                ends = [held.until for held in self._held.values() if held.suppressed]
                if not due and not ends:
                    self._thread = None
                    return
            self._log(due)
            if ends:
                time.sleep(min(max(min(ends) - now, 0.05), 1.0))


def _quoted(text: str) -> str:
    """A message as the "suppressed" line quotes it: on one line, at most _QUOTED characters."""
    text = " ".join(text.split())
    return text if len(text) <= _QUOTED else text[:_QUOTED - 3] + "..."


_installed: RepeatFilter | None = None


def configure(level: int | str = logging.INFO) -> RepeatFilter:
    """Log to stderr in gpuq's format at ``level``, repeats held back (what ``logging.basicConfig``
    did, with the filter on its handler). Returns the filter."""
    global _installed
    import atexit

    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, format=FORMAT)
    root = logging.getLogger()
    if _installed is None:
        _installed = RepeatFilter(background=True)
        atexit.register(_installed.flush)
        os.register_at_fork(after_in_child=_installed.after_fork)
    for handler in root.handlers:
        if _installed not in handler.filters:
            handler.addFilter(_installed)
    return _installed


def append_line(path: Path, logger: str, message: str, level: int = logging.INFO) -> None:
    """One line in gpuq's format appended to a log that other processes write too: an admin
    command's audit line in the server's log (`gpuq drain` and `gpuq resume` change the database
    from the admin's own process, not through the server). One write to a file opened O_APPEND,
    as the processes writing it hold it (``rotate_log``), so the line lands whole at its end."""
    handler = logging.FileHandler(path, encoding="utf-8")
    try:
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.emit(logging.LogRecord(logger, level, __file__, 0, message, None, None))
    finally:
        handler.close()


def rotate_log(path: Path, max_bytes: int, keep: int) -> bool:
    """Rotate ``path`` if it has reached ``max_bytes``: NAME.1 ... NAME.(keep-1) become NAME.2 ...
    NAME.keep (the oldest, NAME.keep, goes), the log is copied to NAME.1 and emptied in place.
    Returns whether it rotated.

    In place, by copy-then-truncate (logrotate's copytruncate), because the processes writing it
    keep it open: the supervisor's children have it as their stdout and stderr, the supervisor too
    (`gpuq up` opened it), each opened O_APPEND, so after the truncation each write goes to the new
    end of the file, not past a hole at the old offset. A rename would leave them writing to
    NAME.1 until restarted; they cannot be told to reopen it. The copy is taken until it has caught
    up with the file, then the file is truncated at once: what a process writes between the copy's
    last read and the truncation (microseconds; a line or two of a process logging very fast) is
    in neither file. Nothing is lost while the file is below ``max_bytes``."""
    try:
        if path.stat().st_size < max_bytes:
            return False
    except FileNotFoundError:
        return False
    older = [path.with_name(f"{path.name}.{n}") for n in range(1, keep + 1)]
    # Beyond ``keep`` (kept by a larger setting before), and the oldest: removed first, which frees
    # room for the copy on a disk the logs have filled.
    n = keep + 1
    while (extra := path.with_name(f"{path.name}.{n}")).exists():
        extra.unlink()
        n += 1
    if older:
        older[-1].unlink(missing_ok=True)
        for newer, old in zip(reversed(older[:-1]), reversed(older[1:]), strict=True):
            if newer.exists():
                os.replace(newer, old)
    with open(path, "r+b") as log_file:
        if older:
            part = older[0].with_name(older[0].name + ".part")
            try:
                with open(part, "wb") as copy:
                    while chunk := log_file.read(MIB):
                        copy.write(chunk)
                os.replace(part, older[0])
            except OSError as exc:
                part.unlink(missing_ok=True)
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # A full disk: the log is emptied all the same, or it goes on filling it.
                log.error("%s: no room to keep a copy of it (%s); emptied without one", path, exc.strerror)
        log_file.truncate(0)
    return True


def rotate_logs(settings: Settings, paths: list[Path]) -> list[Path]:
    """Rotate those of ``paths`` past ``settings.log_rotate_mib`` (keeping ``log_rotate_keep`` old
    copies of each); returns those rotated. Nothing with log_rotate_mib 0."""
    if settings.log_rotate_mib <= 0:
        return []
    rotated = []
    for path in paths:
        try:
            if rotate_log(path, settings.log_rotate_mib * MIB, settings.log_rotate_keep):
                rotated.append(path)
        except OSError as exc:
            log.warning("could not rotate %s: %s", path, exc)
    for path in rotated:  # logged after: the supervisor's own log may be one of them
        log.info("rotated %s (past %d MiB; %d older copies kept)", path, settings.log_rotate_mib,
                 settings.log_rotate_keep)
    return rotated
