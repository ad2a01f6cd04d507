"""A job's output on its way to SQL: buffered, written in chunks, capped."""

from __future__ import annotations

import logging
import threading

from gpuq.service import constants as c
from gpuq.service.db import session_scope
from gpuq.service.jobs import append_output
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.worker")


class OutputSink:
    """Collects a job's output and writes it to ``job_output`` at least every flush interval.

    Writing per line would be one transaction per print; batching keeps a chatty job from
    hammering the database. Past ``max_output_bytes`` the rest is dropped with one note.
    """

    def __init__(self, settings: Settings, job_id: int) -> None:
        self.settings = settings
        self.job_id = job_id
        self._buffer: list[str] = []
        self._buffered = 0
        self._written = 0
        self._seq = 0
        self._truncated = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, name=f"output-{job_id}", daemon=True)
        self._thread.start()

    def write(self, text: str) -> None:
        if not text:
            return
        with self._lock:
            room = self.settings.max_output_bytes - self._written - self._buffered
            if room <= 0:
                if not self._truncated:
                    self._truncated = True
                    self._buffer.append(f"\n[gpuq: output past {self.settings.max_output_bytes} bytes dropped]\n")
                return
            encoded = len(text.encode("utf-8", "replace"))
            if encoded > room:
                text = text.encode("utf-8", "replace")[:room].decode("utf-8", "ignore")
                encoded = room
            self._buffer.append(text)
            self._buffered += encoded
        if self._buffered >= c.OUTPUT_CHUNK_BYTES:
            self.flush()

    def line(self, text: str) -> None:
        self.write(text if text.endswith("\n") else text + "\n")

    def flush(self) -> None:
        with self._lock:
            if not self._buffer:
                return
            data, self._buffer = "".join(self._buffer), []
            size, self._buffered = self._buffered, 0
            seq, self._seq = self._seq, self._seq + 1
        try:
            with session_scope(self.settings) as session:
                append_output(session, self.job_id, seq, data)
            self._written += size
        except Exception:  # noqa: BLE001 - losing a chunk of output must not kill the job
            log.exception("job %s: could not store %d bytes of output", self.job_id, size)

    def _flush_loop(self) -> None:
        while not self._stop.wait(c.OUTPUT_FLUSH_SECONDS):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.flush()
