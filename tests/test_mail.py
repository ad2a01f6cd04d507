"""Job mail (`gpuq submit --mail-type`, service/mail.py; SLURM's MailProg, task-spooler's -m): what
a job asks for, which events call for a message once each, an array mailed about as one job, and
on a real stack a mail program run by the scheduler with the message, as mailx takes it."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from gpuq.service import constants as c
from gpuq.service import mail, spec, submitting
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import Job, JobMail, utcnow
from gpuq.service.units import parse_mail_address, parse_mail_events
from tests.conftest import cli_submit, run_cli, stack_on_database, wait_for_state

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("text, events", [("END", "END"), ("end,fail", "END,FAIL"), ("FAIL, BEGIN", "BEGIN,FAIL"),
                                          ("ALL", "BEGIN,END,FAIL,REQUEUE"), ("all,end", "BEGIN,END,FAIL,REQUEUE"),
                                          ("requeue,fail", "FAIL,REQUEUE"), ("NONE", None)])
def test_mail_type_takes_slurms_events_in_any_case_and_order(text, events):
    assert parse_mail_events(text) == events


@pytest.mark.parametrize("text", ["", ",", "SOMETIMES", "END,TIME_LIMIT", "NONE,END"])
def test_a_mail_type_it_does_not_know_is_refused_in_one_line(text):
    with pytest.raises(InvalidSpec, match=r"^--mail-type takes BEGIN, END, FAIL, REQUEUE, ALL or NONE, "
                                          r"comma-separated; got "):
        parse_mail_events(text)


@pytest.mark.parametrize("text", ["-oProgram=x", "alice bob", "a@b@c", "alice@", "@lab", "x" * 255, "al\nice",
                                  "alice;rm"])
def test_a_mail_user_that_is_no_address_or_could_read_as_an_option_is_refused(text):
    with pytest.raises(InvalidSpec, match=r"^--mail-user takes a user name or an address \(name@host\); got "):
        parse_mail_address(text)


def test_mail_goes_to_the_address_given_else_the_owner_with_the_mail_domain():
    assert parse_mail_address(" alice.b+gpu@lab-1.example.org ") == "alice.b+gpu@lab-1.example.org"
    assert mail.address_of("alice", None, "") == "alice"
    assert mail.address_of("alice", None, "lab.example") == "alice@lab.example"
    assert mail.address_of("alice", "bob", "lab.example") == "bob@lab.example"
    assert mail.address_of("alice", "pi@uni.example", "lab.example") == "pi@uni.example"


def test_a_mail_user_without_a_mail_type_is_refused():
    with pytest.raises(InvalidSpec, match=r"^--mail-user needs --mail-type: what to mail about"):
        spec.Scheduling(mail_user="alice").fields()


# --- what is due, on both databases ---------------------------------------------------------------

@pytest.fixture
def mailer(settings):
    """The test's settings with a mail program that is there (the tests hand messages to a list)."""
    return settings.with_overrides(mail_prog="/bin/true")


def _submit(settings, events: str | None, tasks: int = 1, address: str | None = None, user: str = "ann") -> list[int]:
    made = spec.command_spec(["true"], user=user, name="train", cwd="/")
    specs = [replace(made, mail_events=events, mail_address=address,
                     **({"array_index": i, "name": f"train[{i}]"} if tasks > 1 else {})) for i in range(tasks)]
    return [j.id for j in submitting.submit_all(settings, specs)]


def _move(settings, job_id: int, **values) -> None:
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == job_id).values(**values))


def _sent(settings) -> list[mail.Message]:
    out: list[mail.Message] = []
    assert mail.send_due(settings, send=lambda _settings, m: out.append(m)) == len(out)
    return out


def test_a_job_is_mailed_about_once_as_it_begins_and_once_as_it_ends(mailer):
    s = mailer.with_overrides(mail_domain="lab.example")
    job, quiet = _submit(s, "BEGIN,END")[0], _submit(s, None)[0]
    assert _sent(s) == []  # waiting: nothing happened yet
    now = utcnow()
    for j in (job, quiet):
        _move(s, j, state=State.RUNNING, node="n1", started_at=now)
    begin = _sent(s)
    assert [(m.to, m.subject) for m in begin] == [("ann@lab.example", f"gpuq job {job} (train) began on n1")]
    assert "started    " in begin[0].body and f"`gpuq show {job}`" in begin[0].body
    assert _sent(s) == []  # once
    _move(s, job, state=State.FAILED, ended_at=now + timedelta(seconds=75), exit_code=3, reason="exited with 3",
          failure=c.FAILURE_EXIT)
    end = _sent(s)
    assert [m.subject for m in end] == [f"gpuq job {job} (train) failed, exit code 3, run time 1:15"]
    assert "state      failed: exited with 3" in end[0].body and "node       n1" in end[0].body
    assert _sent(s) == []
    with write_scope(s) as session:
        assert session.execute(select(JobMail.job_id, JobMail.events, JobMail.due)).all() == [(job, "BEGIN,END", None)]


