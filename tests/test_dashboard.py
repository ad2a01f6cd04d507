"""`gpuq dashboard` over HTTP, against a stack that ran real jobs: the queue with states and
reasons, the GPUs with bars and the job and user on each, a job's page, per-user usage; read-only,
on localhost by default, stopped cleanly by SIGTERM; a client of the server's API in its public
view, with no database of its own."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from datetime import timedelta
from html import escape

import pytest
from sqlalchemy import delete, func, select, update

from gpuq.service import accounting, inventory, job_output, jobs, node_drains, spec, submitting
from gpuq.service.db import write_scope
from gpuq.service.fair_share import standings
from gpuq.service.models import Gpu, Job, utcnow
from tests.conftest import run_cli, serving
from tests.dashboard_stack import TRAIN_EPOCHS, XSS_NAME, Dashboard, stack_with_jobs

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def ran(request, tmp_path_factory, redis_url):
    yield from stack_with_jobs(request, tmp_path_factory, redis_url)


@pytest.fixture(scope="module")
def shared_dash(ran, tmp_path_factory):
    """A second `gpuq dashboard` on the same database, through a server of its own with
    GPUQ_SHARED_LOGS=true (rights are the server's to decide, not the dashboard's)."""
    with serving(ran[0].settings, shared_logs=True) as shared:
        d = Dashboard(shared, tmp_path_factory.mktemp("shared-dash") / "dashboard.log")
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
    with write_scope(st.settings) as session:
        reason = jobs.get_job(session, j.dependent).reason
    assert reason and reason in _row(html, j.dependent)


def test_queue_page_shows_every_gpu_with_bars_and_the_job_and_user_on_it(ran, dash):
    st, j = ran
    _, _, html = dash.get("/")
    gpus = html.split('class="gpus"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr><td>testnode</td>.*?</tr>", gpus)
    assert len(rows) == st.settings.fake_gpus
    busy = next(r for r in rows if f'href="/jobs/{j.running}"' in r)
    with write_scope(st.settings) as session:
        user = jobs.get_job(session, j.running).user
    assert f"<td>{user}</td>" in busy and "s-busy" in busy
    assert busy.count('<svg class="bar"') == 2  # utilisation and memory
    assert "GiB" in busy  # memory used / total of the bar's label
    assert any("s-idle" in r for r in rows)


def test_queue_page_marks_a_drained_gpu_and_says_why_under_the_gpus(ran, dash):
    st, j = ran
    with write_scope(st.settings) as session:
        idle = session.scalar(select(Gpu).where(~Gpu.allocations.any()).order_by(Gpu.index))
        gpu_id, index = idle.id, idle.index
        assert inventory.drain_gpu(session, gpu_id, "GPU lost: <Xid 79> (planted)")
    try:
        _, _, html = dash.get("/")
        gpus = html.split('class="gpus"', 1)[1].split("</table>", 1)[0]
        row = re.search(rf"<tr><td>testnode</td><td class=\"num\">{index}</td>.*?</tr>", gpus).group(0)
        assert "(drained)" in row
        assert f"drained: testnode GPU {index}: GPU lost: &lt;Xid 79&gt; (planted)" in html
    finally:
        with write_scope(st.settings) as session:
            session.execute(update(Gpu).where(Gpu.id == gpu_id).values(drain_reason=None))


def test_queue_page_says_when_a_node_drains_under_the_gpus(ran, dash):
    st, _ = ran
    with write_scope(st.settings) as session:
        node_drains.plan(session, "testnode", utcnow() + timedelta(hours=5), reason="<new driver>", by="root")
    try:
        _, _, html = dash.get("/")
        assert re.search(r"node testnode drains at [\d: -]+ UTC \(&lt;new driver&gt;; by root\): only jobs whose "
                         r"time limit ends by then start there", html), html[-2000:]
    finally:
        with write_scope(st.settings) as session:
            node_drains.set_drained(session, "testnode", False)


def test_job_page_shows_parameters_result_metrics_per_epoch_and_device_plots(ran, dash):
    st, j = ran
    status, _, html = dash.get(f"/jobs/{j.train}")
    assert status == 200
    with write_scope(st.settings) as session:
        job = jobs.get_job(session, j.train)
        metrics = job_output.read_metrics(session, j.train)
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
    assert "<th>CPU</th>" not in html  # a workload runs in its worker: no host use of its own


def test_job_page_of_a_pending_job_says_why_it_waits_and_a_failed_one_shows_its_output(ran, dash, shared_dash):
    st, j = ran
    _, _, html = dash.get(f"/jobs/{j.dependent}")
    assert f"it waits for job {j.held} (pending) to succeed" in html
    # Output is shown to the dashboard's visitors only with GPUQ_SHARED_LOGS.
    _, _, html = shared_dash.get(f"/jobs/{j.failed}")
    assert "<script>" not in html and f"Job {j.failed}: {escape(XSS_NAME)}" in html
    assert "about to fail" in html.split("<h2>Output</h2>", 1)[1]
    assert "<th>exit code</th><td>3</td>" in html
    # A command's CPU time, as `gpuq stats ID` gives it.
    assert re.search(r"<th>CPU</th><td>[0-9.]+ s, [0-9.]+ cores on average</td>", html), html


def test_job_page_shows_no_output_by_default_only_whose_it_is_and_how_they_read_it(ran, dash):
    st, j = ran
    for job_id in (j.failed, j.train, j.running):
        with write_scope(st.settings) as session:
            job = jobs.get_job(session, job_id)
            output = job_output.read_output(session, job_id)
        status, _, html = dash.get(f"/jobs/{job_id}")
        assert status == 200
        section = html.split("<h2>Output</h2>", 1)[1]
        assert f"the output is {escape(job.user)}'s" in section and f"<code>gpuq logs {job_id}</code>" in section
        assert "<pre>" not in html
        # (The command line, which everyone may see, may quote what it prints: look past it.)
        for _, data, _ in output:
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
    with write_scope(st.settings) as session:
        before = session.get(Job, j.held)
        saved = (before.git_diff, before.git_dirty, before.env)
        session.execute(update(Job).where(Job.id == j.held).values(git_diff=diff, git_dirty=True, env=env))
    try:
        for d in (dash, shared_dash):
            for path in (f"/jobs/{j.held}", "/", "/usage", "/history?period=week", "/metrics"):
                status, _, body = d.get(path)
                assert status == 200, path
                assert "SECRET_DIFF_LINE" not in body and "hunter2-env-value" not in body, path
    finally:
        with write_scope(st.settings) as session:
            session.execute(update(Job).where(Job.id == j.held)
                            .values(git_diff=saved[0], git_dirty=saved[1], env=saved[2]))


def test_metrics_carry_no_output_even_with_shared_logs(ran, dash, shared_dash):
    st, j = ran
    with write_scope(st.settings) as session:
        lines = {ln.strip() for job_id in (j.failed, j.train, j.matmul, j.running)
                 for _, data, _ in job_output.read_output(session, job_id)
                 for ln in data.splitlines() if len(ln.strip()) > 10}
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
        with write_scope(st.settings) as session:
            rep = accounting.report(session, now - span, now, now)
        users = html.split('class="usage-users"', 1)[1].split("</table>", 1)[0]
        for row in rep["users"]:
            shown = re.search(rf"<td>{row.name}</td><td class=\"num\">(\d+)</td><td class=\"num\">([\d.]+)</td>", users)
            assert shown, users
            assert int(shown.group(1)) == row.jobs
            # The running job adds GPU-hours between the report and the page.
            assert abs(float(shown.group(2)) - row.gpu_hours) < 0.01
        assert 'aria-label="GPUs kept busy' in html
        # Each user's standing in the fair share now, as `gpuq share` gives it, first in the order first.
        fair = html.split('class="fair-share"', 1)[1].split("</table>", 1)[0]
        with write_scope(st.settings) as session:
            standing = standings(session, st.settings)
        shown = re.findall(r"<tr><td class=\"num\">(\d+)</td><td>([^<]+)</td>", fair)
        # (The order of two users whose running jobs add GPU-hours may turn between the two reads.)
        assert sorted(u for _, u in shown) == sorted(u.user for u in standing) and standing, fair
        assert [int(o) for o, _ in shown] == sorted(int(o) for o, _ in shown)


def test_history_page_lists_the_jobs_that_ended_with_their_counts_narrowed_by_user_and_state(ran, dash):
    st, _ = ran
    with write_scope(st.settings) as session:
        ended = session.execute(select(Job.id, Job.user, Job.state).where(Job.ended_at.is_not(None))
                                .order_by(Job.ended_at.desc(), Job.id.desc())).all()
    status, _, html = dash.get("/history")
    assert status == 200 and "<h1>History</h1>" in html
    listed = html.split('class="history"', 1)[1].split("</table>", 1)[0]
    assert [int(i) for i in re.findall(r'<td class="num"><a href="/jobs/(\d+)">', listed)] == [r.id for r in ended]
    assert f"{len(ended)} jobs ended " in html
    # Each ended job's usage beside it, as `gpuq history -o` gives it: a job that ran has GPU-hours.
    assert "<th>GPU-hours</th>" in html and "<th>CPU time</th>" in html and "<th>host mem peak</th>" in html
    [ok] = [r.id for r in ended if r.state == "succeeded"][:1]
    row = next(r for r in listed.split("<tr>") if f'href="/jobs/{ok}"' in r)
    assert re.search(r'<td class="num">\d+\.\d\d</td>', row), row
    failed = [r.id for r in ended if r.state == "failed"]
    status, _, html = dash.get("/history?period=week&state=failed")
    listed = html.split('class="history"', 1)[1].split("</table>", 1)[0]
    assert [int(i) for i in re.findall(r'<a href="/jobs/(\d+)">', listed)] == failed and failed
    assert "<script>" not in html and escape(XSS_NAME) in listed  # a failed job's name, escaped
    user = ended[0].user
    status, _, html = dash.get(f"/history?user={user}")
    assert f"jobs of {user} ended" in html and '<a href="/history?period=day">everyone</a>' in html
    for bad in ("/history?period=year", "/history?state=running", "/history?user=" + "x" * 65):
        assert dash.get(bad)[0] == 400, bad


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
    with write_scope(st.settings) as session:
        assert jobs.get_job(session, j.held).state == "pending"


def test_dashboard_listens_on_localhost_by_default_and_stops_cleanly_on_sigterm(ran, tmp_path):
    st, _ = ran
    d = Dashboard(st.settings, tmp_path / "dashboard.log")
    assert f"gpuq dashboard at http://127.0.0.1:{d.port}/" in d.log()
    assert d.stop() == 0


def test_a_database_not_yet_upgraded_is_a_one_line_error_before_anything_listens(tmp_path, redis_url):
    from tests.conftest import make_settings

    fresh = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'empty.db'}", redis_url)
    with serving(fresh) as served:  # the server answers; its database is not upgraded
        out = run_cli(["dashboard", "--port", "0"], served, timeout=30)
    assert out.returncode == 78 and "gpuq db upgrade" in out.stderr and "dashboard at" not in out.stdout


def test_no_server_is_a_one_line_error_naming_where_it_looked(tmp_path, redis_url):
    from tests.conftest import make_settings

    alone = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'x.db'}", redis_url)
    out = run_cli(["dashboard", "--port", "0", "--wait", "0.5"], alone, timeout=30)
    assert out.returncode == 69 and "dashboard at" not in out.stdout
    assert len(out.stderr.strip().splitlines()) == 1 and alone.socket in out.stderr, out.stderr


def test_the_dashboard_needs_no_database_it_serves_every_page_with_a_bogus_database_url(ran, tmp_path):
    st, j = ran
    blind = dataclasses.replace(st.settings, database_url="sqlite:////nonexistent/x.db",
                                broker_url="redis://127.0.0.1:1/0")
    d = Dashboard(blind, tmp_path / "dashboard.log")
    try:
        for path in ("/", f"/jobs/{j.train}", f"/jobs/{j.held}", "/usage", "/usage?period=week", "/history",
                     "/metrics"):
            status, _, body = d.get(path)
            assert status == 200, (path, body[-500:])
        assert "tiny-train" in d.get("/")[2] and "gpuq_jobs{" in d.get("/metrics")[2]
    finally:
        assert d.stop() == 0


def test_the_dashboards_modules_load_no_sqlalchemy_nor_gpuqs_database_modules():
    probe = ("import sys; import gpuq.cli.dashboard, gpuq.web.server, gpuq.web.pages, gpuq.web.metrics; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sqlalchemy' "
             "or m in ('gpuq.service.db', 'gpuq.service.models')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


class _Api:
    """Raw requests to the stack's server on its socket, with or without the public view."""

    def __init__(self, settings):
        self.path = str(settings.server_socket)

    def __call__(self, method: str, target: str, public: bool, body: bytes = b"") -> tuple[int, dict]:
        import json

        from gpuq.cli.client import unix_connection

        conn = unix_connection(self.path, 30)
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        if public:
            headers["X-Gpuq-View"] = "public"
        try:
            conn.request(method, "/v1" + target, body=body or None, headers=headers)
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            conn.close()


