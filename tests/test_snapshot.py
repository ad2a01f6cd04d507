"""The code as it was at submit: git commit, dirtiness and diff recorded; --snapshot runs a copy of
the work tree; `gpuq resubmit` runs the same job again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from gpuq.service import constants as c
from gpuq.service import jobs, spec, submitting
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec, NotAllowed
from gpuq.service.models import Job, utcnow
from gpuq.service.resubmit import resubmit
from gpuq.service.scheduler import Scheduler
from gpuq.service.snapshot_retention import INCOMING_MAX_AGE_S, prune
from tests.conftest import ThreadServer, run_cli, serving, settings_env
from tests.test_end_to_end import output_of, wait_for_state

pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(shutil.which("git") is None, reason="needs git")]

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.org", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout.strip()


def make_repo(root: Path) -> Path:
    """A work tree: sub/code.txt committed, secret.log and build/ ignored."""
    repo = root / "repo"
    (repo / "sub").mkdir(parents=True)
    (repo / "sub" / "code.txt").write_text("version 1\n")
    (repo / ".gitignore").write_text("*.log\nbuild/\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    (repo / "secret.log").write_text("ignored\n")
    (repo / "build").mkdir()
    (repo / "build" / "big.bin").write_bytes(b"x" * 1000)
    return repo


def job_count(settings) -> int:
    with write_scope(settings) as session:
        return session.scalar(select(func.count()).select_from(Job))


def snapshot_entries(settings) -> list[str]:
    return sorted(os.listdir(settings.snapshots)) if settings.snapshots.exists() else []


def get(settings, job_id: int) -> Job:
    with write_scope(settings) as session:
        job = jobs.get_job(session, job_id)
        session.expunge(job)
        return job


def test_a_command_in_a_git_tree_records_commit_dirtiness_and_diff(settings, tmp_path):
    repo = make_repo(tmp_path)
    clean = submitting.submit(settings, spec.command_spec(["true"], cwd=str(repo / "sub")))
    assert (clean.git_commit, clean.git_dirty, clean.git_diff) == (git(repo, "rev-parse", "HEAD"), False, None)
    (repo / "sub" / "code.txt").write_text("version 2\n")
    git(repo, "add", "sub/code.txt")
    (repo / "sub" / "code.txt").write_text("version 3\n")  # staged and unstaged: the diff is against HEAD
    dirty = submitting.submit(settings, spec.command_spec(["true"], cwd=str(repo)))
    assert dirty.git_dirty is True and dirty.git_diff_cut is False
    assert "-version 1" in dirty.git_diff and "+version 3" in dirty.git_diff
    git(repo, "checkout", "-q", "HEAD", "--", ".")
    (repo / "new.py").write_text("print(1)\n")  # untracked and not ignored: dirty, though no diff
    untracked = submitting.submit(settings, spec.command_spec(["true"], cwd=str(repo)))
    assert untracked.git_dirty is True and untracked.git_diff is None
    workload = submitting.submit(settings, spec.workload_spec("matmul", [], cwd=str(repo)))
    assert workload.git_commit is None and workload.git_dirty is None
    outside = tmp_path / "plain"
    outside.mkdir()
    plain = submitting.submit(settings, spec.command_spec(["true"], cwd=str(outside)))
    assert (plain.git_commit, plain.git_dirty, plain.git_diff, plain.snapshot) == (None, None, None, None)


def test_a_diff_over_the_limit_is_cut_and_says_so(settings, tmp_path):
    repo = make_repo(tmp_path)
    (repo / "sub" / "code.txt").write_text("changed line\n" * 500)
    small = settings.with_overrides(git_diff_max_bytes=1000)
    job = submitting.submit(small, spec.command_spec(["true"], cwd=str(repo)))
    assert job.git_diff_cut is True
    assert job.git_diff.endswith("[gpuq: diff cut at 1000 bytes]\n") and len(job.git_diff) < 1100


@pytest.fixture
def served(settings):
    """A server on the settings' socket, for the `gpuq` commands these tests run."""
    server = ThreadServer(settings)
    yield settings
    server.stop()


