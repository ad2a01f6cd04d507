"""`gpuq dashboard` over HTTP, against a stack that ran real jobs: the queue with states and
reasons, the GPUs with bars and the job and user on each, a job's page, per-user usage; read-only,
on localhost by default, stopped cleanly by SIGTERM."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from datetime import timedelta
from html import escape

import pytest

from gpuq.service import accounting, jobs
from gpuq.service.db import session_scope
from gpuq.service.models import utcnow
from tests.conftest import run_cli
from tests.dashboard_stack import TRAIN_EPOCHS, XSS_NAME, Dashboard, stack_with_jobs

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def ran(request, tmp_path_factory, redis_url):
    yield from stack_with_jobs(request, tmp_path_factory, redis_url)


@pytest.fixture(scope="module")
def shared_dash(ran, tmp_path_factory):
    """A second `gpuq dashboard` on the same stack, with GPUQ_SHARED_LOGS=true."""
    d = Dashboard(dataclasses.replace(ran[0].settings, shared_logs=True),
                  tmp_path_factory.mktemp("shared-dash") / "dashboard.log")
    yield d
    d.stop()


def _row(html: str, job_id: int) -> str:
    """The queue table's row of one job."""
    match = re.search(rf'<tr><td class="num"><a href="/jobs/{job_id}">{job_id}</a></td>.*?</tr>', html)
    assert match, f"no row for job {job_id}"
    return match.group(0)


def test_queue_page_shows_each_job_with_its_state_and_why_pending_ones_wait(ran, dash):
    st, j = ran
    status, kind, html = dash.get("/")
    assert status == 200 and kind.startswith("text/html")
    assert "s-succeeded" in _row(html, j.train) and "test acc" in _row(html, j.train)
    assert "GFLOP/s" in _row(html, j.matmul)
    assert "failed" in _row(html, j.failed) and "exit" in _row(html, j.failed)
    assert "<script>" not in html and "oops &lt;script&gt;alert(1)&lt;/script&gt;" in _row(html, j.failed)
    assert "running" in _row(html, j.running) and "long-nap" in _row(html, j.running)
    assert "pending" in _row(html, j.held) and "held" in _row(html, j.held)
    with session_scope(st.settings) as session:
        reason = jobs.get_job(session, j.dependent).reason
    assert reason and reason in _row(html, j.dependent)


