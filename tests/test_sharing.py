"""GPUs shared by small jobs (`--shared --mem`), against a real stack on one simulated 16 GiB GPU:
several run at once on it, each with its own end, cancel and failure class; a worker SIGKILLed
with four of them loses none; a whole-GPU job waits until every shared one has left the GPU."""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from dataclasses import replace

import pytest
from sqlalchemy import func, select

from gpuq.service import constants as c
from gpuq.service import spec, submitting
from gpuq.service.constants import State
from gpuq.service.db import read_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.jobs import get_job
from gpuq.service.models import Allocation, Job
from gpuq.service.units import parse_mem
from gpuq.service.usage import job_usage
from tests.conftest import cli_submit, run_cli, stack_on_database

pytestmark = pytest.mark.timeout(240)

GPU_MIB = 16384
CONTEXT_MIB = 512


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(request, tmp_path_factory, redis_url):
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=1, fake_gpu_memory_mib=GPU_MIB,
                                 shared_context_mib=CONTEXT_MIB, lease_timeout=4.0, shared_mem_grace=1.0)


def submit_shared(stack, argv: list[str], mem: str = "2G", **extra) -> int:
    made = submitting.submit(stack.settings, replace(spec.command_spec(argv), shared=True, mem_mib=parse_mem(mem),
                                                     **extra))
    return made.id


def jobs_of(stack, ids: list[int]) -> list[Job]:
    with read_scope(stack.settings) as session:
        rows = [get_job(session, i) for i in ids]
        session.expunge_all()
    return rows


def wait_ended(stack, ids: list[int], timeout: float = 90.0) -> list[Job]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = jobs_of(stack, ids)
        if all(j.state in c.END_STATES for j in rows):
            return rows
        time.sleep(0.1)
    raise AssertionError(f"not ended in {timeout} s: {[(j.id, j.state) for j in jobs_of(stack, ids)]}\n" + stack.logs())


