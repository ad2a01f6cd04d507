"""`gpuq run`'s stdin, forwarded to its job as srun forwards it to task 0 (service/job_input.py):
read here in chunks and sent to the server, which the job's worker writes to its command's stdin.

A terminal is not forwarded (an interactive program wants `gpuq alloc`, whose shell is the
terminal's), nor /dev/null, nor a closed stdin: the job's stdin is then /dev/null, as a submit's."""

from __future__ import annotations

import base64
import itertools
import os
import stat
import sys
import threading
import time

from gpuq.service.errors import GpuqError

# How long to wait before sending a chunk again that the server found no room for, seconds.
FULL_PAUSE = 0.05


def wanted() -> bool:
    """Whether this process's stdin is worth forwarding: open, and neither a terminal nor /dev/null."""
    try:
        here = os.fstat(0)
    except OSError:
        return False
    if os.isatty(0):
        return False
    if stat.S_ISCHR(here.st_mode):
        try:
            null = os.stat(os.devnull)
        except OSError:
            return True
        return here.st_rdev != null.st_rdev
    return True


def start(job_id: int) -> threading.Thread:
    """Send this process's stdin to job ``job_id`` in a thread of its own, its end included; a
    refusal ends it (the job ended, or reads no input) with one line on stderr where it says why
    beyond the job's end. A `gpuq run` killed before its input's end leaves its job waiting on a
    read only until the job, which it keeps (cli/keep_alive.py), ends as client_lost."""
    thread = threading.Thread(target=_send, args=(job_id,), name="stdin", daemon=True)
    thread.start()
    return thread


def _send(job_id: int) -> None:
    from gpuq.cli.client import Client, Refused
    from gpuq.service import constants as c

    client = Client()
    path = f"/jobs/{job_id}/stdin"
    try:
        for seq in itertools.count():
            data = os.read(0, c.STDIN_CHUNK)
            # Its place in the input makes it safe to send again: a server restarting meanwhile is
            # waited for, and one that died having appended it appends it once.
            body = {"data": base64.b64encode(data).decode("ascii"), "end": not data, "seq": seq}
            while not client.post(path, body, ride_out=True)["taken"]:
                time.sleep(FULL_PAUSE)
            if not data:
                return
    except Refused as refused:
        if refused.exit_code != c.EXIT_CONFLICT:  # an ended job takes no more: nothing to say
            print(f"gpuq: stopped forwarding stdin: {refused}", file=sys.stderr, flush=True)
    except (GpuqError, OSError) as exc:
        print(f"gpuq: stopped forwarding stdin: {exc}", file=sys.stderr, flush=True)