def test_queue_page_shows_every_gpu_with_bars_and_the_job_and_user_on_it(ran, dash):
    st, j = ran
    _, _, html = dash.get("/")
    gpus = html.split('class="gpus"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr><td>testnode</td>.*?</tr>", gpus)
    assert len(rows) == st.settings.fake_gpus
    busy = next(r for r in rows if f'href="/jobs/{j.running}"' in r)
    with session_scope(st.settings) as session:
        user = jobs.get_job(session, j.running).user
    assert f"<td>{user}</td>" in busy and "s-busy" in busy
    assert busy.count('<svg class="bar"') == 2  # utilisation and memory
    assert "GiB" in busy  # memory used / total of the bar's label
    assert any("s-idle" in r for r in rows)


def test_job_page_shows_parameters_result_metrics_per_epoch_and_device_plots(ran, dash):
    st, j = ran
    status, _, html = dash.get(f"/jobs/{j.train}")
    assert status == 200
    with session_scope(st.settings) as session:
        job = jobs.get_job(session, j.train)
        metrics = jobs.read_metrics(session, j.train)
    assert f"Job {j.train}: tiny-train" in html
    params = html.split("<h2>Parameters</h2>", 1)[1].split("</table>", 1)[0]
    assert "<th>epochs</th><td>3</td>" in params and "<th>batch_size</th><td>64</td>" in params
    result = html.split("<h2>Result</h2>", 1)[1].split("</table>", 1)[0]
    assert f"<th>test_acc</th><td>{job.result['test_acc']:.4g}</td>" in result
    table = html.split('class="metrics"', 1)[1].split("</table>", 1)[0]
    assert len(metrics) == TRAIN_EPOCHS and table.count("<tr>") == TRAIN_EPOCHS + 1
    assert f"{metrics[-1]['train_loss']:.4g}" in table
    assert 'aria-label="loss"' in html and 'aria-label="accuracy"' in html
    for chart in ("GPU utilisation", "GPU memory used", "GPU power"):
        assert f'aria-label="{chart}"' in html
        svg = html.split(f'aria-label="{chart}"', 1)[1].split("</svg>", 1)[0]
        assert "<polyline" in svg
    assert "<h2>Usage</h2>" in html and "GPU-hours" in html


def test_job_page_of_a_pending_job_says_why_it_waits_and_a_failed_one_shows_its_output(ran, dash, shared_dash):
    st, j = ran
    _, _, html = dash.get(f"/jobs/{j.dependent}")
    assert f"it waits for job {j.held} (pending) to succeed" in html
    # Output is shown to the dashboard's visitors only with GPUQ_SHARED_LOGS.
    _, _, html = shared_dash.get(f"/jobs/{j.failed}")
    assert "<script>" not in html and f"Job {j.failed}: {escape(XSS_NAME)}" in html
    assert "about to fail" in html.split("<h2>Output</h2>", 1)[1]
    assert "<th>exit code</th><td>3</td>" in html


def test_job_page_shows_no_output_by_default_only_whose_it_is_and_how_they_read_it(ran, dash):
    st, j = ran
    for job_id in (j.failed, j.train, j.running):
        with session_scope(st.settings) as session:
            job = jobs.get_job(session, job_id)
            output = jobs.read_output(session, job_id)
        status, _, html = dash.get(f"/jobs/{job_id}")
        assert status == 200
        section = html.split("<h2>Output</h2>", 1)[1]
        assert f"the output is {escape(job.user)}'s" in section and f"<code>gpuq logs {job_id}</code>" in section
        assert "<pre>" not in html
        # (The command line, which everyone may see, may quote what it prints: look past it.)
        for _, data in output:
            for line in data.splitlines():
                if len(line.strip()) > 10:
                    assert escape(line.strip()) not in section, line
    _, _, html = dash.get(f"/jobs/{j.failed}")
    assert "about to fail" not in html.split("<h2>Output</h2>", 1)[1]
    assert "<th>exit code</th><td>3</td>" in html  # the result is everyone's


def test_no_page_shows_a_recorded_diff_or_environment_values_even_with_shared_logs(ran, dash, shared_dash):
    st, j = ran
    from sqlalchemy import update

    from gpuq.service.models import Job

    diff, env = "+SECRET_DIFF_LINE = 'uncommitted'", {"SECRET_TOKEN": "hunter2-env-value"}
    with session_scope(st.settings) as session:
        before = session.get(Job, j.held)
        saved = (before.git_diff, before.git_dirty, before.env)
        session.execute(update(Job).where(Job.id == j.held).values(git_diff=diff, git_dirty=True, env=env))
    try:
        for d in (dash, shared_dash):
            for path in (f"/jobs/{j.held}", "/", "/usage", "/metrics"):
                status, _, body = d.get(path)
                assert status == 200, path
                assert "SECRET_DIFF_LINE" not in body and "hunter2-env-value" not in body, path
    finally:
        with session_scope(st.settings) as session:
            session.execute(update(Job).where(Job.id == j.held)
                            .values(git_diff=saved[0], git_dirty=saved[1], env=saved[2]))


def test_metrics_carry_no_output_even_with_shared_logs(ran, dash, shared_dash):
    st, j = ran
    with session_scope(st.settings) as session:
        lines = {ln.strip() for job_id in (j.failed, j.train, j.matmul, j.running)
                 for _, data in jobs.read_output(session, job_id) for ln in data.splitlines() if len(ln.strip()) > 10}
    assert "about to fail" in lines
    for d in (dash, shared_dash):
        status, _, text = d.get("/metrics")
        assert status == 200 and "gpuq_jobs{" in text
        assert not [ln for ln in lines if ln in text]


def test_usage_page_shows_each_users_gpu_hours_over_the_last_day_and_week(ran, dash):
    st, _ = ran
    for period, span in (("day", timedelta(days=1)), ("week", timedelta(days=7))):
        status, _, html = dash.get(f"/usage?period={period}")
        assert status == 200 and f"Usage, last {period}" in html
        now = utcnow()
        with session_scope(st.settings) as session:
            rep = accounting.report(session, now - span, now, now)
        users = html.split('class="usage-users"', 1)[1].split("</table>", 1)[0]
        for row in rep["users"]:
            shown = re.search(rf"<td>{row.name}</td><td class=\"num\">(\d+)</td><td class=\"num\">([\d.]+)</td>", users)
            assert shown, users
            assert int(shown.group(1)) == row.jobs
            # The running job adds GPU-hours between the report and the page.
            assert abs(float(shown.group(2)) - row.gpu_hours) < 0.01
        assert 'aria-label="GPUs kept busy' in html


def test_unknown_pages_and_jobs_are_404_bad_periods_400(dash):
    assert dash.get("/jobs/999999")[0] == 404
    assert "no job 999999" in dash.get("/jobs/999999")[2]
    assert dash.get("/nothing-here")[0] == 404
    assert dash.get("/usage?period=year")[0] == 400


def test_dashboard_is_read_only_it_refuses_writes_and_leaves_the_database_unchanged(ran, dash):
    st, j = ran
    for method in ("POST", "PUT", "DELETE"):
        assert dash.get(f"/jobs/{j.held}", method=method)[0] == 405
    status, kind, body = dash.get(f"/jobs/{j.held}", method="HEAD")
    assert status == 200 and kind.startswith("text/html") and body == ""
    with session_scope(st.settings) as session:
        assert jobs.get_job(session, j.held).state == "pending"


def test_dashboard_listens_on_localhost_by_default_and_stops_cleanly_on_sigterm(ran, tmp_path):
    st, _ = ran
    d = Dashboard(st.settings, tmp_path / "dashboard.log")
    assert f"gpuq dashboard at http://127.0.0.1:{d.port}/" in d.log()
    assert d.stop() == 0


def test_a_database_not_yet_upgraded_is_a_one_line_error_before_anything_listens(tmp_path, redis_url):
    from tests.conftest import make_settings

    fresh = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'empty.db'}", redis_url)
    out = run_cli(["dashboard", "--port", "0"], fresh, timeout=30)
    assert out.returncode == 78 and "gpuq db upgrade" in out.stderr and "dashboard at" not in out.stdout