@pytest.mark.parametrize("state, mailed", [(State.SUCCEEDED, False), (State.CANCELLED, False),
                                           (State.FAILED, True), (State.TIMED_OUT, True)])
def test_fail_mails_only_about_a_failure_or_a_time_limit(mailer, state, mailed):
    job = _submit(mailer, "FAIL", address="pi@uni.example")[0]
    _move(mailer, job, state=state, started_at=utcnow(), ended_at=utcnow())
    sent = _sent(mailer)
    assert [m.to for m in sent] == (["pi@uni.example"] if mailed else [])
    assert not mailed or sent[0].subject.startswith(f"gpuq job {job} (train) {state.replace('_', ' ')}")
    with write_scope(mailer) as session:
        assert session.scalar(select(JobMail.due).where(JobMail.job_id == job)) is None  # nothing more to watch


def test_a_job_that_began_and_ended_between_two_looks_gets_both_messages_in_their_order(mailer):
    job = _submit(mailer, "BEGIN,END")[0]
    _move(mailer, job, state=State.SUCCEEDED, node="n1", started_at=utcnow(), ended_at=utcnow(), exit_code=0)
    assert [m.subject.split(",")[0] for m in _sent(mailer)] == [f"gpuq job {job} (train) began on n1",
                                                                f"gpuq job {job} (train) succeeded"]


def test_requeue_mails_each_time_a_job_goes_back_to_the_queue_with_why(mailer):
    from gpuq.service.models import EarlierAttempt

    job = _submit(mailer, "REQUEUE,END")[0]
    now = utcnow()

    def back(reason: str) -> None:  # an attempt ends and the job waits again, as lifecycle.end_attempt writes it
        with write_scope(mailer) as session:
            attempts = session.get(Job, job).attempts or []
            session.execute(update(Job).where(Job.id == job).values(attempts=[*attempts, {
                "state": "preempted", "reason": reason, "ended_at": now.isoformat(), "worker": "gpu0@n1"}]))
            session.add(EarlierAttempt(job_id=job, user="ann", node="n1", charged=1.0, started_at=now, ended_at=now,
                                       cause="preempted"))

    back("preempted by job 7 of bob")
    assert [m.subject for m in _sent(mailer)] == [f"gpuq job {job} (train) requeued: preempted by job 7 of bob"]
    assert _sent(mailer) == []
    back("preempted by job 9 of cy")
    _move(mailer, job, state=State.SUCCEEDED, started_at=now, ended_at=now + timedelta(seconds=5), exit_code=0)
    assert [m.subject for m in _sent(mailer)] == [f"gpuq job {job} (train) requeued: preempted by job 9 of cy",
                                                  f"gpuq job {job} (train) succeeded, run time 5.0s"]


def test_a_job_cancelled_before_it_began_gets_its_end_mail_only(mailer):
    job = _submit(mailer, "BEGIN,END")[0]
    _move(mailer, job, state=State.CANCELLED, ended_at=utcnow(), reason="cancelled by ann")
    assert [m.subject for m in _sent(mailer)] == [f"gpuq job {job} (train) cancelled"]
    assert _sent(mailer) == []


def test_an_array_is_mailed_about_as_one_job_as_its_first_task_begins_and_its_last_ends(mailer):
    tasks = _submit(mailer, "BEGIN,END,FAIL", tasks=3)
    array = tasks[0]
    now = utcnow()
    _move(mailer, tasks[1], state=State.RUNNING, node="n2", started_at=now)
    assert [m.subject for m in _sent(mailer)] == [f"gpuq array {array} (train) began on n2"]
    _move(mailer, tasks[0], state=State.RUNNING, node="n1", started_at=now)
    _move(mailer, tasks[1], state=State.SUCCEEDED, ended_at=now)
    _move(mailer, tasks[0], state=State.FAILED, ended_at=now, exit_code=1)
    assert _sent(mailer) == []  # one task still waits
    _move(mailer, tasks[2], state=State.SUCCEEDED, started_at=now, ended_at=now)
    end = _sent(mailer)
    assert [m.subject for m in end] == [f"gpuq array {array} (train) ended: 3 tasks, 2 succeeded, 1 failed"]
    assert _sent(mailer) == []


