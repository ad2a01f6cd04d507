"""`gpuq run`'s stdin forwarded to its job, as srun forwards it to task 0: a pipe's bytes reach
the command's stdin in order and its end is the command's EOF, however large; a terminal, /dev/null
or a `gpuq submit` forwards nothing; the waiting input is bounded; only the owner may send it."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from dataclasses import replace

import pytest

from gpuq.service import broker, job_input, spec, submitting
from gpuq.service import constants as c
from gpuq.service.errors import NotAllowed, StateConflict
from gpuq.service.rights import Caller
from tests.conftest import output_of, settings_env, wait_for_state
from tests.test_scheduling import register

pytestmark = pytest.mark.timeout(120)


def run(settings, argv: list[str], data: bytes | None, cwd, timeout: float = 90) -> subprocess.CompletedProcess:
    """`gpuq run ARGV` with ``data`` on its stdin (a pipe; None: /dev/null), as a shell runs it."""
    return subprocess.run([sys.executable, "-m", "gpuq.cli", "run", *argv], env=settings_env(settings), cwd=cwd,
                          input=data, stdin=subprocess.DEVNULL if data is None else None, capture_output=True,
                          timeout=timeout)


@pytest.mark.slow
def test_a_pipe_reaches_the_command_in_order_and_its_end_is_the_commands_eof(stack, tmp_path):
    s = stack.settings
    upper = run(s, ["--", "tr", "a-z", "A-Z"], b"hello\nworld\n", tmp_path)
    assert (upper.returncode, upper.stdout) == (0, b"HELLO\nWORLD\n"), upper.stderr
    # 5 MiB of random bytes: twenty chunks, each waiting in Redis until the job takes it.
    data = bytes(range(256)) * (5 * 4096)
    digest = run(s, ["--", sys.executable, "-c", "import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read())"
                                                 ".hexdigest())"], data, tmp_path)
    assert digest.returncode == 0 and digest.stdout.decode().strip() == hashlib.sha256(data).hexdigest(), digest.stderr


@pytest.mark.slow
def test_a_command_that_stops_reading_ends_the_run_however_much_input_is_left(stack, tmp_path):
    s = stack.settings
    # `yes` never ends: the job's end is what ends `gpuq run`, and the rest of the input is dropped.
    done = subprocess.run(f"yes | {sys.executable} -m gpuq.cli run -- head -2", shell=True, env=settings_env(s),
                          cwd=tmp_path, capture_output=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"y\ny\n", b"")


@pytest.mark.slow
def test_without_a_pipe_or_from_gpuq_submit_a_job_reads_dev_null(stack, tmp_path):
    s = stack.settings
    nothing = run(s, ["--", "cat"], None, tmp_path)
    assert (nothing.returncode, nothing.stdout) == (0, b""), nothing.stderr
    batch = subprocess.run([sys.executable, "-m", "gpuq.cli", "submit", "--parsable", "--", "cat"],
                           env=settings_env(s), cwd=tmp_path, input=b"not for a batch job\n", capture_output=True,
                           timeout=60)
    job_id = int(batch.stdout)
    assert wait_for_state(s, job_id, c.END_STATES) == c.State.SUCCEEDED and output_of(s, job_id) == ""
    with_pipe = subprocess.run([sys.executable, "-m", "gpuq.cli", "run", "--detach", "--", "cat"],
                               env=settings_env(s), cwd=tmp_path, input=b"dropped\n", capture_output=True, timeout=60)
    assert with_pipe.returncode == 0, with_pipe.stderr  # --detach leaves at its start: nothing to forward then


def stdin_job(settings, user="ann", held=True) -> int:
    made = replace(spec.command_spec(["cat"], user=user), stdin=True)
    if held:
        made = replace(made, held=True)
    return submitting.submit_all(settings, [made])[0].id


def test_only_the_owner_or_root_may_send_input_and_only_to_a_job_that_reads_it(settings):
    register(settings, "a", 1)
    job_id = stdin_job(settings)
    with pytest.raises(NotAllowed, match=f"job {job_id} belongs to ann; only they may send it input"):
        job_input.accept(settings, job_id, Caller(5002, "bob"), b"x", False)
    assert job_input.accept(settings, job_id, Caller(5001, "ann"), b"one ", False)
    assert job_input.accept(settings, job_id, Caller(0, "root"), b"two", True)
    conn = broker.shared(settings)
    taken = [job_input.take(conn, settings, job_id, 1) for _ in range(3)]
    assert taken == [b"one ", b"two", job_input.END]
    # A later attempt (a retry) reads what is left: the end, from its mark, at once.
    assert job_input.take(conn, settings, job_id, 1) == job_input.END
    plain = submitting.submit_all(settings, [replace(spec.command_spec(["cat"], user="ann"), held=True)])[0].id
    with pytest.raises(StateConflict, match="reads no input"):
        job_input.accept(settings, plain, Caller(5001, "ann"), b"x", False)


def test_the_waiting_input_is_bounded_and_a_full_list_takes_nothing_until_the_job_reads(settings):
    register(settings, "a", 1)
    job_id = stdin_job(settings)
    ann, conn = Caller(5001, "ann"), broker.shared(settings)
    for _ in range(job_input.MAX_QUEUED):
        assert job_input.accept(settings, job_id, ann, b"x" * 10, False)
    assert not job_input.accept(settings, job_id, ann, b"more", False)
    assert job_input.take(conn, settings, job_id, 1) == b"x" * 10
    assert job_input.accept(settings, job_id, ann, b"more", False)
    assert not job_input.accept(settings, job_id, ann, b"again", False)
    assert job_input.accept(settings, job_id, ann, b"", True)  # its end is taken, full or not
    taken = [job_input.take(conn, settings, job_id, 1) for _ in range(job_input.MAX_QUEUED + 1)]
    assert taken[-2:] == [b"more", job_input.END]


def test_a_chunk_sent_again_with_its_place_in_the_input_is_appended_once(settings):
    # `gpuq run` sends a chunk again after its server restarted, not knowing whether the one that
    # died appended it: its seq makes that safe, a full list included.
    register(settings, "a", 1)
    job_id = stdin_job(settings)
    ann, conn = Caller(5001, "ann"), broker.shared(settings)
    assert job_input.accept(settings, job_id, ann, b"one", False, seq=0)
    assert job_input.accept(settings, job_id, ann, b"one", False, seq=0)  # sent again: taken already
    for seq in range(1, job_input.MAX_QUEUED):
        assert job_input.accept(settings, job_id, ann, b"x", False, seq=seq)
    full = job_input.MAX_QUEUED
    assert not job_input.accept(settings, job_id, ann, b"two", False, seq=full)  # full: not taken, not counted
    assert job_input.take(conn, settings, job_id, 1) == b"one"
    assert job_input.accept(settings, job_id, ann, b"two", False, seq=full)
    assert job_input.accept(settings, job_id, ann, b"two", False, seq=full)
    assert job_input.accept(settings, job_id, ann, b"", True, seq=full + 1)
    assert job_input.accept(settings, job_id, ann, b"", True, seq=full + 1)
    taken = [job_input.take(conn, settings, job_id, 1) for _ in range(job_input.MAX_QUEUED + 1)]
    assert taken[-3:] == [b"x", b"two", job_input.END]
    assert job_input.take(conn, settings, job_id, 0.1) == job_input.END  # the end mark, and nothing more
