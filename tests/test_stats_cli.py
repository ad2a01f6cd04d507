"""`gpuq stats` and `gpuq devices` on recorded samples: JSON, CSV, PNG plots of the right size,
--watch, --rollup, an array's tasks summed and a job's time limit against its run, and one-line
errors with their exit codes for bad input."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuq.cli.app import app
from gpuq.cli.plots import DPI, FIGSIZE
from gpuq.service import constants as c
from gpuq.service import samples
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.devices import GpuProcess, GpuReading
from gpuq.service.models import Allocation, Gpu, utcnow
from tests.test_usage import add_gpu, add_job, add_samples


@pytest.fixture
def recorded(use_settings):
    """Two GPUs on one node: a running job of ann's on GPU 0 (with a foreign process beside it),
    an ended job of bob's; a few minutes of samples. Returns the job ids."""
    now = utcnow()
    with write_scope(use_settings) as s:
        g0, g1 = add_gpu(s, "testnode", 0), add_gpu(s, "testnode", 1)
        s.query(Gpu).update({Gpu.heartbeat_at: now})
        ann = add_job(s, "ann", "testnode", now - timedelta(minutes=5), None)
        bob = add_job(s, "bob", "testnode", now - timedelta(minutes=8), now - timedelta(minutes=6), gpus=1)
        s.add(Allocation(job_id=ann, gpu_id=g0, rank=0))
        add_samples(s, g1, bob, now - timedelta(minutes=8), [80, 90] * 60)
        add_samples(s, g0, ann, now - timedelta(minutes=5), [30, 40] * 149, step=1.0)
        reading = GpuReading(utilization=35, memory_used_mib=2048, memory_total_mib=8192, power_w=120.0,
                             temperature_c=61, processes=(GpuProcess(7, 2000, "python", True),
                                                          GpuProcess(99, 512, "xorg", False)))
        samples.record(s, g0, [samples.sample_row(g0, ann, now, 1.0, reading, 120.0)])
    return {"ann": ann, "bob": bob}


def invoke(*args):
    return CliRunner().invoke(app, list(args))


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_devices_shows_utilisation_memory_job_user_and_foreign_processes(recorded):
    out = invoke("devices", "--json")
    assert out.exit_code == 0, out.output
    gpu0 = json.loads(out.output)[0]
    assert ((gpu0["job_id"], gpu0["user"], gpu0["utilization"], gpu0["temperature_c"])
            == (recorded["ann"], "ann", 35, 61))
    assert [p["pid"] for p in gpu0["processes"]] == [7] and [p["name"] for p in gpu0["foreign"]] == ["xorg"]
    table = invoke("devices")
    assert table.exit_code == 0 and "█" in table.output and "xorg[99]" in table.output and "ann" in table.output
    watched = invoke("devices", "--watch", "--interval", "0.1", "--count", "2")
    assert watched.exit_code == 0 and watched.output.count("xorg[99]") == 2


def test_devices_marks_drained_gpus_and_says_why_under_the_table_as_status_does(recorded, use_settings):
    with write_scope(use_settings) as session:
        session.query(Gpu).filter(Gpu.index == 1).update({Gpu.drain_reason: "GPU lost: Xid 79 (planted)"})
    out = invoke("devices")
    assert out.exit_code == 0, out.output
    lines = out.output.rstrip().splitlines()
    assert lines[-1] == "drained: testnode GPU 1: GPU lost: Xid 79 (planted)"
    assert sum("(drained)" in line for line in lines) == 1
    assert json.loads(invoke("devices", "--json").output)[1]["drain_reason"] == "GPU lost: Xid 79 (planted)"
    assert lines[-1] in invoke("status").output
    assert invoke("drain", "testnode", "--reason", "driver update").exit_code == 0
    # --json says so too: each GPU's node drained, with its reason beside the GPU's own.
    gpu1 = json.loads(invoke("devices", "--json").output)[1]
    assert gpu1["node_drained"] and gpu1["node_drain_reason"].startswith("driver update; by ")
    assert gpu1["drain_reason"] == "GPU lost: Xid 79 (planted)"
    lines = invoke("devices").output.rstrip().splitlines()
    assert lines[-2].startswith("drained: node testnode: driver update; by "), lines[-2]
    # The GPU's own reason stays in view under its drained node: resuming the node lifts it too.
    assert lines[-1] == "drained: testnode GPU 1: GPU lost: Xid 79 (planted)"
    assert sum("(drained)" in line for line in lines) == 2
    status = invoke("status").output.rstrip().splitlines()
    assert status[-1] == lines[-1] and status[-2].startswith("drained: node testnode: driver update")