def test_show_gives_the_mail_events_to_all_and_where_it_goes_to_those_who_may_read_the_jobs_environment(mailer):
    from gpuq.server.jobs_api import _show
    from gpuq.service.rights import Caller

    job, quiet = _submit(mailer, "END", address="ann.private@home.example")[0], _submit(mailer, None)[0]
    assert _show(mailer, Caller(0, "root"), job)["mail"] == {"events": "END", "to": "ann.private@home.example"}
    assert _show(mailer, Caller(12345, "bob"), job)["mail"] == {"events": "END", "to": None}
    assert _show(mailer, Caller(12345, "bob"), quiet)["mail"] is None


def test_a_resubmitted_job_asks_for_the_same_mail(mailer):
    from gpuq.service.resubmit import resubmit

    job = _submit(mailer, "BEGIN,FAIL", address="pi@uni.example", user=spec.current_user())[0]
    again = resubmit(mailer, job).id
    with write_scope(mailer) as session:
        assert mail.asked(session, again) == ("BEGIN,FAIL", "pi@uni.example") and again != job


# --- on a real stack ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mailbox(tmp_path_factory) -> Path:
    """A mail program as mailx is called: it files its arguments and its stdin in a folder."""
    box = tmp_path_factory.mktemp("mailbox")
    prog = box / "mail"
    prog.write_text(f"#!{sys.executable}\nimport sys, time\n"
                    f"open('{box}/%d.mail' % time.monotonic_ns(), 'w').write("
                    "'\\n'.join(sys.argv[1:]) + '\\n---\\n' + sys.stdin.read())\n")
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return box


@pytest.fixture(scope="module", params=["sqlite"])
def mailing(request, tmp_path_factory, redis_url, mailbox):
    yield from stack_on_database(request, tmp_path_factory, redis_url, mail_prog=str(mailbox / "mail"))


def _mails(box: Path, count: int, timeout: float = 30.0) -> list[list[str]]:
    deadline = time.monotonic() + timeout
    while True:
        found = sorted(box.glob("*.mail"))
        if len(found) >= count or time.monotonic() > deadline:
            return [p.read_text().splitlines() for p in found]
        time.sleep(0.1)


def test_the_scheduler_runs_the_mail_program_as_a_job_begins_and_fails(mailing, mailbox, tmp_path):
    s = mailing.settings
    job = cli_submit(s, ["--mail-type", "begin,fail", "--mail-user", "pi@uni.example", "-J", "napper", "--", "sh",
                         "-c", "sleep 0.5; exit 3"], cwd=tmp_path)
    assert wait_for_state(s, job, (State.FAILED,)) == State.FAILED
    got = _mails(mailbox, 2)
    assert [m[:3] for m in got] == [["-s", f"gpuq job {job} (napper) began on {s.node}", "pi@uni.example"],
                                    ["-s", got[1][1], "pi@uni.example"]], got
    assert got[1][1].startswith(f"gpuq job {job} (napper) failed, exit code 3, run time "), got
    assert "---" in got[1] and any(line.startswith("state      failed") for line in got[1]), got
    shown = run_cli(["show", str(job)], s).stdout
    assert "      mail  BEGIN,FAIL to pi@uni.example\n" in shown, shown


def test_bad_mail_options_are_refused_in_one_line_and_nothing_is_queued(mailing, tmp_path):
    s = mailing.settings
    before = json.loads(run_cli(["status", "--json"], s).stdout)["jobs"]
    for args, line in ((["--mail-type", "SOMETIMES"], "gpuq: --mail-type takes BEGIN, END, FAIL, REQUEUE, ALL "
                                                       "or NONE, comma-separated; got 'SOMETIMES'"),
                       (["--mail-user", "pi"], "gpuq: --mail-user needs --mail-type: what to mail about (BEGIN, END, "
                                               "FAIL, REQUEUE or ALL)"),
                       (["--mail-type", "END", "--mail-user", "-oQ/tmp/x"],
                        "gpuq: --mail-user takes a user name or an address (name@host); got '-oQ/tmp/x'")):
        out = run_cli(["submit", *args, "--", "true"], s, cwd=tmp_path)
        assert (out.returncode, out.stdout, out.stderr) == (2, "", line + "\n")
    assert json.loads(run_cli(["status", "--json"], s).stdout)["jobs"] == before


def test_mail_is_refused_at_submit_where_there_is_no_mail_program(settings, tmp_path):
    s = settings.with_overrides(mail_prog=str(tmp_path / "no-such-mail"))
    specs = [replace(spec.command_spec(["true"], user="ann"), mail_events="END")]
    with pytest.raises(InvalidSpec, match=r"^--mail-type: gpuq sends no mail here \(its mail program, "
                                          rf"GPUQ_MAIL_PROG={tmp_path}/no-such-mail, is not there\); ask the admins$"):
        submitting.submit_all(s, specs)
    with write_scope(s) as session:
        assert session.scalar(select(Job.id)) is None
    assert os.path.isabs(settings.mail_prog)
