"""The fault suite: real processes, real Redis and databases, faults injected for real.

Every job here is a marker job (tests/faults.py) that records each run of itself, so each test can
assert how many times the job really ran and that no two copies ever ran at once. Jobs are
submitted, held, released and cancelled as users do it: the real `gpuq` command, through the
stack's server. `pytest -m faults` runs the suite alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from sqlalchemy import select

from gpuq.service import constants as c
from gpuq.service import db, job_output, jobs
from gpuq.service.celery_app import make_app, send_run_job
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.models import Allocation, Gpu, Job
from gpuq.workers.job_processes import cgroup_prefix, worker_mark
from tests.conftest import cli_submit, make_settings, output_of, run_cli, start_stack
from tests.faults import PrivatePostgres, PrivateRedis, marker_job, runs, stop_outside_a_transaction, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.slow]

# Short leases and intervals, so the reaper's bound is seconds, not the default half minute.
FAST = dict(lease_timeout=4.0, heartbeat_interval=0.5, worker_timeout=4.0, scheduler_interval=0.3,
            resend_after=3.0, kill_grace=1.0)


def make_stack(tmp_path, db_url, broker_url, **overrides):
    settings = make_settings(tmp_path / "home", db_url, broker_url, **{**FAST, **overrides})
    db.upgrade(settings)
    return start_stack(settings, tmp_path / "logs")


@pytest.fixture
def stack(tmp_path, database_url, redis_url):
    st = make_stack(tmp_path, database_url, redis_url)
    yield st
    st.stop()


def submit(settings, argv, cwd, *, max_retries: int = 0, held: bool = False, host_mem_mib: int | None = None) -> int:
    """Queue a command with `gpuq submit`, through the stack's server; its job id."""
    options = [*(["--retries", str(max_retries)] if max_retries else []), *(["--hold"] if held else []),
               *(["--host-mem", f"{host_mem_mib}M"] if host_mem_mib else [])]
    return cli_submit(settings, [*options, "--", *argv], cwd=cwd)


def gpuq(settings, *args: str) -> None:
    """A `gpuq` command that changes a job, through the stack's server, as its owner runs it."""
    done = run_cli(list(args), settings)
    assert done.returncode == 0, f"gpuq {' '.join(args)} failed ({done.returncode}): {done.stderr}"


def job(settings, job_id) -> Job:
    with write_scope(settings) as session:
        return jobs.get_job(session, job_id)


def wait_state(settings, job_id, states, timeout=60.0) -> Job:
    states = (states,) if isinstance(states, str) else states
    return wait_for(lambda: (j := job(settings, job_id)).state in states and j, timeout,
                    f"job {job_id} to be {'/'.join(states)}")


def wait_runs(marker, starts, timeout=60.0):
    wait_for(lambda: runs(marker).starts >= starts, timeout, f"{starts} starts in {marker.name}")


def worker_of(stack, job_id):
    """The worker process running the job (its name in the stack, and the process)."""
    j = job(stack.settings, job_id)
    index = int(j.worker.split("@")[0][3:])
    name = f"worker-{stack.settings.node}-{index}"
    return name, index, stack.procs[name]


def assert_settled(settings):
    """Nothing half-done: every job ended or visibly pending, and only running jobs hold GPUs."""
    with write_scope(settings) as session:
        for j in session.scalars(select(Job)):
            assert j.state in (*c.END_STATES, State.PENDING), f"job {j.id} left {j.state}"
        holders = session.scalars(select(Job.state).join(Allocation, Allocation.job_id == Job.id)).all()
        assert all(s in (State.DISPATCHED, State.RUNNING) for s in holders)


def first_pid(marker):
    return int(marker.read_text().split()[1])


# ---- workers killed and stopped ------------------------------------------------------------------

def test_a_sigkilled_workers_job_is_requeued_within_the_lease_and_runs_once_more(stack, tmp_path):
    argv, marker = marker_job(tmp_path, "kill", 3)
    job_id = submit(stack.settings, argv, tmp_path, max_retries=1)
    wait_runs(marker, 1)
    _, _, proc = worker_of(stack, job_id)
    killed_at = time.monotonic()
    proc.kill()
    first = wait_state(stack.settings, job_id, (State.PENDING, State.DISPATCHED, State.RUNNING, State.SUCCEEDED), 5)
    back = wait_for(lambda: job(stack.settings, job_id).requeues == 1, stack.settings.lease_timeout + 5,
                    "the reaper to requeue the job")
    took = time.monotonic() - killed_at
    print(f"job {job_id} requeued {took:.1f} s after its worker's SIGKILL (lease {stack.settings.lease_timeout:g} s)")
    assert back and first
    # The job's process died with its worker (parent-death signal): no second copy beside the next.
    wait_for(lambda: not psutil.pid_exists(first_pid(marker)), 5, "the first run's process to die")
    j = wait_state(stack.settings, job_id, State.SUCCEEDED, 60)
    r = runs(marker)
    assert (r.starts, r.ends, r.overlaps) == (2, 1, 0)
    assert j.requeues == 1 and j.attempts[0]["failure"] == c.FAILURE_WORKER_LOST and j.attempts[0]["requeue"]
    assert took <= stack.settings.lease_timeout + 3 * stack.settings.scheduler_interval + 2
    assert_settled(stack.settings)