def wait_running(stack, ids: list[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(j.state == State.RUNNING for j in jobs_of(stack, ids)):
            return
        time.sleep(0.05)
    raise AssertionError(f"not all running: {[(j.id, j.state) for j in jobs_of(stack, ids)]}\n" + stack.logs())


def test_four_shared_jobs_run_at_once_on_one_gpu_each_charged_its_share(stack, tmp_path):
    # Each runs until the test lets it go: a fixed sleep could end the first before a loaded
    # machine started the fourth.
    gate = tmp_path / "go"
    ids = [submit_shared(stack, ["sh", "-c", f"sleep 0.5; while [ ! -e {gate} ]; do sleep 0.05; done"])
           for _ in range(4)]
    wait_running(stack, ids)  # all four on the one GPU at the same time
    with read_scope(stack.settings) as session:
        held = session.execute(select(func.count(), func.sum(Allocation.share_mib))
                               .where(Allocation.job_id.in_(ids))).one()
    assert held == (4, 4 * (2048 + CONTEXT_MIB))
    _every_view_shows_the_shares(stack, ids)
    gate.touch()
    ended = wait_ended(stack, ids)
    assert [j.state for j in ended] == [State.SUCCEEDED] * 4
    starts, ends = max(j.started_at for j in ended), min(j.ended_at for j in ended)
    assert starts < ends  # they overlapped
    share = (2048 + CONTEXT_MIB) / GPU_MIB
    assert all(j.gpu_share == pytest.approx(share) for j in ended)
    with read_scope(stack.settings) as session:
        summary = job_usage(session, ids[0])
        assert summary.gpu_hours == pytest.approx(summary.wall_s * share / 3600.0)


def test_shares_never_exceed_the_gpu_the_rest_wait_with_the_figures(stack):
    # 16 GiB holds six 2 GiB shares with their 0.5 GiB reserves (6 x 2.5 = 15), not seven.
    ids = [submit_shared(stack, ["sleep", "3"]) for _ in range(7)]
    wait_running(stack, ids[:6])
    time.sleep(1.0)
    assert jobs_of(stack, ids[6:])[0].state == State.PENDING
    why = run_cli(["why", str(ids[6])], stack.settings)
    assert "1.0 GiB left of 16 (6 shared jobs hold 15.0), job needs 2.0 + 0.5" in why.stdout, why.stdout
    assert [j.state for j in wait_ended(stack, ids)] == [State.SUCCEEDED] * 7


def test_cancelling_one_of_four_leaves_the_others_running_to_success(stack):
    ids = [submit_shared(stack, ["sleep", "3"]) for _ in range(4)]
    wait_running(stack, ids)
    out = run_cli(["cancel", str(ids[1])], stack.settings)
    assert out.returncode == 0, out.stderr
    ended = wait_ended(stack, ids)
    assert [j.state for j in ended] == [State.SUCCEEDED, State.CANCELLED, State.SUCCEEDED, State.SUCCEEDED]


def test_one_failing_shared_job_keeps_its_own_failure_and_output(stack):
    ids = [submit_shared(stack, ["sh", "-c", f"echo out-{n}; echo err-{n} >&2; exit {n}"]) for n in range(3)]
    ended = wait_ended(stack, ids)
    assert [j.state for j in ended] == [State.SUCCEEDED, State.FAILED, State.FAILED]
    assert [j.exit_code for j in ended] == [0, 1, 2]
    for n, job_id in enumerate(ids):
        logs = run_cli(["logs", str(job_id)], stack.settings)
        assert f"out-{n}" in logs.stdout and f"err-{n}" in logs.stdout


def test_a_shared_job_over_its_share_is_stopped_as_gpu_mem_exceeded_and_the_other_three_succeed(stack):
    hold = [sys.executable, "-m", "gpuq.workers.simulated_memory"]
    ok = [submit_shared(stack, [*hold, "--mib", "1500", "--seconds", "4"]) for _ in range(3)]
    greedy = submit_shared(stack, [*hold, "--mib", "1000", "--then-mib", "4000", "--after", "1", "--seconds", "20"])
    ended = wait_ended(stack, [*ok, greedy])
    assert [j.state for j in ended[:3]] == [State.SUCCEEDED] * 3
    over = ended[3]
    assert over.state == State.FAILED and over.failure == c.FAILURE_GPU_MEM_EXCEEDED
    assert "used 3.9 GiB of its 2.5 GiB share" in over.reason, over.reason
    # It ran 1 s under its share, then the grace (1 s here): stopped long before its 20 s.
    assert (over.ended_at - over.started_at).total_seconds() < 10
    with read_scope(stack.settings) as session:
        assert job_usage(session, greedy).memory_peak_mib >= 4000
        assert job_usage(session, ok[0]).memory_peak_mib == 1500
    stats = run_cli(["stats", str(greedy)], stack.settings)
    assert stats.returncode == 0, stats.stderr
    assert f"of its {2048 + CONTEXT_MIB} MiB share" in stats.stdout, stats.stdout


def test_a_shared_job_whose_process_left_its_tree_is_still_held_to_its_share(stack):
    # A double fork into a session of its own: the watch summed only the command's tree, so the
    # escaped process held 4 GiB on a 2 GiB share unseen. It carries the job's GPUQ_RUN_ID.
    hold = shlex.join([sys.executable, "-m", "gpuq.workers.simulated_memory", "--mib", "4000", "--seconds", "30"])
    escaped = submit_shared(stack, ["sh", "-c", f"(setsid {hold} &); sleep 30"])
    [ended] = wait_ended(stack, [escaped])
    assert ended.state == State.FAILED and ended.failure == c.FAILURE_GPU_MEM_EXCEEDED, (ended.state, ended.reason)
    assert "used 3.9 GiB of its 2.5 GiB share" in ended.reason, ended.reason
    assert (ended.ended_at - ended.started_at).total_seconds() < 20


def test_a_whole_gpu_job_waits_until_every_shared_job_has_left_the_gpu(stack):
    shared = [submit_shared(stack, ["sleep", "2"]) for _ in range(3)]
    wait_running(stack, shared)
    whole = submitting.submit(stack.settings, spec.command_spec(["true"])).id
    ended = wait_ended(stack, [*shared, whole])
    assert ended[-1].state == State.SUCCEEDED
    assert ended[-1].started_at >= max(j.ended_at for j in ended[:-1])


def test_a_worker_sigkilled_with_four_shared_jobs_loses_none_and_runs_none_twice(stack):
    ids = [submit_shared(stack, ["sleep", "30"], max_retries=1 if n % 2 else 0) for n in range(4)]
    wait_running(stack, ids)
    name = next(n for n in stack.procs if n.startswith("worker-"))
    stack.procs[name].send_signal(signal.SIGKILL)
    stack.procs[name].wait(10)
    stack.start_worker(0)
    stack.wait_registered(1)
    # Without retries: failed as worker_lost once the lease ran out. With one: requeued, and runs
    # again (once) on the new worker.
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        rows = jobs_of(stack, ids)
        # The ones with a retry: running again, after the attempt the reaper ended (before it, they
        # still show the killed worker's "running" until their lease runs out).
        if all(j.state == State.FAILED for j in rows[::2]) and \
                all(j.state == State.RUNNING and j.attempts for j in rows[1::2]):
            break
        time.sleep(0.2)
    rows = jobs_of(stack, ids)
    assert [j.state for j in rows] == [State.FAILED, State.RUNNING, State.FAILED, State.RUNNING], stack.logs()
    assert all(j.failure == c.FAILURE_WORKER_LOST for j in rows[::2]), [(j.id, j.failure, j.reason) for j in rows]
    # Each requeued for its worker's loss (a requeue uses up no retry), never ended for its own doing.
    assert all(j.attempts and {a["failure"] for a in j.attempts} == {c.FAILURE_WORKER_LOST} for j in rows[1::2]), \
        [(j.id, j.state, j.attempts) for j in rows]
    for job_id in ids[1::2]:
        run_cli(["cancel", str(job_id)], stack.settings)
    wait_ended(stack, ids)


def test_a_resubmitted_shared_job_is_shared_again(stack):
    from gpuq.service.resubmit import resubmit

    first = submit_shared(stack, ["true"], mem="1G")
    wait_ended(stack, [first])
    again = resubmit(stack.settings, first)
    assert again.shared and again.mem_mib == 1024
    assert wait_ended(stack, [again.id])[0].state == State.SUCCEEDED


def test_shared_without_mem_is_one_line_and_writes_nothing(stack):
    with read_scope(stack.settings) as session:
        before = session.scalar(select(func.count()).select_from(Job))
    out = run_cli(["submit", "--shared", "--", "true"], stack.settings)
    assert out.returncode == c.EXIT_USAGE and out.stderr.count("\n") == 1 and "--shared needs --mem" in out.stderr
    with pytest.raises(InvalidSpec, match="CUDA context"):
        submit_shared(stack, ["true"], mem="16G")
    with read_scope(stack.settings) as session:
        assert session.scalar(select(func.count()).select_from(Job)) == before


def test_show_and_every_json_view_say_a_job_is_shared_and_whole_gpu_mem_stays_free_memory(stack):
    s = stack.settings
    shared = cli_submit(s, ["--hold", "--shared", "--mem", "3G", "--", "true"])
    whole = cli_submit(s, ["--hold", "--mem", "3G", "--", "true"])
    try:
        shown = run_cli(["show", str(shared)], s).stdout
        # A share of the GPU, not the whole-GPU wording (a free-memory requirement) of the same --mem.
        assert ("    shares  3.0 GiB of each GPU, plus its 0.5 GiB CUDA context reserve "
                "(GPUQ_SHARED_CONTEXT_MIB)\n") in shown, shown
        assert "free per GPU" not in shown
        assert "     asks  3072 MiB free per GPU; held\n" in run_cli(["show", str(whole)], s).stdout
        assert json.loads(run_cli(["show", "--json", str(shared)], s).stdout)["shared"] is True
        assert json.loads(run_cli(["show", "--json", str(whole)], s).stdout)["shared"] is False
        listed = {j["id"]: j["shared"] for j in json.loads(run_cli(["status", "--json"], s).stdout)["jobs"]}
        assert (listed[shared], listed[whole]) == (True, False)
        # The table's GPUS column tells a share from whole GPUs, as squeue's TRES tells a shard from a GPU.
        table = {line.split()[0]: line for line in run_cli(["status"], s).stdout.splitlines() if line.strip()}
        assert " share 3.0G " in table[str(shared)] and "share" not in table[str(whole)], table
    finally:
        assert run_cli(["cancel", str(shared), str(whole)], s).returncode == 0
    ended = {j["id"]: j["shared"] for j in json.loads(run_cli(["history", "--json"], s).stdout)["jobs"]}
    assert (ended[shared], ended[whole]) == (True, False)


def _every_view_shows_the_shares(stack, ids: list[int]) -> None:
    """`gpuq status`, `gpuq devices`, the dashboard's GPU table and /metrics list each shared job."""
    import json

    from gpuq.cli.client import Client
    from gpuq.web import pages
    from gpuq.web.metrics import exposition

    share = 2048 + CONTEXT_MIB
    status = json.loads(run_cli(["status", "--json"], stack.settings).stdout)["gpus"]
    assert sorted(s["job_id"] for g in status for s in g["shares"]) == ids
    assert all(s["share_mib"] == share for g in status for s in g["shares"])
    devices = json.loads(run_cli(["devices", "--json"], stack.settings).stdout)
    assert sorted(s["job_id"] for d in devices for s in d["shares"]) == ids
    text = run_cli(["status"], stack.settings).stdout
    assert text.count("of 2.5G share") == 4 and "shared by 4" in text
    api = Client(str(stack.settings.server_socket))
    body, _ = exposition(api)
    lines = body.decode().splitlines()
    assert sum(line.startswith("gpuq_gpu_share_mib{") for line in lines) == 4
    assert all(f'job="{i}"' in body.decode() for i in ids)
    page = pages.queue(api)  # the dashboard's front page: the queue, then the GPUs with each share
    assert all(f'href="/jobs/{i}"' in page for i in ids) and "shared by 4" in page