def test_stats_reports_users_and_nodes_as_json_and_csv(recorded):
    data = json.loads(invoke("stats", "--since", "1h", "--json").output)
    users = {u["name"]: u for u in data["users"]}
    assert users["bob"]["gpu_hours"] == pytest.approx(2 / 60, rel=0.01) and users["bob"]["jobs"] == 1
    assert users["bob"]["utilization_mean"] == pytest.approx(85) and users["ann"]["jobs"] == 1
    assert [n["name"] for n in data["nodes"]] == ["testnode"]
    rows = list(csv.DictReader(io.StringIO(invoke("stats", "--since", "1h", "--csv").output)))
    assert {(r["by"], r["name"]) for r in rows} == {("user", "ann"), ("user", "bob"), ("node", "testnode")}
    assert all(r["cpu_hours"] == "0.0" for r in rows)  # no command of theirs ended with its CPU time
    table = invoke("stats").output
    assert "GPU-HOURS" in table and "CPU-HOURS" in table
    # A node's figures count its idle GPUs too, a user's only their jobs': said under the table.
    assert "per node, MEAN UTIL, ENERGY and IDLE GPU-HOURS count all its GPUs' samples, idle GPUs included" in table


def test_a_user_whose_jobs_were_never_sampled_reads_n_a_not_a_percent(recorded, use_settings):
    now = utcnow()
    with write_scope(use_settings) as s:
        add_job(s, "cy", "testnode", now - timedelta(minutes=3), now - timedelta(minutes=2))
    table = invoke("stats", "--since", "1h").output
    cy = next(line for line in table.splitlines() if " cy " in f" {line} ")
    assert "n/a" in cy.split() and "n/a%" not in table, table
    assert "85%" in next(line for line in table.splitlines() if " bob " in f" {line} ")


def test_stats_of_one_job_summarises_it(recorded):
    out = invoke("stats", str(recorded["bob"]), "--json")
    assert out.exit_code == 0, out.output
    job = json.loads(out.output)
    assert job["wall_s"] == pytest.approx(120) and job["utilization_mean"] == pytest.approx(85)
    assert job["energy_j"] == pytest.approx(120 * 100.0) and job["idle_s"] == 0 and job["samples"] == 120
    assert "GPU-hours" in invoke("stats", str(recorded["bob"])).output


def test_plots_are_real_pngs_of_the_expected_size(recorded, tmp_path):
    expected = (FIGSIZE[0] * DPI, FIGSIZE[1] * DPI)
    for args, name in (([str(recorded["ann"])], "job.png"), ([], "cluster.png")):
        out = invoke("stats", *args, "--plot", str(tmp_path / name))
        assert out.exit_code == 0, out.output
        assert png_size(tmp_path / name) == expected


def test_a_plot_is_written_in_the_format_its_suffix_names(recorded, tmp_path):
    # `--plot x.svg` wrote PNG data under an .svg name.
    for suffix, head in (("svg", b"<?xml"), ("SVG", b"<?xml"), ("pdf", b"%PDF-"), ("png", b"\x89PNG")):
        for args in ([str(recorded["ann"])], []):
            path = tmp_path / f"plot{len(args)}.{suffix}"
            out = invoke("stats", *args, "--plot", str(path))
            assert out.exit_code == 0, out.output
            data = path.read_bytes()
            assert data.startswith(head), (suffix, data[:80])
            assert (b"<svg" in data[:2000]) == (suffix.lower() == "svg")