@pytest.mark.timeout(180)
def test_a_stopped_workers_command_is_killed_by_the_lease_guard_before_its_job_runs_again(stack, tmp_path):
    # SIGSTOP stops the worker whole, its own fence (stop the job at 80% of an unrenewed lease)
    # included: its command ran on, and the requeued job ran a second copy beside it.
    argv, marker = marker_job(tmp_path, "stopped", 6)
    job_id = submit(stack.settings, argv, tmp_path, max_retries=1)
    wait_runs(marker, 1)
    first = first_pid(marker)
    _, _, proc = worker_of(stack, job_id)
    stop_outside_a_transaction(psutil.Process(proc.pid), stack.settings.database)
    stopped_at = time.monotonic()
    try:
        wait_for(lambda: not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE,
                 stack.settings.lease_timeout, "the lease guard to kill the stopped worker's command")
        killed = time.monotonic() - stopped_at
        assert job(stack.settings, job_id).requeues == 0, "requeued before the guard acted"
        # The reaper requeued it: it ran again. Under a full suite's load on two cores the second
        # run once had not come after 34 s, most likely because the worker had been stopped inside
        # a transaction whose row locks the reaper then waited on (now it is stopped outside one).
        wait_runs(marker, 2, stack.settings.lease_timeout + 60)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    j = wait_state(stack.settings, job_id, State.SUCCEEDED, 60)
    print(f"the guard killed the command {killed:.1f} s after its worker's SIGSTOP (lease "
          f"{stack.settings.lease_timeout:g} s)")
    assert j.requeues == 1 and j.attempts[0]["failure"] == c.FAILURE_WORKER_LOST
    assert runs(marker).overlaps == 0, marker.read_text()  # never two copies at once
    assert killed < stack.settings.lease_timeout
    assert_settled(stack.settings)


def test_a_sigkilled_workers_job_without_retries_fails_as_worker_lost(stack, tmp_path):
    argv, marker = marker_job(tmp_path, "lost", 30)
    job_id = submit(stack.settings, argv, tmp_path)
    wait_runs(marker, 1)
    worker_of(stack, job_id)[2].kill()
    j = wait_state(stack.settings, job_id, State.FAILED, stack.settings.lease_timeout + 5)
    assert j.failure == c.FAILURE_WORKER_LOST and j.reason.startswith("worker lost")
    assert runs(marker).starts == 1 and runs(marker).overlaps == 0
    assert_settled(stack.settings)


def test_a_sigkilled_workers_job_submitted_with_requeue_and_no_retries_runs_again_once(stack, tmp_path):
    # sbatch's --requeue: the machinery's failure puts it back, though it asked for no retry.
    argv, marker = marker_job(tmp_path, "requeue", 3)
    job_id = cli_submit(stack.settings, ["--requeue", "--", *argv], cwd=tmp_path)
    shown = run_cli(["show", str(job_id)], stack.settings)
    assert "requeue on a failure of its worker or GPU" in shown.stdout, shown.stdout
    wait_runs(marker, 1)
    worker_of(stack, job_id)[2].kill()
    j = wait_state(stack.settings, job_id, State.SUCCEEDED, 60)
    assert (j.requeues, j.attempts[0]["failure"], j.attempts[0]["requeue"]) == (1, c.FAILURE_WORKER_LOST, True)
    r = runs(marker)
    assert (r.starts, r.ends, r.overlaps) == (2, 1, 0)
    assert_settled(stack.settings)


