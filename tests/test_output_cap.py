"""A job's output past GPUQ_MAX_OUTPUT_BYTES: the start is kept up to the cap, and the end too (its
last OUTPUT_TAIL_CHARS), since that is where a failing job says why. Before, everything past the
cap was dropped, the traceback with it, and `gpuq show`'s last lines were the cap's note."""

from __future__ import annotations

import pytest

from gpuq.service import constants as c
from gpuq.service.db import write_scope
from gpuq.service.job_output import read_output
from gpuq.service.models import utcnow
from gpuq.workers.output import OutputSink
from tests.test_usage import add_job

pytestmark = pytest.mark.timeout(60)


def test_output_past_the_cap_keeps_its_start_and_its_end_with_the_error(settings):
    capped = settings.with_overrides(max_output_bytes=1000)
    with write_scope(capped) as session:
        job = add_job(session, "ann", "n", utcnow(), None)
    sink = OutputSink(capped, job, 0)
    for i in range(20000):  # about 200 KB: more than the end kept
        sink.line(f"step {i}")
    sink.write("Traceback (most recent call last):\nRuntimeError: the real error\n", c.STDERR)
    sink.stop()
    with write_scope(capped) as session:
        sink.store_rest(session)
    sink.rest_stored()
    with write_scope(capped) as session:
        chunks = read_output(session, job)
    text = "".join(data for _, data, _ in chunks)
    assert text.startswith("step 0\nstep 1\n")
    assert "[gpuq: output past 1000 bytes dropped, but for its end, kept for the job's end]" in text
    assert text.endswith("step 19999\nTraceback (most recent call last):\nRuntimeError: the real error\n")
    assert "RuntimeError: the real error" in sink.tail  # what tells a failure's class, too
    # Streams stay apart: the error is stderr's.
    assert [s for _, data, s in chunks if "the real error" in data] == [c.STDERR]
    dropped = text[text.index("bytes of output dropped past the cap"):]
    assert len(dropped) <= c.OUTPUT_TAIL_CHARS + 200  # the end kept is bounded, not the whole rest
    assert "step 5000\n" not in text  # the middle is gone


def test_gpuqs_own_note_starts_a_line_of_its_own_after_output_that_ended_inside_one(settings):
    # `printf abc` then a cancel read "abc[gpuq: stopping the job ...]" in gpuq logs and gpuq run.
    with write_scope(settings) as session:
        job = add_job(session, "ann", "n", utcnow(), None)
    sink = OutputSink(settings, job, 0)
    sink.write("abc")
    sink.note("[gpuq: stopping the job]")
    sink.write("whole line\n")
    sink.note("[gpuq: again]")
    sink.stop()
    with write_scope(settings) as session:
        sink.store_rest(session)
    sink.rest_stored()
    with write_scope(settings) as session:
        text = "".join(data for _, data, _ in read_output(session, job))
    assert text == "abc\n[gpuq: stopping the job]\nwhole line\n[gpuq: again]\n"
