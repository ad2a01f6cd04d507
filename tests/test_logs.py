"""`gpuq up`'s logs are rotated by size, and a failure repeated every second logs its traceback once
a minute (service/logs.py, service/supervisor.py)."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpuq.service import supervisor
from gpuq.service.logs import FORMAT, MIB, RepeatFilter, rotate_log, rotate_logs
from gpuq.service.supervisor import Child, Supervisor
from tests.conftest import make_settings

pytestmark = pytest.mark.timeout(60)

# A child as the supervisor runs one (Child.start: its stdout and stderr the log, opened O_APPEND):
# it writes LINES numbered lines of about 1 KiB, then AFTER more. With "pause" it waits between the
# two until told to go on (the file GO exists); with "run" it writes on without a pause.
WRITER = textwrap.dedent("""
    import os, sys, time
    lines, after, pause, go = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "pause", sys.argv[4]
    pad = "x" * 1000
    for n in range(lines + after):
        if n == lines and pause:
            while not os.path.exists(go):
                time.sleep(0.01)
        sys.stdout.write(f"{n:08d} {pad}\\n")
        sys.stdout.flush()
        if not pause:
            time.sleep(0.0005)
""")


def writer(tmp_path: Path, log: Path, lines: int, after: int, pause: bool) -> Child:
    child = Child("writer", [sys.executable, "-c", WRITER, str(lines), str(after), "pause" if pause else "run",
                             str(tmp_path / "go")], dict(os.environ), log)
    child.start()
    return child


def numbers(path: Path) -> list[int]:
    data = path.read_bytes()
    assert b"\0" not in data, f"{path} has a hole: a write went to the old offset"
    assert data == b"" or data.endswith(b"\n")
    return [int(line.split()[0]) for line in data.decode().splitlines()]


def wait_until(done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_log_past_its_size_is_copied_to_1_and_its_writer_goes_on_at_the_start_of_the_current_file(tmp_path):
    settings = make_settings(tmp_path / "home", "sqlite://", "redis://127.0.0.1:1/0", log_rotate_mib=1,
                             log_rotate_keep=2)
    log = tmp_path / "worker-gpu0.log"
    child = writer(tmp_path, log, 1100, 200, pause=True)  # 1100 lines of 1 KiB: past 1 MiB
    try:
        wait_until(lambda: log.exists() and log.stat().st_size >= 1100 * 1010)
        assert rotate_logs(settings, [log, tmp_path / "absent.log"]) == [log]
        (tmp_path / "go").touch()
        assert child.proc is not None and child.proc.wait(30) == 0
    finally:
        child.signal(supervisor.signal.SIGKILL)
    # Every line is in one file or the other, in order; the child's writes after the truncation went
    # to the start of the emptied file (O_APPEND), not past a hole at its old offset.
    assert numbers(log.with_name("worker-gpu0.log.1")) == list(range(1100))
    assert numbers(log) == list(range(1100, 1300))
    assert not log.with_name("worker-gpu0.log.2").exists()
    # Below the size: left alone.
    assert rotate_logs(settings, [log]) == [] and numbers(log) == list(range(1100, 1300))


def test_a_log_rotated_while_its_writer_writes_on_has_no_hole_and_its_lines_in_order(tmp_path):
    log = tmp_path / "server.log"
    child = writer(tmp_path, log, 3000, 3000, pause=False)
    try:
        wait_until(lambda: log.exists() and log.stat().st_size >= 400 * 1010)
        assert rotate_log(log, 256 * 1024, keep=1)
        assert child.proc is not None and child.proc.wait(30) == 0
    finally:
        child.signal(supervisor.signal.SIGKILL)
    old, current = numbers(log.with_name("server.log.1")), numbers(log)
    assert old == list(range(len(old))) and len(old) >= 400
    assert current == list(range(current[0], 6000))
    # What the writer wrote between the copy's last read and the truncation is lost (the comment
    # on rotate_log): a line or so, not the log.
    assert 0 <= current[0] - len(old) < 50


def test_the_oldest_copy_beyond_the_count_is_removed_and_a_size_of_0_rotates_nothing(tmp_path):
    log = tmp_path / "scheduler.log"

    def copies() -> dict[str, str]:
        return {p.name: p.read_text() for p in sorted(tmp_path.glob("scheduler.log.*"))}

    for n in range(1, 5):
        log.write_text(f"round {n}\n" * 20)
        assert rotate_log(log, 100, keep=3)
        assert log.read_text() == ""
    assert copies() == {"scheduler.log.1": "round 4\n" * 20, "scheduler.log.2": "round 3\n" * 20,
                        "scheduler.log.3": "round 2\n" * 20}
    # Fewer kept than before: those beyond are removed at the next rotation.
    log.write_text("round 5\n" * 20)
    assert rotate_log(log, 100, keep=1)
    assert copies() == {"scheduler.log.1": "round 5\n" * 20}
    # None kept: emptied without a copy.
    log.write_text("round 6\n" * 20)
    assert rotate_log(log, 100, keep=0)
    assert copies() == {} and log.read_text() == ""
    # Size 0: rotation is off, whatever the size.
    log.write_bytes(b"x" * (MIB + 1))
    off = make_settings(tmp_path / "home", "sqlite://", "redis://127.0.0.1:1/0", log_rotate_mib=0)
    assert rotate_logs(off, [log]) == [] and log.stat().st_size == MIB + 1 and copies() == {}


def test_the_supervisor_rotates_its_own_log_and_its_childrens_from_its_loop_every_few_seconds(tmp_path):
    settings = make_settings(tmp_path / "home", "sqlite://", "redis://127.0.0.1:1/0", log_rotate_mib=1,
                             log_rotate_keep=4)
    settings.log_dir.mkdir(parents=True)
    sup = Supervisor(settings)
    assert {p.name for p in sup.log_paths()} == {"supervisor.log", "scheduler.log", "server.log", "worker-gpu0.log",
                                                 "worker-gpu1.log"}
    for name in ("supervisor.log", "worker-gpu1.log"):
        (settings.log_dir / name).write_bytes(b"y" * MIB)
    (settings.log_dir / "server.log").write_bytes(b"z" * (MIB - 1))
    sup._rotate_logs()
    assert sorted(p.name for p in settings.log_dir.iterdir()) == [
        "server.log", "supervisor.log", "supervisor.log.1", "worker-gpu1.log", "worker-gpu1.log.1"]
    # Not looked at again before LOG_CHECK seconds.
    (settings.log_dir / "worker-gpu1.log").write_bytes(b"y" * MIB)
    sup._rotate_logs()
    assert not (settings.log_dir / "worker-gpu1.log.2").exists()
    sup.log_check_at = 0.0
    sup._rotate_logs()
    assert (settings.log_dir / "worker-gpu1.log.2").exists()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def logger_with(filt: RepeatFilter, name: str) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(filt)
    logger = logging.getLogger(name)
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, out


def fail(logger: logging.Logger, n: int) -> None:
    try:
        raise OSError(28, "No space left on device")
    except OSError:
        logger.exception("job %s: could not store its output", n)


def test_a_hundred_identical_failures_in_a_second_log_one_traceback_then_one_line_saying_how_many_were_held(
        tmp_path):
    clock = Clock()
    filt = RepeatFilter(window=60.0, clock=clock)
    logger, out = logger_with(filt, "gpuq.test.repeats")
    for n in range(100):  # the same template, whatever the job: one failure
        fail(logger, n)
        clock.now += 0.01
    assert out.getvalue().count("Traceback") == 1 and "job 0: could not store its output" in out.getvalue()
    assert "suppressed" not in out.getvalue()
    clock.now += 60.0  # past 60 s after the first: the window is over
    logger.info("something else")
    fail(logger, 100)  # the failure goes on: its traceback again, after the count of the last minute's
    lines = out.getvalue().splitlines()
    summary = [line for line in lines if "suppressed" in line]
    assert len(summary) == 1 and re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ERROR gpuq.test.repeats: suppressed 99 repeats of this message "
        r"within 60 s of it: job 0: could not store its output", summary[0]), summary
    assert out.getvalue().count("Traceback") == 2
    assert lines.index(summary[0]) < [i for i, line in enumerate(lines) if "job 100" in line][0]
    # At exit, the count of a window not yet over.
    fail(logger, 101)
    filt.flush()
    assert out.getvalue().count("suppressed 1 repeats") == 1


def test_lines_that_differ_in_what_they_name_are_all_kept_and_other_loggers_and_levels_are_apart():
    clock = Clock()
    filt = RepeatFilter(window=60.0, clock=clock)
    logger, out = logger_with(filt, "gpuq.test.distinct")
    other, _ = logger_with(filt, "gpuq.test.other")
    other.handlers[:] = logger.handlers
    for name in ("scheduler", "server", "worker-gpu0"):
        logger.warning("exited %s (pid %s)", name, 7)
    logger.warning("exited %s (pid %s)", "server", 7)  # the same text: a repeat
    logger.error("exited %s (pid %s)", "server", 7)
    for _ in range(3):  # below WARNING nothing is held back (an audit line a submit)
        logger.info("submit by ann (uid 1001): job 7")
    fail(logger, 1)
    fail(other, 1)
    text = out.getvalue()
    assert [text.count(f"exited {n} ") for n in ("scheduler", "server", "worker-gpu0")] == [1, 2, 1]
    assert text.count("submit by ann") == 3 and not filt._held.get(("gpuq.test.distinct", logging.INFO))
    assert text.count("Traceback") == 2


def test_the_count_is_logged_when_the_window_ends_though_the_process_logs_nothing_else():
    clock = Clock()
    filt = RepeatFilter(window=60.0, clock=clock, background=True)
    logger, out = logger_with(filt, "gpuq.test.quiet")
    for n in range(5):
        fail(logger, n)
    clock.now += 61.0
    wait_until(lambda: "suppressed 4 repeats" in out.getvalue(), timeout=10)


def test_configure_keeps_the_format_and_a_worker_loop_failing_every_time_logs_one_traceback(tmp_path):
    # A real process, configured as the worker configures itself: the count comes at its exit.
    code = textwrap.dedent("""
        import logging
        from gpuq.service.logs import configure
        configure("INFO")
        configure("INFO")  # twice: one filter still
        log = logging.getLogger("gpuq.worker.sampler")
        for _ in range(100):
            try:
                raise OSError(28, "No space left on device")
            except OSError:
                log.exception("device sampling failed; retrying")
        log.info("stopping")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert done.stderr.count("Traceback") == 1 and done.stderr.count("OSError: [Errno 28]") == 1
    line = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (ERROR|INFO) gpuq.worker.sampler: "
    assert re.fullmatch(line + "device sampling failed; retrying", lines[0])
    assert re.fullmatch(line + "stopping", lines[-2])
    assert re.fullmatch(line + "suppressed 99 repeats of this message within 60 s of it: device sampling failed; "
                               "retrying", lines[-1])