def test_a_restarted_worker_kills_what_its_killed_predecessor_left(stack, tmp_path):
    from gpuq.workers.cgroup import CGROUP_ROOT, JobCgroup

    child, cgroup = tmp_path / "child.pid", tmp_path / "cgroup"
    script = tmp_path / "spawn.py"
    script.write_text("import subprocess, sys, time\n"
                      f"open({str(cgroup)!r}, 'w').write(''.join(line for line in open('/proc/self/cgroup')\n"
                      "                                         if 'gpuq-' in line))\n"
                      "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
                      f"open({str(child)!r}, 'w').write(str(p.pid))\n"
                      "time.sleep(300)\n")
    # With --cpus: where cgroups can be made, its quota's and its cpuset's directories are left too.
    job_id = cli_submit(stack.settings, ["--cpus", "1", "--", sys.executable, str(script)], cwd=tmp_path)
    wait_for(lambda: child.exists() and child.read_text(), 30, "the job's child")
    name, index, proc = worker_of(stack, job_id)
    proc.kill()
    proc.wait(10)
    orphan = int(child.read_text())
    assert psutil.pid_exists(orphan)  # the grandchild outlived the worker and the job's main process
    # A job of another stack's worker of the same name (same key prefix, same node: root's stack and
    # a user's own on one machine), which only its queue's database tells apart: not this one's.
    other = stack.settings.with_overrides(database_url=f"sqlite:///{tmp_path / 'another-queue.db'}")
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                 env={**os.environ, "GPUQ_WORKER": worker_mark(other, j_name(stack, job_id))})
    # Where the worker makes job cgroups, the killed job's is left (empty once its processes are
    # killed), and the other stack's worker of the same name has one of its own.
    theirs = JobCgroup.create(f"{cgroup_prefix(other, j_name(stack, job_id))}job{job_id}-000000", None)
    left = cgroup.read_text().strip().rsplit("/", 1)[-1]
    try:
        stack.procs.pop(name)
        stack.start_worker(index)
        wait_for(lambda: not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE,
                 30, "the restarted worker to kill the orphan")
        assert neighbour.poll() is None, "the restarted worker killed another stack's job"
        if theirs is not None:  # a machine that lets the worker make cgroups
            assert left.startswith(cgroup_prefix(stack.settings, j_name(stack, job_id))), left
            wait_for(lambda: not (theirs.path.parent / left).exists(), 30, "the restarted worker to remove the "
                     "cgroup its predecessor left")
            assert theirs.path.exists(), "the restarted worker removed another stack's cgroup"
            # Each hierarchy's directory of it (v1: memory, and cpu and cpuset for its --cpus) is gone.
            held = {controllers: path for _, controllers, path in (line.split(":", 2)
                                                                    for line in cgroup.read_text().splitlines())}
            if (CGROUP_ROOT / "cpuset" / "cgroup.procs").exists():  # cgroup v1's cpuset, as here
                assert "cpuset" in held, held
            for controllers, path in held.items():
                assert not (CGROUP_ROOT / controllers / path.lstrip("/")).exists(), (controllers, path)
    finally:
        neighbour.kill()
        neighbour.wait(10)
        if theirs is not None:
            theirs.remove()


@pytest.mark.timeout(120)
def test_a_killed_workers_job_is_taken_back_as_soon_as_the_worker_is_started_again_not_at_its_lease(
        tmp_path, redis_url):
    # The restarted worker killed what was left of the job, yet the job showed running, and its GPU
    # stood idle, until the lease (30 s by default) ran out.
    st = make_stack(tmp_path, f"sqlite:///{tmp_path / 'gpuq.db'}", redis_url, lease_timeout=90.0,
                    worker_timeout=90.0)
    try:
        argv, marker = marker_job(tmp_path, "restarted", 60)
        job_id = submit(st.settings, argv, tmp_path, max_retries=1)
        wait_runs(marker, 1)
        name, index, proc = worker_of(st, job_id)
        proc.kill()
        proc.wait(10)
        st.procs.pop(name)
        st.start_worker(index)
        j = wait_for(lambda: (j := job(st.settings, job_id)).attempts and j, 30, "the job taken back")
        attempt = j.attempts[0]
        assert attempt["failure"] == c.FAILURE_WORKER_LOST and attempt["requeue"], attempt
        assert "died and was started again" in attempt["reason"], attempt
        wait_runs(marker, 2)  # and it runs again, well before a lease of 90 s would have run out
        assert runs(marker).overlaps == 0
    finally:
        st.stop()


def j_name(stack, job_id) -> str:
    """The name of the worker that ran the job (gpu<index>@<node>)."""
    return job(stack.settings, job_id).worker


def test_sigterm_lets_the_running_job_finish_then_the_worker_exits(stack, tmp_path):
    argv, marker = marker_job(tmp_path, "warm", 3)
    job_id = submit(stack.settings, argv, tmp_path)
    wait_runs(marker, 1)
    _, _, proc = worker_of(stack, job_id)
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    j = job(stack.settings, job_id)
    assert j.state == State.SUCCEEDED
    assert (runs(marker).starts, runs(marker).ends) == (1, 1)


def test_a_second_sigterm_interrupts_the_job_which_is_requeued_without_using_a_retry(stack, tmp_path):
    argv, marker = marker_job(tmp_path, "cold", 4)
    job_id = submit(stack.settings, argv, tmp_path, max_retries=1)
    wait_runs(marker, 1)
    _, _, proc = worker_of(stack, job_id)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    j = wait_state(stack.settings, job_id, State.SUCCEEDED, 60)  # on the other GPU's worker
    assert j.attempts[0]["failure"] == c.FAILURE_INTERRUPTED and j.attempts[0]["requeue"]
    r = runs(marker)
    assert (r.starts, r.ends, r.overlaps) == (2, 1, 0)