def test_snapshot_outside_a_work_tree_is_refused_in_one_line_and_writes_nothing(served, tmp_path):
    settings = served
    outside = tmp_path / "plain"
    outside.mkdir()
    out = run_cli(["submit", "--snapshot", "--", "true"], settings, cwd=outside)
    assert out.returncode == c.EXIT_USAGE
    assert out.stderr.count("\n") == 1 and "--snapshot needs a git work tree" in out.stderr
    assert job_count(settings) == 0 and snapshot_entries(settings) == []


def test_snapshot_copies_run_two_of_a_user_at_a_time_in_a_pool_of_their_own_and_status_answers_meanwhile(
        settings, tmp_path, monkeypatch):
    # A copy may take minutes. In the default pool (six threads here) six of them held every
    # thread, and every other request, `gpuq status` too, waited for them. Here each copy's git
    # listing waits at a gate the test opens.
    gate, seen, tools = tmp_path / "gate", tmp_path / "seen", tmp_path / "bin"
    seen.mkdir()
    tools.mkdir()
    (tools / "git").write_text(f"""#!/bin/sh
case " $* " in *" ls-files "*) touch "{seen}/$$"; while [ ! -e "{gate}" ]; do sleep 0.05; done;; esac
exec {shutil.which("git")} "$@"
""")
    (tools / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")  # the server's (a thread here) and the clients'
    repo = make_repo(tmp_path)
    server = ThreadServer(settings)
    submits: list[subprocess.Popen] = []
    try:
        env = settings_env(settings)
        submits = [subprocess.Popen([sys.executable, "-m", "gpuq.cli", "submit", "--snapshot", "--", "true"], cwd=repo,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for _ in range(8)]
        deadline = time.monotonic() + 30
        while len(os.listdir(seen)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # time for a third to start, were it let
        assert len(os.listdir(seen)) == 2, os.listdir(seen)
        status = run_cli(["status"], settings, timeout=20)
        assert status.returncode == 0, status.stderr
        assert all(p.poll() is None for p in submits)  # all eight still wait: the two copies, and six for a turn
    finally:
        gate.touch()
        outs = [p.communicate(timeout=60) for p in submits]
        server.stop()
    assert [p.returncode for p in submits] == [0] * 8, outs
    assert len(os.listdir(seen)) == 8 and job_count(settings) == 8


def test_snapshot_over_the_size_limit_is_refused_and_leaves_no_directory(settings, tmp_path):
    repo = make_repo(tmp_path)
    (repo / "data.bin").write_bytes(b"y" * 5000)  # untracked, not ignored: it counts
    with serving(settings, snapshot_max_bytes=4096) as limited:  # the server's limit, not the client's
        out = run_cli(["submit", "--snapshot", "--", "true"], limited, cwd=repo)
    assert out.returncode == c.EXIT_USAGE and out.stderr.count("\n") == 1, out.stderr
    assert "GPUQ_SNAPSHOT_MAX_BYTES" in out.stderr
    assert job_count(settings) == 0 and snapshot_entries(settings) == []


def with_submodule(tmp_path: Path) -> Path:
    """make_repo's work tree with a submodule lib/ (lib/model.py committed in it; lib/*.ckpt
    ignored by its own .gitignore), then edited: model.py changed and notes.txt added in lib/."""
    lib = tmp_path / "libsrc"
    lib.mkdir()
    (lib / "model.py").write_text("LAYERS = 1\n")
    (lib / ".gitignore").write_text("*.ckpt\n")
    git(lib, "init", "-q")
    git(lib, "add", ".")
    git(lib, "commit", "-q", "-m", "lib")
    repo = make_repo(tmp_path)
    git(repo, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "lib")
    git(repo, "commit", "-q", "-m", "with lib")
    (repo / "lib" / "model.py").write_text("LAYERS = 2\n")
    (repo / "lib" / "notes.txt").write_text("untracked in the submodule\n")
    (repo / "lib" / "weights.ckpt").write_text("ignored by the submodule\n")
    return repo


def test_a_snapshot_copies_a_submodules_files_as_they_are_and_the_diff_shows_its_changes(served, tmp_path):
    repo = with_submodule(tmp_path)
    nested = repo / "vendored"  # a repository of its own in the tree, untracked and not ignored
    nested.mkdir()
    (nested / "tool.py").write_text("print('v')\n")
    git(nested, "init", "-q")
    out = run_cli(["submit", "--snapshot", "--hold", "--json", "--", "true"], served, cwd=repo / "sub")
    assert out.returncode == 0, out.stderr
    job = get(served, json.loads(out.stdout)["id"])
    copy = Path(job.snapshot)
    files = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file())
    assert files == [".gitignore", ".gitmodules", "lib/.gitignore", "lib/model.py", "lib/notes.txt",
                     "sub/code.txt", "vendored/tool.py"]  # no .git files, nothing either .gitignore excludes
    assert (copy / "lib" / "model.py").read_text() == "LAYERS = 2\n"
    assert "-LAYERS = 1" in job.git_diff and "+LAYERS = 2" in job.git_diff and job.git_dirty is True


def test_a_submit_from_inside_a_submodule_copies_and_records_its_whole_project(served, tmp_path):
    # The job runs in lib/ of the project's copy: code there may import from the project around it.
    repo = with_submodule(tmp_path)
    (repo / "lib" / "deep").mkdir()
    out = run_cli(["submit", "--snapshot", "--hold", "--json", "--", "true"], served, cwd=repo / "lib" / "deep")
    assert out.returncode == 0, out.stderr
    job = get(served, json.loads(out.stdout)["id"])
    copy = Path(job.snapshot)
    files = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file())
    assert files == [".gitignore", ".gitmodules", "lib/.gitignore", "lib/model.py", "lib/notes.txt", "sub/code.txt"]
    assert job.cwd == str(copy / "lib" / "deep") and (copy / "lib" / "deep").is_dir()
    assert job.git_commit == git(repo, "rev-parse", "HEAD") != git(repo / "lib", "rev-parse", "HEAD")
    assert "+LAYERS = 2" in job.git_diff and job.git_dirty is True


def test_a_submodule_not_checked_out_is_an_empty_directory_in_the_snapshot(served, tmp_path):
    repo = with_submodule(tmp_path)
    git(repo, "submodule", "deinit", "-q", "-f", "lib")
    assert os.listdir(repo / "lib") == []
    out = run_cli(["submit", "--snapshot", "--hold", "--json", "--", "true"], served, cwd=repo)
    assert out.returncode == 0, out.stderr
    copy = Path(get(served, json.loads(out.stdout)["id"]).snapshot)
    assert sorted(os.listdir(copy)) == [".gitignore", ".gitmodules", "lib", "sub"] and os.listdir(copy / "lib") == []


def test_a_submodule_counts_toward_the_snapshot_size_limit(settings, tmp_path):
    repo = with_submodule(tmp_path)
    (repo / "lib" / "data.bin").write_bytes(b"y" * 5000)  # untracked in the submodule, not ignored
    with serving(settings, snapshot_max_bytes=4096) as limited:
        out = run_cli(["submit", "--snapshot", "--", "true"], limited, cwd=repo)
    assert out.returncode == c.EXIT_USAGE and "GPUQ_SNAPSHOT_MAX_BYTES" in out.stderr, out.stderr
    assert job_count(settings) == 0 and snapshot_entries(settings) == []


def test_a_failed_insert_removes_the_copied_snapshot(settings, tmp_path):
    repo = make_repo(tmp_path)
    good = spec.command_spec(["true"], cwd=str(repo))
    broken = spec.JobSpec(**{**good.__dict__, "gpus": 0})  # the database's check refuses it at insert
    with pytest.raises(IntegrityError):
        submitting.submit_all(settings, [broken], snapshot=True)
    assert job_count(settings) == 0 and snapshot_entries(settings) == []


def test_a_snapshot_directory_an_earlier_queue_left_under_the_new_jobs_id_is_moved_aside(served, tmp_path):
    # A fresh database over the same snapshot directory numbers its jobs from 1 again: the rename
    # onto the old job 1's copy failed every snapshot submit of that id ("the server failed").
    repo = make_repo(tmp_path)
    left = served.snapshots / "1"
    (left / "x").mkdir(parents=True)
    out = run_cli(["submit", "--hold", "--snapshot", "--json", "--", "true"], served, cwd=repo)
    assert out.returncode == 0, out.stderr
    assert Path(json.loads(out.stdout)["snapshot"]) == left and (left / "sub" / "code.txt").exists()
    aside = [e for e in snapshot_entries(served) if e.startswith("1.earlier-")]
    assert len(aside) == 1 and (served.snapshots / aside[0] / "x").is_dir()


def test_a_snapshot_job_runs_the_code_as_it_was_without_ignored_files(stack, tmp_path):
    s = stack.settings
    repo = make_repo(tmp_path)
    (repo / "notes.md").write_text("untracked, not ignored\n")
    program = ("import os; print(open('code.txt').read().strip()); "
               "print(sorted(os.listdir('..'))); print(os.getcwd())")
    out = run_cli(["submit", "--snapshot", "--json", "--", sys.executable, "-c", program], s, cwd=repo / "sub")
    assert out.returncode == 0, out.stderr
    job_id = json.loads(out.stdout)["id"]
    (repo / "sub" / "code.txt").write_text("version 2, edited after submit\n")
    assert wait_for_state(s, job_id, c.END_STATES) == State.SUCCEEDED, stack.logs()
    content, listing, cwd = output_of(s, job_id).strip().splitlines()
    job = get(s, job_id)
    assert content == "version 1"
    assert listing == str(sorted([".gitignore", "notes.md", "sub"]))  # no secret.log, no build/, no .git
    assert job.snapshot == str(s.snapshots / str(job_id)) and cwd == os.path.join(job.snapshot, "sub")
    assert job.git_commit == git(repo, "rev-parse", "HEAD") and job.git_dirty is True
    shown = run_cli(["show", str(job_id)], s)
    assert f"commit  {job.git_commit} (dirty" in shown.stdout and f"snapshot  {job.snapshot}" in shown.stdout
    assert run_cli(["show", "--diff", str(job_id)], s).stdout == ""  # untracked files only: no diff
    assert [e for e in snapshot_entries(s) if e.startswith(".incoming")] == []


def test_resubmit_runs_the_same_snapshot_as_a_new_job_and_show_diff_prints_the_diff(stack, tmp_path):
    s = stack.settings
    repo = make_repo(tmp_path)
    (repo / "sub" / "code.txt").write_text("version 2, uncommitted\n")
    out = run_cli(["submit", "--snapshot", "--json", "--name", "again", "--retries", "1", "--",
                   "cat", "code.txt"], s, cwd=repo / "sub")
    assert out.returncode == 0, out.stderr
    first = json.loads(out.stdout)["id"]
    assert wait_for_state(s, first, c.END_STATES) == State.SUCCEEDED, stack.logs()
    diff = run_cli(["show", "--diff", str(first)], s).stdout
    assert "-version 1" in diff and "+version 2, uncommitted" in diff
    (repo / "sub" / "code.txt").write_text("version 3\n")
    again = run_cli(["resubmit", str(first)], s)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("submitted job ") and again.stdout.strip().endswith(f"(resubmit of {first})")
    second = int(again.stdout.split()[2])
    assert wait_for_state(s, second, c.END_STATES) == State.SUCCEEDED, stack.logs()
    assert output_of(s, second) == output_of(s, first) == "version 2, uncommitted\n"
    a, b = get(s, first), get(s, second)
    for field in ("name", "argv", "cwd", "snapshot", "max_retries", "git_commit", "git_dirty", "git_diff"):
        assert getattr(a, field) == getattr(b, field), field


def test_resubmit_of_an_array_task_makes_one_job_with_that_tasks_index(settings, tmp_path):
    make = lambda extra: spec.command_spec(["echo", "{index}"], cwd=str(tmp_path))  # noqa: E731
    tasks = submitting.submit_all(settings, spec.expand(make, spec.Scheduling(priority=3), "0-2", []))
    job = resubmit(settings, tasks[2].id, user=tasks[2].user)
    assert job.id == tasks[-1].id + 1 and job.array_id is None
    assert (job.argv, job.env["GPUQ_ARRAY_INDEX"], job.priority) == (["echo", "2"], "2", 3)
    assert job_count(settings) == 4


def test_resubmit_of_another_users_job_is_refused_and_of_a_missing_snapshot_too(settings, tmp_path):
    repo = make_repo(tmp_path)
    mine = submitting.submit(settings, spec.command_spec(["true"], cwd=str(repo), user="ann"))
    with pytest.raises(NotAllowed):
        resubmit(settings, mine.id, user="bob")
    snap = submitting.submit_all(settings, [spec.command_spec(["true"], cwd=str(repo), user="ann")], snapshot=True)[0]
    shutil.rmtree(snap.snapshot)
    with pytest.raises(InvalidSpec, match="snapshot .* is gone"):
        resubmit(settings, snap.id, user="ann")
    assert job_count(settings) == 2


def test_the_tasks_of_an_array_share_one_snapshot_named_after_the_first(settings, tmp_path):
    repo = make_repo(tmp_path)
    make = lambda extra: spec.command_spec(["cat", "code.txt"], cwd=str(repo / "sub"))  # noqa: E731
    tasks = submitting.submit_all(settings, spec.expand(make, spec.Scheduling(), "0-2", []), snapshot=True)
    first = tasks[0]
    assert first.snapshot == str(settings.snapshots / str(first.id))
    assert {(t.snapshot, t.cwd) for t in tasks} == {(first.snapshot, os.path.join(first.snapshot, "sub"))}
    assert snapshot_entries(settings) == [str(first.id)]
    assert (Path(first.cwd) / "code.txt").read_text() == "version 1\n"


# --- retention ---------------------------------------------------------------------------------

def ended(settings, job_ids: list[int], ago: timedelta) -> None:
    """Mark the jobs succeeded, ended ``ago``."""
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id.in_(job_ids)).values(state=State.SUCCEEDED,
                                                                      ended_at=utcnow() - ago))


