"""`gpuq submit --test-only` (sbatch's): a submission checked and its start estimated through the
queue's own pass and forecast, nothing written; and sbatch's `--parsable` and `-D/--chdir`."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from gpuq.cli.app import app
from gpuq.service import constants as c
from gpuq.service import policy, spec, submitting
from gpuq.service.db import read_scope
from gpuq.service.errors import InvalidSpec, OverLimit
from gpuq.service.estimate import estimate, sentence
from gpuq.service.explain import expected_starts
from gpuq.service.models import Job, NextUp, Submission, utcnow
from gpuq.service.scheduler import Scheduler
from tests.test_scheduling import register, submit

pytestmark = pytest.mark.timeout(120)


def specs(argv=("true",), *, user="ann", gpus=1, array=None, **sched) -> list[spec.JobSpec]:
    make = lambda extra: spec.command_spec(list(argv), gpus=gpus, user=user)  # noqa: E731
    return spec.expand(make, spec.Scheduling(**sched), array, [])


def rows_written(settings) -> tuple[int, int, int]:
    with read_scope(settings) as session:
        return tuple(session.scalar(select(func.count()).select_from(t)) for t in (Job, Submission, NextUp))


def test_an_idle_gpu_is_named_and_a_busy_queue_gives_the_start_its_forecast_gives_once_submitted(settings):
    settings = settings.with_overrides(place_at_submit=False)
    register(settings, "a", 2)
    [now] = estimate(settings, specs(time="10m"))
    assert now.now and now.node == "a" and now.gpus == [0] and now.reason is None
    for _ in range(2):  # both GPUs busy for ten minutes
        submit(settings, time="10m")
    Scheduler(settings).schedule_once()
    before = rows_written(settings)
    [later] = estimate(settings, specs(time="5m"))
    [gang] = estimate(settings, specs(gpus=2, time="5m"))
    assert rows_written(settings) == before  # nothing written, listed or keyed
    assert not later.now and later.reason == policy.RESOURCES and later.node == "a" and len(later.gpus) == 1
    assert gang.node == "a" and sorted(gang.gpus) == [0, 1]
    assert timedelta(minutes=9) < later.start - utcnow() <= timedelta(minutes=10)
    assert gang.start is not None and abs((gang.start - later.start).total_seconds()) < 2
    # Submitted for real, the queue's own forecast (`gpuq status --start`) says the same moment.
    job = submitting.submit_all(settings, specs(time="5m"))[0].id
    with read_scope(settings) as session:
        forecast = expected_starts(session, settings)[job]
    assert abs((forecast - later.start).total_seconds()) < 2
    assert re.fullmatch(rf"would start by {later.start:%Y-%m-%d %H:%M}:\d\d UTC, in 0:(09:\d\d|10:00) on a \(GPU "
                        r"[01]\), if the jobs before it run to their time limits", sentence(later, utcnow()))


def test_a_new_job_waits_behind_the_queue_and_backfills_only_where_it_ends_in_time(settings):
    settings = settings.with_overrides(place_at_submit=False)
    register(settings, "a", 2)
    submit(settings, time="10m")
    Scheduler(settings).schedule_once()  # GPU 0 busy for ten minutes, GPU 1 idle
    submit(settings, user="bob", gpus=2, time="20m")  # waits for both: holds GPU 1 from then
    [short] = estimate(settings, specs(time="5m"))  # ends before the gang may start: backfilled now
    [endless] = estimate(settings, specs())  # no time limit: it would delay the gang, so it goes after it
    assert short.now and short.gpus == [1]
    assert not endless.now and endless.reason == policy.PRIORITY
    assert timedelta(minutes=29) < endless.start - utcnow() <= timedelta(minutes=30)


def test_a_new_job_after_a_placed_one_would_start_as_that_one_reaches_its_time_limit(settings):
    settings = settings.with_overrides(place_at_submit=False)
    register(settings, "a", 2)
    first = submit(settings, time="10m")
    Scheduler(settings).schedule_once()  # placed: it runs ten minutes at most, from now
    [after] = estimate(settings, specs(after=str(first), time="5m"))
    assert after.reason == policy.DEPENDENCY and not after.now
    assert timedelta(minutes=9) < after.start - utcnow() <= timedelta(minutes=10)
    assert "would start by " in sentence(after, utcnow())


def test_what_a_pass_would_make_a_new_job_wait_for_is_its_reason(settings):
    settings = settings.with_overrides(place_at_submit=False)
    register(settings, "a", 1)
    waiting = submit(settings, hold=True)
    [held] = estimate(settings, specs(hold=True))
    [dependent] = estimate(settings, specs(after=str(waiting)))
    assert (held.reason, held.start) == (policy.HELD, None) and "gpuq release" in sentence(held, utcnow())
    assert (dependent.reason, dependent.start) == (policy.DEPENDENCY, None)  # after a held job: none
    begin = (utcnow() + timedelta(hours=1)).isoformat()
    [later] = estimate(settings, specs(begin=begin))
    assert later.reason == policy.BEGIN_TIME and later.start >= utcnow() + timedelta(minutes=59)
    [both] = estimate(settings, specs(begin=begin, after=str(waiting)))
    assert both.start is None and "its dependency, and its begin time" in sentence(both, utcnow())
    tasks = estimate(settings, specs(array="0-2%1", time="1m"))
    assert [t.index for t in tasks] == [0, 1, 2]
    assert tasks[0].now and [t.reason for t in tasks[1:]] == [policy.ARRAY_LIMIT] * 2
    # One at a time, each as the one before it ends (a minute each), though the GPU is free.
    assert [round((t.start - tasks[0].start).total_seconds()) for t in tasks] == [0, 60, 120]


def test_an_estimate_refuses_what_a_submit_refuses_and_writes_nothing(settings):
    settings = settings.with_overrides(max_pending_per_user=2)
    register(settings, "a", 2)
    with pytest.raises(InvalidSpec, match="more than any node has"):
        estimate(settings, specs(gpus=3))
    with pytest.raises(OverLimit):
        estimate(settings, specs(array="0-2"))
    assert rows_written(settings) == (0, 0, 0)


def invoke(args):
    return CliRunner().invoke(app, args, prog_name="gpuq")


def test_test_only_prints_when_the_job_would_start_and_queues_nothing(use_settings, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    register(use_settings, "a", 1)
    result = invoke(["submit", "--test-only", "--", "true"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "job would start now on a (GPU 0); nothing was queued"
    result = invoke(["run", "--test-only", "--", "true"])  # srun's --test-only too: nothing followed or run
    assert result.exit_code == 0 and result.output == "job would start now on a (GPU 0); nothing was queued\n"
    result = invoke(["submit", "--test-only", "--json", "-a", "0-1", "--hold", "--", "true"])
    answer = json.loads(result.output)
    assert [(j["index"], j["reason"], j["start"]) for j in answer["jobs"]] == [(0, "held", None), (1, "held", None)]
    assert answer["line"].startswith("array of 2: its first task has no start time to count on (it is held")
    result = invoke(["submit", "--test-only", "--gpus", "3", "--", "true"])
    assert result.exit_code == c.EXIT_USAGE and "more than any node has" in result.output
    (tmp_path / "big.sh").write_text("#!/bin/sh\n#GPUQ --gpus 3\ntrue\n")
    (tmp_path / "big.sh").chmod(0o755)
    result = invoke(["submit", "--test-only", "--", "./big.sh"])  # the refusal names the script's line
    assert result.exit_code == c.EXIT_USAGE and result.output.strip().endswith("(big.sh line 2)"), result.output
    assert rows_written(use_settings) == (0, 0, 0)


def test_parsable_prints_the_id_alone_and_an_arrays_id_for_an_array(use_settings):
    result = invoke(["submit", "--parsable", "--", "true"])
    assert result.exit_code == 0 and result.output == "1\n"
    result = invoke(["submit", "--parsable", "-a", "0-2", "--", "true"])
    assert result.exit_code == 0 and result.output == "2\n"  # what --after and cancel take for all three
    for args, says in ((["--json"], "give --json or --parsable, not both"),
                       (["--test-only"], "give --test-only or --parsable, not both")):
        result = invoke(["submit", "--parsable", *args, "--", "true"])
        assert result.exit_code == c.EXIT_USAGE and says in result.output
    for args, says in ((["run", "--parsable"], "--parsable is for gpuq submit"),
                       (["run", "--wait"], "--wait is for gpuq submit"),
                       (["submit", "--wait", "--test-only"], "give --test-only or --wait, not both")):
        result = invoke([*args, "--", "true"])
        assert result.exit_code == c.EXIT_USAGE and says in result.output
    assert rows_written(use_settings)[0] == 4


def test_chdir_runs_the_job_there_with_its_relative_paths_read_from_there(use_settings, tmp_path, monkeypatch):
    run_in = tmp_path / "exp"
    (run_in / "logs").mkdir(parents=True)
    (run_in / "train.sh").write_text("#!/bin/sh\n#GPUQ --name from-script\ntrue\n")
    (run_in / "train.sh").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    result = invoke(["submit", "--json", "-D", "exp", "-o", "logs/%j.out", "--", "./train.sh"])
    assert result.exit_code == 0, result.output
    job = json.loads(result.output)
    # The script is found from there and its lines read; -o is that directory's.
    assert job["cwd"] == str(run_in) and job["name"] == "from-script"
    with read_scope(use_settings) as session:
        assert session.get(Job, job["id"]).output_file == str(run_in / "logs" / "%j.out")
    result = invoke(["submit", "-D", "nowhere", "--", "true"])
    assert result.exit_code == c.EXIT_USAGE
    assert result.output.strip() == f"gpuq: --chdir: {tmp_path / 'nowhere'}: no such directory"
    result = invoke(["submit", "-D", "exp/train.sh", "--", "true"])
    assert result.output.strip() == f"gpuq: --chdir: {run_in / 'train.sh'}: not a directory"
    (tmp_path / "job.sh").write_text("#!/bin/sh\n#GPUQ -D /tmp\ntrue\n")
    (tmp_path / "job.sh").chmod(0o755)
    result = invoke(["submit", "--", "./job.sh"])
    assert result.exit_code == c.EXIT_USAGE and "job.sh line 2: --chdir is given on the command line" in result.output
    assert rows_written(use_settings)[0] == 1