def test_a_plot_suffix_matplotlib_cannot_write_is_refused_in_one_line_before_anything_is_drawn(
        recorded, tmp_path, monkeypatch):
    from gpuq.cli import plots

    def never(*args, **kwargs):
        raise AssertionError("drawn")

    monkeypatch.setattr(plots, "job_plot", never)
    monkeypatch.setattr(plots, "cluster_plot", never)
    path = tmp_path / "usage.pnng"
    for args in ([str(recorded["ann"])], []):
        out = invoke("stats", *args, "--plot", str(path))
        assert out.exit_code == c.EXIT_USAGE, out.output
        assert out.output.startswith(f"gpuq: --plot {path}: cannot draw a .pnng file; name it .png, .svg, .pdf")
        assert out.output.count("\n") == 1 and " svg, " in out.output, out.output
        assert not path.exists()


def test_rollup_command_leaves_recent_samples_alone(recorded):
    out = invoke("stats", "--rollup")
    assert out.exit_code == 0 and out.output.startswith("rolled 0 raw samples")


@pytest.mark.parametrize("args,code,words", [
    (["stats", "--since", "last tuesday"], c.EXIT_USAGE, "bad --since 'last tuesday'"),
    (["stats", "--since", "1h", "--until", "2h"], c.EXIT_USAGE, "is not before --until"),
    (["stats", "--json", "--csv"], c.EXIT_USAGE, "pick one"),
    (["stats", "999"], c.EXIT_NOT_FOUND, "no job 999"),
])
def test_bad_input_is_one_line_and_a_named_exit_code(recorded, args, code, words):
    out = invoke(*args)
    assert out.exit_code == code and words in out.output and len(out.output.strip().splitlines()) == 1


def test_a_jobs_plot_names_its_gpus_by_their_index_on_the_node_not_their_row():
    from gpuq.cli.stats import gpu_names

    one_node = {"3": {"node": "vm", "index": 1, "name": "x"}, "4": {"node": "vm", "index": 3, "name": "x"}}
    assert gpu_names(one_node) == {3: "GPU 1", 4: "GPU 3"}  # the legend said "GPU 4" for index 3
    two = {"3": {"node": "a", "index": 0, "name": "x"}, "9": {"node": "b", "index": 0, "name": "x"}}
    assert gpu_names(two) == {3: "GPU 0 (a)", 9: "GPU 0 (b)"}


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the plot as another user (nobody)")
@pytest.mark.timeout(120)
def test_a_plot_in_a_folder_the_user_cannot_search_is_one_line_not_a_traceback(tmp_path):
    # Path.exists() raised PermissionError there, before the write that would have said so.
    from tests.conftest import venv_reachable_by_everyone

    venv_reachable_by_everyone()
    base = Path(tempfile.mkdtemp(prefix="gpuqt-plot-"))
    try:
        base.chmod(0o755)
        closed = base / "closed"
        closed.mkdir(mode=0o700)
        code = ("import sys; from pathlib import Path; from gpuq.cli import plots; from gpuq.service.errors import "
                "InvalidSpec\ntry:\n    plots.job_plot([], Path(sys.argv[1]), 'job 1')\nexcept InvalidSpec as e:\n"
                "    print(e)")
        done = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable,
                               "-c", code, str(closed / "x.png")], capture_output=True, text=True, timeout=90,
                              cwd="/", env={"PATH": "/usr/bin:/bin", "MPLCONFIGDIR": "/tmp", "LANG": "C.UTF-8"})
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert done.stdout == f"cannot write the plot to {closed / 'x.png'}: Permission denied\n"
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def array_run(use_settings):
    """An array of four one-GPU tasks with a one-hour limit on testnode: tasks 0 and 1 succeeded in
    2 and 4 minutes (sampled at 80% and 40%), task 2 failed after 1 minute, task 3 waits. Returns
    the tasks' ids."""
    from gpuq.service import usage
    from gpuq.service.models import Job

    now = utcnow()
    runs = [(State.SUCCEEDED, 2, 80), (State.SUCCEEDED, 4, 40), (State.FAILED, 1, None), (State.PENDING, None, None)]
    ids = []
    with write_scope(use_settings) as s:
        gpu = add_gpu(s, "testnode", 0)
        for index, (state, minutes, util) in enumerate(runs):
            start = now - timedelta(minutes=10) if minutes else None
            job = Job(name=f"sweep[{index}]", user="ann", kind=c.KIND_COMMAND, argv=["true"], cwd="/", gpus=1,
                      state=state, node="testnode" if start else None, submitted_at=now - timedelta(minutes=10),
                      started_at=start, ended_at=start + timedelta(minutes=minutes) if start else None,
                      time_limit_s=3600, array_index=index, array_id=ids[0] if ids else None)
            s.add(job)
            s.flush()
            if not ids:
                job.array_id = job.id
            ids.append(job.id)
            if util is not None:
                add_samples(s, gpu, job.id, start, [util] * (minutes * 6), mem=1000 * (index + 1), step=10.0)
    with write_scope(use_settings) as s:
        for job_id, (_, minutes, _) in zip(ids, runs, strict=True):
            if minutes:
                usage.record_usage(s, job_id)
    return ids