def test_the_shutdown_grace_period_stops_a_long_job_and_marks_it_interrupted(tmp_path, redis_url):
    st = make_stack(tmp_path, f"sqlite:///{tmp_path / 'gpuq.db'}", redis_url, shutdown_grace=1.0)
    try:
        argv, marker = marker_job(tmp_path, "grace", 60)
        job_id = submit(st.settings, argv, tmp_path)
        wait_runs(marker, 1)
        _, _, proc = worker_of(st, job_id)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        j = job(st.settings, job_id)
        assert j.state == State.FAILED and j.failure == c.FAILURE_INTERRUPTED
        assert runs(marker).ends == 0
    finally:
        st.stop()


# ---- messages: redelivered, duplicated, lost -----------------------------------------------------

def test_a_job_longer_than_the_visibility_timeout_runs_once(tmp_path, redis_url):
    st = make_stack(tmp_path, f"sqlite:///{tmp_path / 'gpuq.db'}", redis_url, visibility_timeout=1.0)
    try:
        argv, marker = marker_job(tmp_path, "vis", 5)
        job_id = submit(st.settings, argv, tmp_path)
        assert wait_state(st.settings, job_id, State.SUCCEEDED, 60)
        time.sleep(2)  # a redelivery, if any, has been seen and dropped by now
        r = runs(marker)
        assert (r.starts, r.ends, r.overlaps) == (1, 1, 0)
    finally:
        st.stop()


def test_the_same_message_delivered_three_times_runs_the_job_once(stack, tmp_path):
    argv, marker = marker_job(tmp_path, "dup", 1)
    job_id = submit(stack.settings, argv, tmp_path, held=True)
    with write_scope(stack.settings) as session:
        queue = session.scalars(select(Gpu.queue)).first()
    gpuq(stack.settings, "release", str(job_id))
    wait_runs(marker, 1)
    app = make_app(stack.settings)
    with write_scope(stack.settings) as session:
        queue = session.scalar(select(Gpu.queue).join(Allocation).where(Allocation.job_id == job_id)) or queue
    for _ in range(2):
        send_run_job(app, queue, job_id)
    wait_state(stack.settings, job_id, State.SUCCEEDED)
    time.sleep(1.5)
    assert runs(marker).starts == 1 and runs(marker).overlaps == 0


def test_redis_restarted_empty_loses_no_job_and_runs_none_twice(tmp_path):
    broker = PrivateRedis(tmp_path)
    st = make_stack(tmp_path, f"sqlite:///{tmp_path / 'gpuq.db'}", broker.url)
    try:
        markers = []
        ids = []
        for i in range(6):
            argv, marker = marker_job(tmp_path, f"r{i}", 2)
            ids.append(submit(st.settings, argv, tmp_path))
            markers.append(marker)
        wait_for(lambda: sum(runs(m).starts for m in markers) >= 2, 30, "two jobs running")
        broker.restart_empty()
        for job_id in ids:
            assert wait_state(st.settings, job_id, State.SUCCEEDED, 90)
        for m in markers:
            r = runs(m)
            assert (r.starts, r.ends, r.overlaps) == (1, 1, 0), m.name
        assert_settled(st.settings)
    finally:
        st.stop()
        broker.stop()


def test_a_ddp_ranks_message_lost_when_redis_restarted_empty_is_sent_again_and_the_job_succeeds(tmp_path):
    # GPU 1's worker is stopped (SIGSTOP) while rank 0 asks it to run rank 1, and Redis restarts
    # empty before it reads the message: rank 0 then waited at the meeting point for its timeout
    # (300 s). The scheduler sees Redis's new run id and sends the running jobs' ranks again.
    broker = PrivateRedis(tmp_path)
    st = make_stack(tmp_path, f"sqlite:///{tmp_path / 'gpuq.db'}", broker.url, worker_timeout=30.0,
                    lease_timeout=30.0)
    second = psutil.Process(st.procs[f"worker-{st.settings.node}-1"].pid)
    try:
        stop_outside_a_transaction(second, st.settings.database)  # inside one, the submit waited on it
        job_id = cli_submit(st.settings, ["--gpus", "2", "train", "--strategy", "ddp", "--epochs", "1",
                                          "--batch-size", "64", "--train-size", "256", "--test-size", "64"])
        wait_for(lambda: job(st.settings, job_id).rendezvous is not None, 60, "rank 0 to ask for rank 1")
        broker.restart_empty()
        second.resume()
        done = wait_state(st.settings, job_id, c.END_STATES, 90)
        assert done.state == State.SUCCEEDED and done.result["world_size"] == 2, (done.state, done.reason)
        log = (tmp_path / "logs" / f"worker-{st.settings.node}-1.log").read_text()
        assert log.count(f"job {job_id} rank 1/2 started") == 1  # once, however many messages came
        assert_settled(st.settings)
    finally:
        if second.is_running() and second.status() == psutil.STATUS_STOPPED:
            second.resume()
        st.stop()
        broker.stop()


