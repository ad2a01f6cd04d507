"""A job's output on its way to SQL: buffered, written in chunks, capped."""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service.db import write_scope
from gpuq.service.errors import Unreachable
from gpuq.service.job_output import append_output
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.worker")
# What a NUL character of a job's output is stored as.
NUL_SHOWN = "\u2400"


class OutputSink:
    """Collects a job's output and writes it to ``job_output`` at least every flush interval.

    Writing per line would be one transaction per print; batching keeps a chatty job from
    hammering the database. Past ``max_output_bytes`` the rest is dropped with one note. A
    command's stdout and stderr are kept apart: each run of one stream between the other's is a
    chunk of its own, in the order written, so `gpuq run` gives each back to its own file and
    `gpuq logs` shows them interleaved as they came.
    """

    def __init__(self, settings: Settings, job_id: int, seq: int) -> None:
        self.settings = settings
        self.job_id = job_id
        # (stream, text) pieces in the order written; adjacent pieces of one stream are joined.
        self._buffer: list[tuple[int, str]] = []
        self._buffered = 0
        self._written = 0
        # The first chunk's number: after the output of the job's earlier attempts, if it is being
        # retried (``job_output.next_output_seq``, read in the transaction that started the job).
        self._seq = seq
        self._truncated = False
        # Past the cap: the last OUTPUT_TAIL_CHARS of what was dropped, (stream, text) pieces, and how
        # many bytes were dropped in all. Kept for the job's end, where an error is: the cap kept
        # the start and lost the traceback that said why the job failed.
        self._dropped: list[tuple[int, str]] = []
        self._dropped_chars = 0
        self._dropped_bytes = 0
        self._lock = threading.Lock()
        # Whether the job's last output (either stream: a terminal shows both) ended inside a line.
        self._mid_line = False
        # One flush at a time, so a chunk that failed to reach SQL is retried under its own number.
        self._flushing = threading.Lock()
        # The output's last characters, to tell why a job failed (a CUDA OOM message, say).
        self.tail = ""
        self._stop = threading.Event()
        # Started by the first write: a job that prints nothing costs no thread.
        self._thread: threading.Thread | None = None

    def write(self, text: str, stream: int = c.STDOUT) -> None:
        if not text:
            return
        # PostgreSQL's text refuses NUL: the chunk and, at the job's end, the rest of its end were
        # lost with it. Shown as U+2400 (␀) on both databases, as a terminal would show nothing.
        text = text.replace("\x00", NUL_SHOWN)
        with self._lock:
            self._mid_line = not text.endswith("\n")
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._flush_loop, name=f"output-{self.job_id}", daemon=True)
                self._thread.start()
            room = self.settings.max_output_bytes - self._written - self._buffered
            if room <= 0:
                if not self._truncated:
                    self._truncated = True
                    self._buffer.append((c.STDERR, f"\n[gpuq: output past {self.settings.max_output_bytes} bytes "
                                                   "dropped, but for its end, kept for the job's end]\n"))
                self._drop(text, stream)
                return
            encoded = len(text.encode("utf-8", "replace"))
            if encoded > room:
                raw = text.encode("utf-8", "replace")
                text = raw[:room].decode("utf-8", "ignore")
                self._drop(raw[room:].decode("utf-8", "ignore"), stream)
                encoded = room
            if self._buffer and self._buffer[-1][0] == stream:
                self._buffer[-1] = (stream, self._buffer[-1][1] + text)
            else:
                self._buffer.append((stream, text))
            self._buffered += encoded
            self.tail = (self.tail + text)[-c.OUTPUT_TAIL_CHARS:]
        if self._buffered >= c.OUTPUT_CHUNK_BYTES:
            self.flush()

    def _drop(self, text: str, stream: int) -> None:
        """Keep ``text``, past the cap, among the dropped output's last characters. Under the lock."""
        self._dropped_bytes += len(text.encode("utf-8", "replace"))
        self.tail = (self.tail + text)[-c.OUTPUT_TAIL_CHARS:]  # a CUDA OOM message at the end still counts
        if self._dropped and self._dropped[-1][0] == stream:
            self._dropped[-1] = (stream, self._dropped[-1][1] + text)
        else:
            self._dropped.append((stream, text))
        self._dropped_chars += len(text)
        while self._dropped_chars > c.OUTPUT_TAIL_CHARS:
            over = self._dropped_chars - c.OUTPUT_TAIL_CHARS
            first_stream, first = self._dropped[0]
            if len(first) <= over:
                self._dropped.pop(0)
                self._dropped_chars -= len(first)
            else:
                self._dropped[0] = (first_stream, first[over:])
                self._dropped_chars -= over

    def line(self, text: str, stream: int = c.STDOUT) -> None:
        self.write(text if text.endswith("\n") else text + "\n", stream)

    def note(self, text: str) -> None:
        """A line of gpuq's own about the job (it is being stopped, say): on the job's stderr, and
        on a line of its own where the job's output stopped inside one (`printf abc` then a
        cancel read "abc[gpuq: stopping the job ...]" in `gpuq logs` and on `gpuq run`'s terminal)."""
        self.line(("\n" if self._mid_line else "") + text, c.STDERR)

    def flush(self) -> bool:
        """Write what is buffered; False if the database refused it (it stays, for the next try)."""
        with self._flushing:
            with self._lock:
                if not self._buffer:
                    return True
                pieces, self._buffer = self._buffer, []
                size, self._buffered = self._buffered, 0
                seq, self._seq = self._seq, self._seq + len(pieces)
            try:
                with write_scope(self.settings) as session:
                    for n, (stream, data) in enumerate(pieces):
                        append_output(session, self.job_id, seq + n, data, stream)
                self._written += size
                return True
            except Unreachable:  # a database outage must not kill the job or lose its output
                log.warning("job %s: could not store %d bytes of output yet; will retry", self.job_id, size)
                with self._lock:
                    self._buffer[:0] = pieces
                    self._buffered += size
                    self._seq = seq
                return False
            except Exception:
                log.exception("job %s: could not store %d bytes of output", self.job_id, size)
                return True

    def _flush_loop(self) -> None:
        while not self._stop.wait(c.OUTPUT_FLUSH_SECONDS):
            self.flush()

    def stop(self) -> None:
        """Stop the flusher; what is left is written by ``store_rest`` in the job's end transaction,
        with the end of what the cap dropped."""
        with self._lock:
            self._stop.set()
            if self._dropped:
                kept = self._dropped_chars
                self._buffer.append((c.STDERR, f"\n[gpuq: {self._dropped_bytes} bytes of output dropped past the "
                                               f"cap; its last {kept} characters follow]\n"))
                for stream, text in self._dropped:
                    if self._buffer[-1][0] == stream:
                        self._buffer[-1] = (stream, self._buffer[-1][1] + text)
                    else:
                        self._buffer.append((stream, text))
                self._dropped, self._dropped_chars = [], 0
        if self._thread is not None:
            self._thread.join()

    def store_rest(self, session: Session) -> None:
        """Add what is buffered to ``session`` (the transaction that ends the job). Nothing here
        changes until ``rest_stored`` is called after it commits, so a failed end can be retried."""
        with self._lock:
            for n, (stream, data) in enumerate(self._buffer):
                append_output(session, self.job_id, self._seq + n, data, stream)

    def rest_stored(self) -> None:
        with self._lock:
            if self._buffer:
                self._written += self._buffered
                self._seq += len(self._buffer)
                self._buffer, self._buffered = [], 0
