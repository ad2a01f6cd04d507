"""`--output` / `--error` (sbatch's -o and -e): a command's output copied to the user's own files as
it runs, patterns filled in per job, opened by the job's process (tests/test_multiuser.py proves
it is opened as the user); gpuq's own copy (`gpuq logs`) stays whole, and gives one stream alone
when asked (`--stdout`, `--stderr`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.errors import InvalidSpec
from gpuq.service.output_files import check, fill
from gpuq.workers.output_copy import Copy, OutputFiles
from tests.conftest import run_cli, stack_on_database, wait_for_state

pytestmark = pytest.mark.timeout(120)
PRINTS = [sys.executable, "-c", "import sys; print('to stdout', flush=True); print('to stderr', file=sys.stderr)"]


def test_a_pattern_fills_in_the_jobs_id_array_name_user_and_node_and_a_percent_that_fills_nothing_is_refused():
    job = dict(job_id=12, array_id=10, array_index=2, name="train/a", user="ann", node="gpu1.lab")
    assert fill("/o/%x-%A_%a-%j.%u.%N.log", **job) == "/o/train_a-10_2-12.ann.gpu1.log"
    assert fill("/o/%j-%A-[%a]-100%%", **job | {"array_id": None, "array_index": None}) == "/o/12-12-[]-100%"
    assert check("--output", "/o/%j.log") == "/o/%j.log" and check("--error", None) is None
    for path, says in [("o.log", "must be an absolute path"), ("", "must be an absolute path"),
                       ("/o/", "must name a file"), ("/o/a\x00b", "must name a file"),
                       ("/o/%q.log", "%q fills in nothing"), ("/o/x%", "a lone % at its end"),
                       ("/" + "a" * 5000, "longer than 4096 bytes")]:
        with pytest.raises(InvalidSpec, match=says):
            check("--output", path)


def test_one_file_for_both_streams_is_opened_once_and_two_files_each_once():
    both = OutputFiles("/o/a.log", None)
    assert both.paths == ["/o/a.log"] and both.for_streams([5]) == (5, 5)
    apart = OutputFiles("/o/a.log", "/o/b.err")
    assert apart.paths == ["/o/a.log", "/o/b.err"] and apart.for_streams([5, 6]) == (5, 6)
    assert OutputFiles(None, "/o/b.err").for_streams([6]) == (None, 6)
    assert OutputFiles("/o/a.log", "/o/a.log").for_streams([5]) == (5, 5)


def test_a_copy_whose_write_fails_says_so_once_and_copies_nothing_more(tmp_path):
    full = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC
    copy = Copy(full, "/data/run.log")
    assert copy.write(b"a") == ("[gpuq: writing the output to /data/run.log failed (No space left on device); "
                                "the rest is in `gpuq logs` only]")
    assert copy.write(b"b") is None
    copy.close()
    copy.close()  # once closed, closed: no number reused elsewhere is touched
    assert copy.write(b"c") is None


@pytest.fixture(scope="module", params=["sqlite"])
def one_gpu(request, tmp_path_factory, redis_url):
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=1)


def submitted(out) -> list[dict]:
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout)
    return made if isinstance(made, list) else [made]


def test_output_copies_both_streams_to_a_file_relative_to_the_submit_directory_and_logs_keep_them(one_gpu, tmp_path):
    s = one_gpu.settings
    [job] = submitted(run_cli(["submit", "--json", "-o", "run-%j.log", "--", *PRINTS], s, cwd=tmp_path))
    assert job["output_file"] == f"{tmp_path}/run-%j.log"
    assert wait_for_state(s, job["id"], c.END_STATES) == State.SUCCEEDED, one_gpu.logs()
    assert sorted((tmp_path / f"run-{job['id']}.log").read_text().splitlines()) == ["to stderr", "to stdout"]
    assert sorted(run_cli(["logs", str(job["id"])], s).stdout.splitlines()) == ["to stderr", "to stdout"]
    shown = run_cli(["show", str(job["id"])], s).stdout
    assert f"copied  stdout and stderr to {tmp_path}/run-%j.log" in shown


def test_error_parts_the_streams_and_each_array_task_gets_its_own_files(one_gpu, tmp_path):
    s = one_gpu.settings
    made = submitted(run_cli(["submit", "--json", "--array", "0-1", "-o", "%x.%A_%a.out", "-e", "%A_%a.err",
                              "-J", "job", "--", *PRINTS], s, cwd=tmp_path))
    array = made[0]["array_id"]
    for task in made:
        assert wait_for_state(s, task["id"], c.END_STATES) == State.SUCCEEDED, one_gpu.logs()
    for index in (0, 1):
        assert (tmp_path / f"job[{index}].{array}_{index}.out").read_text() == "to stdout\n"
        assert (tmp_path / f"{array}_{index}.err").read_text() == "to stderr\n"
    # A task run again is no task, but its output goes to the files of the task it repeats.
    (tmp_path / f"{array}_1.err").unlink()
    again = json.loads(run_cli(["resubmit", "--json", str(made[1]["id"])], s).stdout)
    assert wait_for_state(s, again["id"], c.END_STATES) == State.SUCCEEDED, one_gpu.logs()
    assert (tmp_path / f"{array}_1.err").read_text() == "to stderr\n"


def test_a_retry_appends_to_the_first_attempts_file_and_a_new_job_starts_it_afresh(one_gpu, tmp_path):
    s = one_gpu.settings
    marker = tmp_path / "tried"
    script = (f"import os, sys; first = not os.path.exists({str(marker)!r}); open({str(marker)!r}, 'a').close(); "
              "print('first' if first else 'second'); sys.exit(1 if first else 0)")
    log = tmp_path / "retried.log"
    log.write_text("left by an earlier job\n")
    [job] = submitted(run_cli(["submit", "--json", "--retries", "1", "-o", str(log), "--", sys.executable, "-c",
                               script], s, cwd=tmp_path))
    assert wait_for_state(s, job["id"], c.END_STATES) == State.SUCCEEDED, one_gpu.logs()
    assert log.read_text() == "first\nsecond\n"


def test_output_that_cannot_be_opened_fails_the_job_naming_why_and_bad_paths_are_refused_at_submit(one_gpu, tmp_path):
    s = one_gpu.settings
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    [job] = submitted(run_cli(["submit", "--json", "-o", str(fifo), "--", "echo", "never"], s, cwd=tmp_path))
    assert wait_for_state(s, job["id"], c.END_STATES) == State.FAILED
    user = run_cli(["show", "--json", str(job["id"])], s)
    ended = json.loads(user.stdout)
    assert ended["exit_code"] == 126
    assert ended["reason"].startswith(f"cannot start: cannot open {fifo} as ")
    assert ended["reason"].endswith(": a pipe with no reader")
    [quiet] = submitted(run_cli(["submit", "--json", "-o", "/dev/null", "--", "echo", "gone"], s, cwd=tmp_path))
    assert wait_for_state(s, quiet["id"], c.END_STATES) == State.SUCCEEDED
    for args, says in [(["-o", "missing/run.log", "--", "true"], f"--output: {tmp_path}/missing is not a directory "
                                                                 "you may write in"),
                       (["-e", "x-%q", "--", "true"], "--error: %q fills in nothing"),
                       (["-o", "run.log", "matmul"], "--output and --error are for a command (after --)")]:
        refused = run_cli(["submit", *args], s, cwd=tmp_path)
        assert refused.returncode == c.EXIT_USAGE and refused.stdout == ""
        assert refused.stderr.startswith(f"gpuq: {says}"), refused.stderr
    assert not any(Path(tmp_path).glob("run*.log"))


def test_logs_gives_one_stream_alone_when_asked_and_refuses_both_flags(one_gpu, tmp_path):
    s = one_gpu.settings
    [job] = submitted(run_cli(["submit", "--json", "--", *PRINTS], s, cwd=tmp_path))
    assert wait_for_state(s, job["id"], c.END_STATES) == State.SUCCEEDED, one_gpu.logs()
    ident = str(job["id"])
    assert run_cli(["logs", ident, "--stdout"], s).stdout == "to stdout\n"
    assert run_cli(["logs", ident, "--stderr"], s).stdout == "to stderr\n"
    assert json.loads(run_cli(["logs", ident, "--stderr", "--json"], s).stdout)["output"] == "to stderr\n"
    assert run_cli(["logs", ident, "--stdout", "-f"], s).stdout == "to stdout\n"  # it ended: -f reads to its end
    both = run_cli(["logs", ident, "--stdout", "--stderr"], s)
    assert (both.returncode, both.stdout, both.stderr) == (
        c.EXIT_USAGE, "", "gpuq: give --stdout or --stderr, not both (neither: both streams, as written)\n")