@pytest.mark.timeout(180)
def test_a_ddp_job_whose_peer_ranks_worker_is_killed_is_requeued_as_worker_lost_not_failed_by_its_workload(
        tmp_path, redis_url):
    # Rank 0's collectives fail the moment rank 1's worker dies ("connection reset"): that read as
    # the workload's own error and used up a retry.
    st = make_stack(tmp_path, f"sqlite:///{tmp_path / 'gpuq.db'}", redis_url)
    try:
        job_id = cli_submit(st.settings, ["--gpus", "2", "--retries", "1", "train", "--strategy", "ddp",
                                          "--epochs", "50", "--batch-size", "64", "--train-size", "2048",
                                          "--test-size", "64", "--checkpoint", ""])
        wait_for(lambda: job(st.settings, job_id).worker is not None, 60, "the job to start")
        _, rank0_index, _ = worker_of(st, job_id)
        peer = f"worker-{st.settings.node}-{1 - rank0_index}"
        wait_for(lambda: f"job {job_id} rank 1/2 started" in (tmp_path / "logs" / f"{peer}.log").read_text(), 60,
                 "rank 1 to start")
        time.sleep(2)  # training: the ranks are in their collectives
        st.procs[peer].kill()
        j = wait_for(lambda: (j := job(st.settings, job_id)).attempts and j, 60, "the first attempt's end")
        attempt = j.attempts[0]
        assert attempt["failure"] == c.FAILURE_WORKER_LOST and attempt["requeue"], attempt
        assert "rank 1's worker" in attempt["reason"] and "was lost" in attempt["reason"], attempt
        # Its retry kept, it waits for two GPUs again: the lost worker's is offline at once (placed
        # there again before its heartbeat ran out, it burnt its requeues in a second).
        time.sleep(2)
        j = job(st.settings, job_id)
        assert j.state == State.PENDING and j.requeues == 1, (j.state, j.requeues, j.attempts)
        with write_scope(st.settings) as session:
            offline = session.scalar(select(Gpu).where(Gpu.index == 1 - rank0_index))
            assert offline.worker is None and offline.heartbeat_at is None
    finally:
        st.stop()


# ---- the database restarted ---------------------------------------------------------------------

def test_postgresql_restarted_while_jobs_run_loses_nothing_and_nobody_restarts(tmp_path, redis_url):
    try:
        pg = PrivatePostgres(tmp_path)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no private PostgreSQL here: {exc}")
    st = make_stack(tmp_path, pg.url, redis_url, lease_timeout=30.0)
    try:
        pids = {n: p.pid for n, p in st.procs.items()}
        markers, ids = [], []
        for i in range(3):
            argv, marker = marker_job(tmp_path, f"pg{i}", 4)
            ids.append(submit(st.settings, argv, tmp_path))
            markers.append(marker)
        wait_for(lambda: sum(runs(m).starts for m in markers) >= 2, 30, "two jobs running")
        pg.stop()
        time.sleep(3)
        pg.start()
        db.dispose_engines()  # this test process's own pool: the servers' processes keep theirs
        for job_id in ids:
            assert wait_state(st.settings, job_id, State.SUCCEEDED, 90)
        for m in markers:
            r = runs(m)
            assert (r.starts, r.ends, r.overlaps) == (1, 1, 0), m.name
        late = submit(st.settings, marker_job(tmp_path, "after", 0.1)[0], tmp_path)
        assert wait_state(st.settings, late, State.SUCCEEDED, 60)
        # Reconnected, not restarted: the same processes all along.
        assert all(p.poll() is None and p.pid == pids[n] for n, p in st.procs.items())
        # Output written across the outage is all there.
        with write_scope(st.settings) as session:
            assert all(job_output.read_output(session, j) is not None for j in ids)
    finally:
        st.stop()
        db.dispose_engines()
        pg.remove()


def test_eight_processes_submitting_at_once_on_sqlite_lose_nothing(tmp_path, redis_url):
    st = make_stack(tmp_path, f"sqlite:///{tmp_path / 'gpuq.db'}", redis_url)
    try:
        from tests.conftest import settings_env

        env = settings_env(st.settings)
        code = ("import subprocess, sys\n"
                "for i in range(5):\n"
                "    subprocess.run([sys.executable, '-m', 'gpuq.cli', 'submit', '--json', '--', 'true'],"
                " check=True)\n")
        procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp_path,
                                  stdout=subprocess.PIPE, text=True) for _ in range(8)]
        outputs = [p.communicate(timeout=240)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs)
        ids = [json.loads(doc)["id"] for out in outputs for doc in out.replace("}\n{", "}\x00{").split("\x00")]
        assert len(ids) == 40 and len(set(ids)) == 40
        for job_id in ids:
            assert wait_state(st.settings, job_id, State.SUCCEEDED, 120)
    finally:
        st.stop()