def test_a_snapshot_goes_once_every_job_that_runs_from_it_ended_longer_ago_than_the_retention(settings, tmp_path):
    settings = settings.with_overrides(snapshot_retention_days=1.0)
    repo = make_repo(tmp_path)
    old, recent = (submitting.submit_all(settings, [spec.command_spec(["true"], cwd=str(repo))], snapshot=True)[0]
                   for _ in range(2))
    again = resubmit(settings, old.id)  # runs from old's copy: it keeps it while it may still run
    ended(settings, [old.id], timedelta(days=2))
    ended(settings, [recent.id], timedelta(hours=2))
    assert prune(settings, utcnow()).removed == []
    assert snapshot_entries(settings) == sorted([str(old.id), str(recent.id)])

    ended(settings, [again.id], timedelta(days=1, minutes=1))
    done = prune(settings, utcnow())
    assert done.removed == [old.snapshot] and done.freed_bytes > 0
    assert snapshot_entries(settings) == [str(recent.id)]
    assert all(get(settings, j).snapshot_removed_at is not None for j in (old.id, again.id))
    assert get(settings, recent.id).snapshot_removed_at is None
    assert prune(settings, utcnow()).removed == []  # once
    with pytest.raises(InvalidSpec, match=r"snapshot was removed on .* past its retention"):
        resubmit(settings, old.id)


