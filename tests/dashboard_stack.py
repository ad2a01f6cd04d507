"""A stack that ran real jobs, and a real `gpuq dashboard` process serving it: shared by the
dashboard, browser and metrics tests."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from tests.conftest import free_port, run_cli, settings_env, stack_on_database, wait_for_state
from tests.test_end_to_end import submit

TRAIN_EPOCHS = 3
# A job name a page must show as text, never run as markup.
XSS_NAME = "oops <script>alert(1)</script>"


@dataclass
class RanJobs:
    """The ids of the jobs the stack ran, by what they show."""

    train: int
    matmul: int
    failed: int
    running: int
    held: int
    dependent: int


def run_jobs(stack, tmp_path) -> RanJobs:
    """A finished training run and benchmark, a failed command (retried once), a running one, a held
    job and one waiting for it: every state and reason a page shows."""
    s = stack.settings
    train = submit(s, ["--name", "tiny-train", "train", "--epochs", str(TRAIN_EPOCHS), "--train-size", "256",
                       "--test-size", "64", "--batch-size", "64"])
    matmul = submit(s, ["--name", "bench", "matmul", "--size", "128", "--repeat", "20"])
    # Retried once: its first attempt is an earlier attempt's row (/metrics' reruns and CPU seconds).
    failed = submit(s, ["--name", XSS_NAME, "--retries", "1", "--", sys.executable, "-c",
                        "print('about to fail'); raise SystemExit(3)"], cwd=tmp_path)
    for job in (train, matmul):
        wait_for_state(s, job, ("succeeded",), timeout=90)
    wait_for_state(s, failed, ("failed",), timeout=60)
    running = submit(s, ["--name", "long-nap", "--", "sleep", "300"], cwd=tmp_path)
    held = submit(s, ["--name", "on-hold", "--hold", "--", "true"], cwd=tmp_path)
    dependent = submit(s, ["--name", "after-hold", "--after", str(held), "--", "true"], cwd=tmp_path)
    wait_for_state(s, running, ("running",), timeout=60)
    _wait_reason(s, dependent)
    time.sleep(1.5)  # a few samples of the running job
    return RanJobs(train, matmul, failed, running, held, dependent)


def _wait_reason(settings, job_id: int, timeout: float = 30.0) -> None:
    from gpuq.service import jobs
    from gpuq.service.db import write_scope

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with write_scope(settings) as session:
            if jobs.get_job(session, job_id).reason:
                return
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} got no pending reason in {timeout} s")


def stack_with_jobs(request, tmp_path_factory, redis_url):
    """Module fixture body: a stack sampling at 5 Hz that ran ``run_jobs``; yields (stack, jobs)."""
    for st in stack_on_database(request, tmp_path_factory, redis_url, sample_interval=0.2):
        ran = run_jobs(st, tmp_path_factory.mktemp("cwd"))
        try:
            yield st, ran
        finally:
            run_cli(["cancel", str(ran.running)], st.settings)
            wait_for_state(st.settings, ran.running, ("cancelled",), timeout=30)


class Dashboard:
    """`gpuq dashboard` as a real process on a free port of 127.0.0.1."""

    def __init__(self, settings, log_path, extra_args=()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "dashboard", "--port", str(self.port),
                                          *extra_args], env=settings_env(settings), stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.wait_up()

    def wait_up(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"dashboard exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.get("/")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"dashboard did not answer in {timeout} s:\n{self.log()}")

    def get(self, path: str, method: str = "GET") -> tuple[int, str, str]:
        """(status, content type, body) of one request."""
        req = urllib.request.Request(self.url + path, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> int:
        """SIGTERM, as Docker and systemd stop it; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError("the dashboard did not stop on SIGTERM") from None