def test_a_public_view_request_cannot_read_output_that_the_same_caller_can_without_it(ran):
    st, j = ran
    api = _Api(st.settings)
    status, answer = api("GET", f"/jobs/{j.failed}/output", public=False)
    assert status == 200 and "about to fail" in "".join(ch[1] for ch in answer["chunks"])
    status, answer = api("GET", f"/jobs/{j.failed}/output", public=True)
    assert status == 403 and answer["exit_code"] == 77 and "about to fail" not in str(answer)
    status, answer = api("GET", f"/jobs/{j.failed}", public=True)
    assert status == 200 and answer["output_readable"] is False and answer["last_output"] == []
    assert api("GET", f"/jobs/{j.failed}/diff", public=True)[0] == 403
    assert api("GET", "/whoami", public=True) == (200, {"user": None, "uid": None, "admin": False})
    assert api("GET", "/whoami", public=False)[1]["user"] is not None


def test_a_public_view_request_may_change_nothing_nor_ask_about_itself(ran):
    st, j = ran
    api = _Api(st.settings)
    status, answer = api("POST", "/jobs", public=True, body=b'{"command": ["true"], "cwd": "/tmp"}')
    assert status == 403 and answer["exit_code"] == 77
    for target in (f"/jobs/{j.held}/release", f"/jobs/{j.held}/cancel"):
        assert api("POST", target, public=True)[0] == 403
    assert api("GET", "/jobs?mine=1", public=True)[0] == 403
    assert api("GET", "/jobs/history?mine=1", public=True)[0] == 403
    status, answer = api("GET", "/jobs/history?user=daemon", public=True)  # an account with no job
    assert status == 200 and (answer["jobs"], answer["counts"], answer["total"]) == ([], {}, 0)
    assert api("GET", "/jobs/history?user=nobody-here", public=True)[0] == 400  # no account, no job
    assert api("GET", "/jobs/history?user=", public=True)[0] == 400  # an empty name is no name, not everyone's
    assert api("GET", "/jobs/active", public=True)[0] == 403
    with write_scope(st.settings) as session:
        assert jobs.get_job(session, j.held).state == "pending" and jobs.get_job(session, j.held).held
    # What every user may see, the public view sees.
    status, answer = api("GET", "/jobs?ended=25", public=True)
    assert status == 200 and {j.train, j.held} <= {row["id"] for row in answer["jobs"]}


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


