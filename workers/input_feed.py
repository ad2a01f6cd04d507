"""Writing a job's forwarded stdin (service/job_input.py) to its command: a thread that takes each
chunk from Redis as it comes and writes it to the command's stdin, and closes that at the input's
end, so the command reads EOF as it would at the end of a pipe. A client gone before its input's
end ends the job itself (service/kept_jobs.py), and this thread with it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import IO

from gpuq.service import broker, job_input
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.worker")

# How long one look for the next chunk waits, seconds: the thread notices the command's end this soon.
LOOK_SECONDS = 0.5

Feed = Callable[[IO[bytes], threading.Event], None]


def feeder(settings: Settings, job_id: int) -> Feed:
    """What ``run_command`` runs in a thread for job ``job_id``: its input to ``pipe`` until the
    input ends or ``over`` is set (the command ended)."""

    def feed(pipe: IO[bytes], over: threading.Event) -> None:
        conn = broker.shared(settings)
        try:
            while not over.is_set():
                chunk = job_input.take(conn, settings, job_id, LOOK_SECONDS)
                if chunk is None:
                    continue
                if chunk == job_input.END:
                    return
                pipe.write(chunk)
                pipe.flush()
        except OSError:
            pass  # the command closed its stdin, or ended: what is left is not read, as with a pipe
        except Exception:
            log.warning("job %s: could not take its input from the broker; its stdin ends here", job_id,
                        exc_info=True)
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    return feed
