"""A submit survives its server's death: the client sends it again with the same idempotency key
(``key``), and the server makes the jobs once. Never half a submission, never two.

First the key itself, on the real `gpuq server` (the same body sent twice, one after the other and
both at once); then the real thing: `gpuq submit --array 0-499` while the server is SIGKILLed
and started again.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from typing import Any

import psutil
import pytest
from sqlalchemy import func, select

from gpuq.cli.client import unix_connection
from gpuq.service import constants as c
from gpuq.service.db import write_scope
from gpuq.service.models import Job, Submission
from gpuq.service.settings import Settings
from tests.conftest import Stack, settings_env

ARRAY = 500


def _post(settings: Settings, target: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST ``body`` to the server's socket, as the client does; the status and the JSON answer."""
    conn = unix_connection(str(settings.server_socket), 60.0)
    try:
        data = json.dumps(body).encode()
        conn.request("POST", c.API_PREFIX + target, body=data,
                     headers={"Content-Type": "application/json", "Content-Length": str(len(data))})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _jobs_by_array(settings: Settings) -> dict[int | None, list[int]]:
    """Every job's array index, by array (None: jobs of no array)."""
    out: dict[int | None, list[int]] = {}
    with write_scope(settings) as session:
        for array_id, index in session.execute(select(Job.array_id, Job.array_index)):
            out.setdefault(array_id, []).append(index)
    return out


def _submissions(settings: Settings) -> list[tuple[str, list[int]]]:
    with write_scope(settings) as session:
        return [(k, list(ids)) for k, ids in session.execute(select(Submission.key, Submission.job_ids))]


def _job_count(settings: Settings) -> int:
    with write_scope(settings) as session:
        return session.scalar(select(func.count()).select_from(Job))


@pytest.mark.timeout(300)
def test_the_same_submit_key_twice_returns_the_first_jobs_and_writes_nothing_more(settings, tmp_path):
    st = Stack(settings, tmp_path / "logs")
    st.start_server()
    try:
        key = uuid.uuid4().hex
        body = {"command": ["true"], "cwd": str(tmp_path), "array": "0-9", "hold": True, "key": key}
        status, first = _post(settings, "/jobs", body)
        assert status == 200, first
        ids = [j["id"] for j in first["jobs"]]
        assert len(ids) == 10
        status, again = _post(settings, "/jobs", body)
        assert status == 200, again
        assert [j["id"] for j in again["jobs"]] == ids
        # The key is what counts: the same key with another body is the first submission still.
        status, other = _post(settings, "/jobs", body | {"array": "0-99"})
        assert status == 200 and [j["id"] for j in other["jobs"]] == ids
        assert _job_count(settings) == 10
        assert _submissions(settings) == [(key, ids)]
        # A new key is a new submission.
        status, fresh = _post(settings, "/jobs", body | {"key": uuid.uuid4().hex})
        assert status == 200 and set(j["id"] for j in fresh["jobs"]).isdisjoint(ids)
        assert _job_count(settings) == 20
    finally:
        st.stop()