def test_queue_page_shows_an_arrays_pending_tasks_as_one_row_linked_to_the_first(ran, dash):
    st, _ = ran
    tasks = submitting.submit_all(st.settings, spec.expand(lambda extra: spec.command_spec(["true"], cwd="/"),
                                                           spec.Scheduling(hold=True), "0-3", []))
    ids = [t.id for t in tasks]
    try:
        _, _, html = dash.get("/")
        row = re.search(rf'<tr><td class="num"><a href="/jobs/{ids[0]}">{ids[0]}-{ids[-1]}</a></td>.*?</tr>', html)
        assert row, html
        assert "true[0-3]" in row.group(0) and "held (4 tasks)" in row.group(0)
        assert not any(f'<a href="/jobs/{i}">{i}</a>' in html for i in ids)  # no row of its own
        with write_scope(st.settings) as session:  # the summary counts each task, not the row
            pending = session.scalar(select(func.count()).select_from(Job).where(Job.state == "pending"))
        assert f"{pending} pending" in html.split("<table", 1)[0]
    finally:
        with write_scope(st.settings) as session:  # gone, not ended: the other tests count the ended rows
            session.execute(delete(Job).where(Job.id.in_(ids)))


def test_a_body_nested_too_deep_is_bad_input_not_a_server_error(ran):
    # 200,000 levels: a 500 and a traceback in the server's log for each such request.
    st, _ = ran
    api = _Api(st.settings)
    for depth in (200_000, 40):
        status, answer = api("POST", "/jobs", public=False, body=b'{"a":' + b"[" * depth + b"]" * depth + b"}")
        assert status == 400 and answer["exit_code"] == 2, (depth, status, answer)
        assert answer["error"] == "the request body is nested more than 32 deep", answer
    fine = b'{"command": ["true"], "cwd": "/tmp", "hold": true, "env": ["A=1"], "key": "nesting-ok"}'
    assert api("POST", "/jobs", public=False, body=fine)[0] == 200