def test_show_says_a_snapshot_was_removed_past_its_retention(served, tmp_path):
    settings = served
    repo = make_repo(tmp_path)
    job = submitting.submit_all(settings, [spec.command_spec(["true"], cwd=str(repo))], snapshot=True)[0]
    ended(settings, [job.id], timedelta(days=3))
    prune(settings.with_overrides(snapshot_retention_days=2.0), utcnow())
    out = run_cli(["show", str(job.id)], settings)
    assert out.returncode == 0, out.stderr
    assert f"snapshot  {job.snapshot} (removed " in out.stdout and "past its retention)" in out.stdout
    refused = run_cli(["resubmit", str(job.id)], settings)
    assert refused.returncode == c.EXIT_USAGE and refused.stderr.count("\n") == 1
    assert "GPUQ_SNAPSHOT_RETENTION_DAYS" in refused.stderr
    assert job_count(settings) == 1


def test_without_a_retention_snapshots_stay_and_only_half_made_copies_older_than_a_day_go(settings, tmp_path):
    repo = make_repo(tmp_path)
    job = submitting.submit_all(settings, [spec.command_spec(["true"], cwd=str(repo))], snapshot=True)[0]
    ended(settings, [job.id], timedelta(days=400))
    stale, fresh = settings.snapshots / ".incoming-dead", settings.snapshots / ".incoming-live"
    for copy in (stale, fresh):
        (copy / "sub").mkdir(parents=True)
        (copy / "sub" / "code.txt").write_text("half\n")
    day_ago = time.time() - INCOMING_MAX_AGE_S - 60
    os.utime(stale, (day_ago, day_ago))
    done = prune(settings, utcnow())
    assert (done.removed, done.incoming) == ([], 1)
    assert snapshot_entries(settings) == [".incoming-live", str(job.id)]