@pytest.mark.timeout(300)
def test_the_same_submit_key_sent_at_once_makes_the_jobs_once(settings, tmp_path):
    st = Stack(settings, tmp_path / "logs")
    st.start_server()
    try:
        key = uuid.uuid4().hex
        body = {"command": ["true"], "cwd": str(tmp_path), "array": "0-199", "hold": True, "key": key}
        answers: list[tuple[int, Any]] = []
        go = threading.Barrier(4)

        def send() -> None:
            go.wait()
            answers.append(_post(settings, "/jobs", body))

        threads = [threading.Thread(target=send) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [s for s, _ in answers] == [200] * 4, answers
        made = {tuple(j["id"] for j in a["jobs"]) for _, a in answers}
        assert len(made) == 1 and len(next(iter(made))) == 200
        assert _job_count(settings) == 200
        assert _submissions(settings) == [(key, list(next(iter(made))))]
    finally:
        st.stop()


def _accepted(server: subprocess.Popen, path: str) -> bool:
    """Whether the server holds a connection it accepted on its socket (a request under way)."""
    try:
        conns = psutil.Process(server.pid).net_connections(kind="unix")
    except psutil.Error:
        return False
    return sum(1 for conn in conns if conn.laddr == path) > 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("after", [0.0, 0.05, 0.3], ids=["at-accept", "50ms-in", "300ms-in"])
def test_a_submit_whose_server_is_killed_and_restarted_makes_its_jobs_once_or_not_at_all(settings, tmp_path, after):
    st = Stack(settings, tmp_path / "logs")
    server = st.start_server()
    client = None
    try:
        before = _job_count(settings)
        argv = [sys.executable, "-m", "gpuq.cli", "submit", "--array", f"0-{ARRAY - 1}", "--", "true"]
        client = subprocess.Popen(argv, env=settings_env(settings), cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        # Kill it while it serves the submit: once it has accepted the client's connection (a
        # submit that was quicker than this look is still held to the same outcome below).
        deadline = time.monotonic() + 30
        while not _accepted(server, str(settings.server_socket)) and time.monotonic() < deadline:
            if client.poll() is not None:
                break
            time.sleep(0.002)
        time.sleep(after)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        st.start_server()  # on the socket the dead one left behind
        out, err = client.communicate(timeout=120)

        assert client.returncode in (c.EXIT_OK, c.EXIT_UNAVAILABLE), (client.returncode, out, err)
        arrays = _jobs_by_array(settings)
        assert None not in arrays  # no job outside an array, no half-made array
        for array_id, indices in arrays.items():
            assert Counter(indices) == Counter(range(ARRAY)), f"array {array_id}: {len(indices)} jobs"
        assert len(arrays) <= 1 and _job_count(settings) - before in (0, ARRAY)
        subs = _submissions(settings)
        assert len(subs) == len(arrays)
        if client.returncode == c.EXIT_OK:
            assert len(arrays) == 1, out  # it said submitted: the jobs are there, once
            (array_id,) = arrays
            assert f"submitted array {array_id}: jobs " in out and f"({ARRAY})" in out
            assert sorted(subs[0][1]) == subs[0][1] and len(set(subs[0][1])) == ARRAY
        else:
            assert len(err.splitlines()) == 1 and "no gpuq server answers" in err, err
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.wait(10)
        st.stop()


def test_a_key_used_before_answers_with_its_jobs_even_where_the_checks_would_now_refuse(settings):
    # A retry whose answer was lost must get its jobs back, not a refusal its own jobs now cause
    # (they count against the pending cap).
    from gpuq.service import spec, submitting
    from gpuq.service.errors import DuplicateSubmission

    capped = settings.with_overrides(max_pending_per_user=3, place_at_submit=False)
    make = lambda extra: spec.command_spec(["true"], user="ann", cwd="/")  # noqa: E731
    specs = spec.expand(make, spec.Scheduling(hold=True), "0-2", [])
    key = uuid.uuid4().hex
    ids = [j.id for j in submitting.submit_all(capped, specs, key=key, record_code=False)]
    with pytest.raises(DuplicateSubmission) as again:
        submitting.submit_all(capped, specs, key=key, record_code=False)
    assert again.value.job_ids == ids
    assert _job_count(settings) == 3 and _submissions(settings) == [(key, ids)]


def test_another_users_key_is_refused_and_nothing_is_written(settings):
    from gpuq.service import spec, submitting
    from gpuq.service.errors import NotAllowed

    def specs(user: str) -> list:
        return spec.expand(lambda extra: spec.command_spec(["true"], user=user, cwd="/"),
                           spec.Scheduling(hold=True), None, [])

    key = uuid.uuid4().hex
    ids = [j.id for j in submitting.submit_all(settings, specs("ann"), key=key, record_code=False)]
    with pytest.raises(NotAllowed, match="another user"):
        submitting.submit_all(settings, specs("bob"), key=key, record_code=False)
    assert _job_count(settings) == 1 and _submissions(settings) == [(key, ids)]
