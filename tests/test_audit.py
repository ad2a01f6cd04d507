"""The server's audit trail and a job's environment values, for real: a running stack's `gpuq
server` writes one line to its log for each request that changed jobs (who, as whom, which jobs
of whose), and `gpuq show` gives a job's environment to its owner, root and the admins only.
(A refused move on another user's job, and another user's view of a job's environment, need two
OS users: tests/test_multiuser.py.)"""

from __future__ import annotations

import json
import os
import pwd
import re
import time
import uuid
from pathlib import Path

import pytest

from gpuq.server.jobs_api import _show
from gpuq.service import constants as c
from gpuq.service import display, spec, submitting
from gpuq.service.constants import State
from gpuq.service.rights import Caller
from tests.conftest import cli_submit, run_cli, stack_on_database, wait_for_state

IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module", params=["sqlite"])
def stack(request, tmp_path_factory, redis_url):
    """One stack for the module: the trail is the server's, whatever its database."""
    yield from stack_on_database(request, tmp_path_factory, redis_url)


def audit_lines(log: Path, level: str = "INFO") -> list[str]:
    """The ``gpuq.audit`` lines of the server's log at ``level``, each from its message on."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return re.findall(rf"^\S+ \S+ {level} gpuq\.audit: (.*)$", text, re.M)


def logged(log: Path, line: str, level: str = "INFO", timeout: float = 5.0) -> list[str]:
    """The audit lines once ``line`` is among them (it is written before the answer is sent: the
    wait is for the file only)."""
    deadline = time.monotonic() + timeout
    while line not in (lines := audit_lines(log, level)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert line in lines, f"no {level} {line!r} in the server's audit lines:\n" + "\n".join(lines)
    return lines


def ok(done) -> str:
    assert done.returncode == 0, f"exit {done.returncode}: {done.stdout}{done.stderr}"
    return done.stdout


def test_each_move_on_a_job_is_one_line_naming_the_caller_their_uid_and_the_job(stack, tmp_path):
    s, log = stack.settings, stack.log_dir / "server.log"
    me = f"{pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()})"
    first = cli_submit(s, ["--hold", "--", "sleep", "30"], cwd=tmp_path)
    logged(log, f"submit by {me}: job {first}")
    after = cli_submit(s, ["--after", str(first), "--", "true"], cwd=tmp_path)  # pending while first is
    ok(run_cli(["update", str(first), "--priority", "3", "--name", "renamed"], s))
    logged(log, f"update by {me}: job {first} (priority=3, name='renamed')")
    ok(run_cli(["hold", str(after)], s))
    logged(log, f"hold by {me}: job {after}")
    assert run_cli(["hold", str(after)], s).returncode == c.EXIT_CONFLICT  # already held: nothing changed
    ok(run_cli(["release", str(first)], s))
    logged(log, f"release by {me}: job {first}")
    ok(run_cli(["cancel", str(first), str(after)], s))  # one request for both
    logged(log, f"cancel by {me}: jobs {display.ranges([first, after])}")
    wait_for_state(s, first, c.END_STATES)
    again = json.loads(ok(run_cli(["resubmit", "--json", str(first)], s, cwd=tmp_path)))["id"]
    logged(log, f"resubmit by {me}: job {first} (as job {again})")
    ok(run_cli(["cancel", str(again)], s))
    lines = logged(log, f"cancel by {me}: job {again}")
    # One line for each request that changed something, none for the one that changed nothing.
    assert sum(line.startswith("hold ") for line in lines) == 1
    assert not any("as admin" in line or " of " in line for line in lines), lines  # all the caller's own


def test_a_submit_asked_again_with_its_key_is_logged_once(stack, tmp_path):
    """A client that lost its answer asks again with the same key: the same job, and one line (the
    second request wrote nothing)."""
    from gpuq.cli.client import Client

    s, log = stack.settings, stack.log_dir / "server.log"
    key = uuid.uuid4().hex
    body = {"command": ["true"], "hold": True, "cwd": str(tmp_path), "key": key}
    client = Client(str(s.server_socket))
    first = client.post("/jobs", body)["jobs"][0]["id"]
    again = client.post("/jobs", body)["jobs"][0]["id"]
    assert again == first
    me = f"{pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()})"
    ok(run_cli(["cancel", str(first)], s))  # a line after the second submit's: the file has both by then
    lines = logged(log, f"cancel by {me}: job {first}")
    assert lines.count(f"submit by {me}: job {first}") == 1, lines


def test_a_submit_past_the_pending_cap_is_a_warning_line(settings, tmp_path, caplog):
    # Refusals for want of rights were logged; one past GPUQ_MAX_PENDING_PER_USER (a flood) was not.
    from gpuq.cli.client import Client, Refused
    from tests.conftest import serving

    with serving(settings, max_pending_per_user=1) as capped:
        client = Client(str(capped.server_socket))
        body = {"command": ["true"], "hold": True, "cwd": str(tmp_path)}
        client.post("/jobs", body | {"key": uuid.uuid4().hex})
        with caplog.at_level("INFO", logger="gpuq.audit"), pytest.raises(Refused) as refused:
            client.post("/jobs", body | {"key": uuid.uuid4().hex})
    assert refused.value.exit_code == c.EXIT_OVER_LIMIT
    me = f"{pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()})"
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "gpuq.audit"]
    assert len(lines) == 1 and lines[0][0] == "WARNING", lines
    assert lines[0][1].startswith(f"refused submit by {me}: no job (") and "the limit is 1" in lines[0][1], lines


@pytest.mark.skipif(not IS_ROOT, reason="only root may submit as another user")
def test_roots_moves_on_another_users_job_name_its_owner_and_say_as_admin(stack, shared_dir):
    s, log = stack.settings, stack.log_dir / "server.log"
    job_id = cli_submit(s, ["--user", "nobody", "--hold", "--", "true"], cwd=shared_dir)
    logged(log, f"submit by root (uid 0) on behalf of nobody via --user: job {job_id} of nobody")
    own = cli_submit(s, ["--hold", "--", "true"], cwd=shared_dir)
    ok(run_cli(["cancel", str(job_id), str(own)], s))
    logged(log, f"cancel by root (uid 0) as admin: job {own}; job {job_id} of nobody")
    assert wait_for_state(s, job_id, c.END_STATES) == State.CANCELLED


def test_the_owner_sees_the_values_they_passed_with_env(stack, tmp_path):
    value = f"v {uuid.uuid4().hex} $(x)"
    job_id = cli_submit(stack.settings, ["--hold", "--env", f"MY_TOKEN={value}", "--", "true"], cwd=tmp_path)
    shown = json.loads(ok(run_cli(["show", "--json", str(job_id)], stack.settings)))
    assert shown["env"]["MY_TOKEN"] == value
    plain = ok(run_cli(["show", str(job_id)], stack.settings))
    env_line = next(line for line in plain.splitlines() if line.strip().startswith("env "))
    assert "MY_TOKEN" in env_line and env_line.endswith("(values: gpuq show --json)"), plain
    assert value not in plain, plain  # names, not values
    assert shown["env"][c.UMASK_VARIABLE]  # the client sends its umask, and the job has it ...
    assert c.UMASK_VARIABLE not in env_line, env_line  # ... but it is gpuq's, not a name the user gave
    ok(run_cli(["cancel", str(job_id)], stack.settings))


def test_env_all_passes_the_submitters_own_variables_and_never_gpuqs(stack, tmp_path):
    token = f"t{uuid.uuid4().hex}"
    job_id = cli_submit(stack.settings, ["--hold", "--env", "ALL", "--", "true"], cwd=tmp_path,
                        extra_env={"WANDB_API_KEY": token, "LD_PRELOAD": "/nonexistent/x.so"})
    env = json.loads(ok(run_cli(["show", "--json", str(job_id)], stack.settings)))["env"]
    assert env["WANDB_API_KEY"] == token and "LD_PRELOAD" not in env
    assert not [name for name in env if name.startswith("GPUQ_") and name != c.UMASK_VARIABLE], env
    ok(run_cli(["cancel", str(job_id)], stack.settings))


def test_a_jobs_env_is_its_owners_roots_and_the_admins_and_no_one_elses(settings, tmp_path):
    made = submitting.submit_all(settings, [spec.command_spec(["true"], user="alice", cwd=str(tmp_path),
                                                              env={"MY_TOKEN": "s3cret"})], record_code=False)
    job_id = made[0].id
    alice, mallory, carol = Caller(50001, "alice"), Caller(50002, "mallory"), Caller(50003, "carol")
    admins, shared = settings.with_overrides(admins="carol"), settings.with_overrides(shared_logs=True)
    for who, config in ((alice, settings), (Caller(0, "root"), settings), (carol, admins)):
        assert _show(config, who, job_id)["env"] == {"MY_TOKEN": "s3cret"}, who
    for who, config in ((mallory, settings), (carol, settings), (mallory, shared), (None, settings)):
        shown = _show(config, who, job_id)
        assert shown["env"] is None and "s3cret" not in json.dumps(shown), who
    # GPUQ_SHARED_LOGS opens output, and only output.
    assert _show(shared, mallory, job_id)["output_readable"] is True