def test_a_snapshot_path_outside_the_snapshot_directory_is_never_removed(settings, tmp_path):
    settings = settings.with_overrides(snapshot_retention_days=1.0)
    repo = make_repo(tmp_path)
    elsewhere = tmp_path / "elsewhere" / "7"
    elsewhere.mkdir(parents=True)
    link = settings.snapshots / "8"
    settings.snapshots.mkdir(parents=True)
    link.symlink_to(repo)  # a job directory replaced by a link: nothing behind it is followed
    ids = []
    for path in (str(elsewhere), str(link), str(repo)):
        job = submitting.submit(settings, spec.command_spec(["true"], cwd=str(repo)))
        with write_scope(settings) as session:
            session.execute(update(Job).where(Job.id == job.id).values(snapshot=path))
        ids.append(job.id)
    ended(settings, ids, timedelta(days=2))
    assert prune(settings, utcnow()).removed == []
    assert elsewhere.is_dir() and link.is_symlink() and (repo / "sub" / "code.txt").is_file()


def test_the_scheduler_removes_snapshots_past_their_retention_when_it_starts(settings, tmp_path):
    settings = settings.with_overrides(snapshot_retention_days=1.0)
    repo = make_repo(tmp_path)
    job = submitting.submit_all(settings, [spec.command_spec(["true"], cwd=str(repo))], snapshot=True)[0]
    ended(settings, [job.id], timedelta(days=2))
    stop = threading.Event()
    runner = threading.Thread(target=Scheduler(settings).run, args=(stop,), daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while os.path.exists(job.snapshot) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(job.snapshot)
        assert get(settings, job.id).snapshot_removed_at is not None
    finally:
        stop.set()
        runner.join(30)


def test_a_scheduler_that_does_not_see_the_snapshot_directory_marks_nothing_removed(settings, tmp_path):
    repo = make_repo(tmp_path)
    job = submitting.submit_all(settings, [spec.command_spec(["true"], cwd=str(repo))], snapshot=True)[0]
    ended(settings, [job.id], timedelta(days=2))
    elsewhere = settings.with_overrides(snapshot_retention_days=1.0, snapshot_dir=str(tmp_path / "not-mounted"))
    assert prune(elsewhere, utcnow()).removed == []
    assert get(settings, job.id).snapshot_removed_at is None and os.path.isdir(job.snapshot)