# ---- failures classified -------------------------------------------------------------------------

def test_a_cuda_out_of_memory_message_is_classified_and_shown(stack, tmp_path):
    code = ("import sys; print('step 1 ok'); print('torch.OutOfMemoryError: CUDA out of memory. "
            "Tried to allocate 20.00 GiB', file=sys.stderr); sys.exit(1)")
    job_id = submit(stack.settings, [sys.executable, "-c", code], tmp_path)
    j = wait_state(stack.settings, job_id, State.FAILED)
    assert j.failure == c.FAILURE_CUDA_OOM and j.reason.startswith("CUDA out of memory")
    shown = run_cli(["show", str(job_id)], stack.settings)
    assert "failure  cuda_oom" in shown.stdout and "Tried to allocate 20.00 GiB" in shown.stdout


def test_a_command_past_its_host_memory_limit_is_oom_killed_and_classified(stack, tmp_path):
    from gpuq.workers.cgroup import JobCgroup

    probe = JobCgroup.create(f"gpuq-probe-{os.getpid()}", None)
    if probe is None:
        pytest.skip("no writable memory cgroup here")
    probe.remove()
    # It names its own cgroup first: a stack of another test running beside this one (pytest -n 2)
    # makes cgroups of the same worker and job id, so a name's prefix is not this job's alone.
    code = ("print([line for line in open('/proc/self/cgroup') if 'gpuq-' in line][0], flush=True); "
            "x = bytearray(512 * 2**20); print(len(x))")
    job_id = submit(stack.settings, [sys.executable, "-c", code], tmp_path, host_mem_mib=64)
    j = wait_state(stack.settings, job_id, State.FAILED)
    assert j.failure == c.FAILURE_HOST_OOM and "OOM killer" in j.reason and "64 MiB" in j.reason
    # The job's cgroup went with it.
    [line] = [ln for ln in output_of(stack.settings, job_id).splitlines() if "gpuq-" in ln]
    name = line.rsplit("/", 1)[-1].strip()
    assert name.startswith(f"{cgroup_prefix(stack.settings, j.worker)}job{job_id}-"), line
    assert not (probe.path.parent / name).exists()