def test_stats_of_an_array_sums_its_tasks_and_suggests_a_nearer_limit_once_they_all_ended(array_run, use_settings):
    first = array_run[0]
    data = json.loads(invoke("stats", "--array", str(first), "--json").output)
    assert (data["array_id"], data["name"], data["user"]) == (first, "sweep", "ann")
    assert (data["tasks"], data["started"]) == (4, 3)
    assert data["states"] == {"succeeded": 2, "failed": 1, "pending": 1}
    assert data["wall_longest_s"] == pytest.approx(240) and data["longest_task"] == array_run[1]
    assert data["utilization_mean"] == pytest.approx((80 * 12 + 40 * 24) / 36)
    assert data["memory_peak_mib"] == 2000 + 23 and data["memory_peak_task"] == array_run[1]
    assert [t["job_id"] for t in data["per_task"]] == array_run and "wall_s" not in data["per_task"][3]
    assert data["limit_hint"] is None  # task 3 has yet to run: it may need longer
    rows = list(csv.DictReader(io.StringIO(invoke("stats", "--array", str(first), "--csv").output)))
    assert [(r["index"], r["state"]) for r in rows] == [("0", "succeeded"), ("1", "succeeded"), ("2", "failed"),
                                                        ("3", "pending")]
    assert float(rows[1]["wall_s"]) == pytest.approx(240) and rows[3]["wall_s"] == ""
    # Once the last task ended, a limit nearer the longest successful run is suggested.
    from gpuq.service.models import Job

    with write_scope(use_settings) as s:
        s.get(Job, array_run[3]).state = State.CANCELLED
    text = invoke("stats", "--array", str(first)).output
    assert "tasks  4: 2 succeeded, 1 cancelled, 1 failed" in text
    assert "time limit  1:00:00  (the longest task used 7% of it)" in text
    assert text.strip().endswith("the longest successful task ran 4:00 of its 1:00:00 limit (7%): a limit nearer "
                                 "that (-t 0:06:00) lets the backfill start such jobs sooner")


def test_stats_of_one_job_gives_its_time_limit_and_the_share_it_used(array_run):
    job = json.loads(invoke("stats", str(array_run[0]), "--json").output)
    assert (job["time_limit_s"], job["time_used"]) == (3600, pytest.approx(120 / 3600))
    assert job["limit_hint"].startswith("it ran 2:00 of its 1:00:00 limit (3%)")
    text = invoke("stats", str(array_run[0])).output
    assert "time limit  1:00:00  (3% of it used)" in text and "(-t 0:03:00)" in text
    # A failed job gets no suggestion: an early failure says nothing of what it needs.
    failed = json.loads(invoke("stats", str(array_run[2]), "--json").output)
    assert failed["limit_hint"] is None and "lets the backfill" not in invoke("stats", str(array_run[2])).output


@pytest.mark.parametrize("args,code,words", [
    (["stats", "--array", "999"], c.EXIT_NOT_FOUND, "no array 999"),
    (["stats", "1", "--array", "1"], c.EXIT_USAGE, "give a job id or --array ID, not both"),
    (["stats", "--array", "1", "--plot", "x.png"], c.EXIT_USAGE, "--plot draws one job's samples"),
    (["stats", "--array", "1", "--rollup"], c.EXIT_USAGE, "--rollup does only the roll-up"),
])
def test_bad_array_stats_input_is_one_line_and_a_named_exit_code(use_settings, args, code, words):
    out = invoke(*args)
    assert out.exit_code == code and words in out.output and len(out.output.strip().splitlines()) == 1