def test_a_busy_port_is_a_one_line_error(ran, dash):
    st, _ = ran
    out = run_cli(["dashboard", "--port", str(dash.port)], st.settings)
    assert out.returncode == 2 and out.stderr.startswith("gpuq: cannot listen on 127.0.0.1:")
    assert len(out.stderr.strip().splitlines()) == 1


def test_the_cli_loads_no_web_server_or_prometheus_client_until_the_dashboard_runs():
    probe = ("import sys; import gpuq.cli.app; "
             "print(sorted(m for m in sys.modules if m.startswith(('prometheus_client', 'gpuq.web', 'wsgiref'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_dashboards_sessions_refuse_writes_and_leave_the_connection_writable_for_others(settings):
    from sqlalchemy import func, select, update
    from sqlalchemy.exc import DBAPIError

    from gpuq.service.models import Node
    from gpuq.web.read import read_session

    from gpuq.service.errors import Unreachable

    # SQLite's refusal is an OperationalError, which the session turns into Unreachable.
    with pytest.raises((DBAPIError, Unreachable), match=r"(?i)read-?only"):
        with read_session(settings) as session:
            session.add(Node(name="n1", drained=True))
            session.flush()
    with read_session(settings) as session:
        assert session.scalar(select(func.count()).select_from(Node)) == 0
    # The same pooled connection serves the next, ordinary session: it can write again.
    with session_scope(settings) as session:
        session.add(Node(name="n1", drained=False))
    with session_scope(settings) as session:
        session.execute(update(Node).values(drained=True))
        assert session.get(Node, "n1").drained