def test_cancel_frees_the_gpu_only_once_every_process_of_the_job_is_gone(stack, tmp_path):
    pids = tmp_path / "pids"
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import os, signal, sys, time\n"
                       "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                       f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
                       "time.sleep(300)\n")
    escaper = tmp_path / "escaper.py"
    # A grandchild in a session of its own, whose parent exits: out of the job's group and tree.
    escaper.write_text("import subprocess, sys\n"
                       f"subprocess.Popen([sys.executable, {str(sleeper)!r}], start_new_session=True)\n")
    script = tmp_path / "stubborn.py"
    script.write_text("import signal, subprocess, sys, time\n"
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      f"subprocess.Popen([sys.executable, {str(sleeper)!r}])\n"
                      f"subprocess.run([sys.executable, {str(escaper)!r}])\n"
                      f"exec(open({str(sleeper)!r}).read())\n")
    job_id = submit(stack.settings, [sys.executable, str(script)], tmp_path)
    wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 3, 30, "the job's processes")
    procs = [int(p) for p in pids.read_text().split()]
    gpuq(stack.settings, "cancel", str(job_id))
    j = wait_state(stack.settings, job_id, State.CANCELLED, 30)
    alive = [p for p in procs if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes of job {job_id} outlived its cancel: {alive}"
    assert j.failure == c.FAILURE_CANCELLED
    with write_scope(stack.settings) as session:
        assert jobs.job_gpus(session, job_id) == []


# ---- GPUs: foreign use, lost ---------------------------------------------------------------------

def test_a_gpu_with_a_foreign_process_is_not_given_to_a_job_without_mem(tmp_path, redis_url):
    st = make_stack(tmp_path, f"sqlite:///{tmp_path / 'gpuq.db'}", redis_url, fake_gpu_foreign="0:4000:4242:bob")
    try:
        argv, marker = marker_job(tmp_path, "f1", 3)
        first = submit(st.settings, argv, tmp_path)
        second = submit(st.settings, marker_job(tmp_path, "f2", 0.1)[0], tmp_path)
        assert wait_state(st.settings, first, State.RUNNING, 30)
        assert job(st.settings, first).worker.startswith("gpu1@")
        time.sleep(1)
        assert job(st.settings, second).state == State.PENDING  # GPU 0 is free of gpuq jobs, not of bob's
        assert wait_state(st.settings, second, State.SUCCEEDED, 30).worker.startswith("gpu1@")
    finally:
        st.stop()


def test_a_lost_gpu_stops_its_job_is_drained_and_the_job_runs_again_elsewhere(stack, tmp_path):
    argv, marker = marker_job(tmp_path, "gpulost", 4)
    job_id = submit(stack.settings, argv, tmp_path, max_retries=1)
    wait_runs(marker, 1)
    _, index, _ = worker_of(stack, job_id)
    faults = stack.settings.home / "simulated-faults"
    faults.mkdir(parents=True, exist_ok=True)
    (faults / f"{stack.settings.node}.{index}.lost").touch()
    j = wait_state(stack.settings, job_id, State.SUCCEEDED, 60)
    assert j.attempts[0]["failure"] == c.FAILURE_GPU_LOST and j.attempts[0]["requeue"]
    assert not j.worker.startswith(f"gpu{index}@")
    r = runs(marker)
    assert (r.starts, r.ends, r.overlaps) == (2, 1, 0)
    with write_scope(stack.settings) as session:
        gpu = session.scalar(select(Gpu).where(Gpu.index == index))
        assert gpu.drain_reason.startswith("GPU lost")
    status = run_cli(["status"], stack.settings)
    # The GPU's line says drained; a line under the table says why, as `sinfo -R` does.
    assert f"drained: {stack.settings.node} GPU {index}: GPU lost" in status.stdout, status.stdout
    # Fixed and resumed by an admin: the GPU serves again.
    (faults / f"{stack.settings.node}.{index}.lost").unlink()
    assert run_cli(["resume", stack.settings.node], stack.settings).returncode == 0
    with write_scope(stack.settings) as session:
        assert session.scalar(select(Gpu.drain_reason).where(Gpu.index == index)) is None
    # And it runs jobs again: a job of both GPUs (so one on it) that lives past the watch's first
    # looks. Its worker still took every job as on a lost GPU (gpu_lost, at once) until restarted.
    both = cli_submit(stack.settings, ["--gpus", "2", "--", "sleep", "2"], cwd=tmp_path)
    done = wait_state(stack.settings, both, c.END_STATES, 60)
    assert done.state == State.SUCCEEDED, (done.state, done.reason)


def test_an_unhealthy_gpu_is_drained_while_its_job_runs_on_and_a_resume_before_its_reset_drains_it_again(
        stack, tmp_path):
    argv, marker = marker_job(tmp_path, "unhealthy", 3)
    job_id = submit(stack.settings, argv, tmp_path)
    wait_runs(marker, 1)
    _, index, _ = worker_of(stack, job_id)
    faults = stack.settings.home / "simulated-faults"
    faults.mkdir(parents=True, exist_ok=True)
    mark = faults / f"{stack.settings.node}.{index}.unhealthy"
    # What NVML's counters give (service/devices.py, NvmlDevices.health) for a pending row remap.
    mark.write_text("row remapping pending (1 rows for uncorrectable errors): reset the GPU (nvidia-smi -r)\n")
    why = "GPU unhealthy: row remapping pending (1 rows for uncorrectable errors): reset the GPU (nvidia-smi -r)"

    def reason() -> str | None:
        with write_scope(stack.settings) as session:
            return session.scalar(select(Gpu.drain_reason).where(Gpu.index == index))

    try:
        wait_for(lambda: reason() == why, 10, f"GPU {index} drained as unhealthy")
        j = wait_state(stack.settings, job_id, c.END_STATES, 30)
        # Its job is not stopped (unlike a lost GPU's): it ends as it would have, once.
        assert (j.state, j.attempts, runs(marker).starts) == (State.SUCCEEDED, [], 1)
        status = run_cli(["status"], stack.settings)
        assert f"drained: {stack.settings.node} GPU {index}: {why}" in status.stdout, status.stdout
        other = submit(stack.settings, ["true"], tmp_path)
        assert not wait_state(stack.settings, other, State.SUCCEEDED, 30).worker.startswith(f"gpu{index}@")
        # Resumed before anyone reset it: drained again at its worker's next look.
        assert run_cli(["resume", stack.settings.node], stack.settings).returncode == 0
        wait_for(lambda: reason() == why, 10, f"GPU {index} drained again")
        mark.unlink()  # reset
        assert run_cli(["resume", stack.settings.node], stack.settings).returncode == 0
        time.sleep(1.5)  # three beats: nothing drains it now
        assert reason() is None
        both = cli_submit(stack.settings, ["--gpus", "2", "--", "true"], cwd=tmp_path)
        assert wait_state(stack.settings, both, c.END_STATES, 30).state == State.SUCCEEDED
    finally:
        mark.unlink(missing_ok=True)
        run_cli(["resume", stack.settings.node], stack.settings)


def test_a_job_that_dies_as_its_gpu_goes_unhealthy_fails_as_a_gpu_error_is_requeued_and_its_gpu_drained(
        stack, tmp_path):
    # The job marks its own GPU unhealthy (as an uncorrectable ECC error would leave NVML's counters)
    # and dies at once, before a heartbeat can look: its end's own reading finds the fault.
    faults = stack.settings.home / "simulated-faults"
    faults.mkdir(parents=True, exist_ok=True)
    rows = "row remapping pending (1 rows for uncorrectable errors): reset the GPU (nvidia-smi -r)"
    script = (f'if [ ! -e {tmp_path}/first ]; then touch {tmp_path}/first; '
              f'echo "{rows}" > {faults}/$GPUQ_NODE.$CUDA_VISIBLE_DEVICES.unhealthy; '
              'echo "RuntimeError: CUDA error: an illegal instruction"; exit 1; fi; '
              'echo "again on $CUDA_VISIBLE_DEVICES"')
    job_id = submit(stack.settings, ["sh", "-c", script], tmp_path, max_retries=1)
    try:
        j = wait_state(stack.settings, job_id, c.END_STATES, 60)
        assert j.state == State.SUCCEEDED, (j.state, j.reason)
        first = j.attempts[0]
        # The GPU's failure, not the job's: requeued without using its one retry.
        assert (first["failure"], first["requeue"], first["exit_code"]) == (c.FAILURE_GPU_ERROR, True, 1)
        index = int(first["worker"].split("@")[0][3:])
        assert first["reason"] == (f"GPU error: gpu {index} on {stack.settings.node} went unhealthy while it ran "
                                   f"({rows}); the job's own end: exited with status 1")
        assert not j.worker.startswith(f"gpu{index}@")
        out = output_of(stack.settings, job_id)
        assert (f"[gpuq: gpu {index} on {stack.settings.node} went unhealthy while it ran ({rows}): this failure is "
                "the GPU's (gpu_error), and the GPU is drained]") in out, out
        assert f"again on {1 - index}" in out
        with write_scope(stack.settings) as session:
            assert session.scalar(select(Gpu.drain_reason).where(Gpu.index == index)) == f"GPU unhealthy: {rows}"
    finally:
        for mark in faults.glob("*.unhealthy"):
            mark.unlink()
        run_cli(["resume", stack.settings.node], stack.settings)


def test_a_job_given_a_gpu_resumed_a_moment_ago_waits_for_its_workers_next_look_and_runs(
        tmp_path, database_url, redis_url):
    # Heartbeats 3 s apart: the worker clears its lost flag only when a beat sees the GPU read again
    # and its drain gone, and a job dispatched in between (the scheduler places at once on a
    # resume) failed as gpu_lost; CI met that window once with 0.5 s beats.
    st = make_stack(tmp_path, database_url, redis_url, heartbeat_interval=3.0, lease_timeout=8.0,
                    worker_timeout=8.0)
    try:
        faults = st.settings.home / "simulated-faults"
        faults.mkdir(parents=True, exist_ok=True)
        (faults / f"{st.settings.node}.0.lost").touch()

        def drained() -> str | None:
            with write_scope(st.settings) as session:
                return session.scalar(select(Gpu.drain_reason).where(Gpu.index == 0))

        wait_for(lambda: (drained() or "").startswith("GPU lost"), 20, "GPU 0 drained as lost")
        time.sleep(3.5)  # a beat after the drain: the worker holds the lost flag
        (faults / f"{st.settings.node}.0.lost").unlink()
        assert run_cli(["resume", st.settings.node], st.settings).returncode == 0
        both = cli_submit(st.settings, ["--gpus", "2", "--", "sleep", "1"], cwd=tmp_path)
        done = wait_state(st.settings, both, c.END_STATES, 60)
        assert done.state == State.SUCCEEDED, (done.state, done.reason)
    finally:
        st.stop()


def test_a_retried_job_keeps_the_output_of_every_attempt(stack, tmp_path):
    counter = tmp_path / "attempt"
    code = ("import pathlib, sys; p = pathlib.Path(sys.argv[1]); n = int(p.read_text()) + 1 if p.exists() else 1; "
            "p.write_text(str(n)); print(f'attempt {n} says hello'); sys.exit(0 if n == 2 else 3)")
    job_id = submit(stack.settings, [sys.executable, "-c", code, str(counter)], tmp_path, max_retries=1)
    j = wait_state(stack.settings, job_id, State.SUCCEEDED, 60)
    assert j.attempts[0]["failure"] == c.FAILURE_EXIT and not j.attempts[0]["requeue"]
    with write_scope(stack.settings) as session:
        text = "".join(data for _, data, _ in job_output.read_output(session, job_id))
    assert text.index("attempt 1 says hello") < text.index("attempt 2 says hello")
