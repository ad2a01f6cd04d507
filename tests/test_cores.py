"""CPU cores and host memory as a node's consumables on a real stack (`--cpus` and `--host-mem`
reserve them, GPUQ_NODE_CPUS and GPUQ_NODE_HOST_MEM_MIB say how much a node offers): a job waits for
its node's cores or memory while a GPU is free, a job reserving none starts beside, and one asking
more than any node offers is refused at submit and update."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import func, select

from gpuq.service import jobs
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.models import Gpu, Job
from tests.conftest import cli_submit, run_cli, stack_on_database, wait_for_state

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def two_cores(request, tmp_path_factory, redis_url):
    """Two simulated GPUs on a node that offers its jobs two CPU cores and 1 GiB of host memory."""
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=2, node_cpus=2,
                                 node_host_mem_mib=1024)


def _job(settings, job_id):
    with write_scope(settings) as session:
        return jobs.get_job(session, job_id)


def test_a_job_waits_for_its_nodes_cores_beside_a_free_gpu_and_starts_once_they_are_back(two_cores, tmp_path):
    s = two_cores.settings
    with write_scope(s) as session:  # what the workers reported: GPUQ_NODE_CPUS, GPUQ_NODE_HOST_MEM_MIB
        assert set(session.execute(select(Gpu.node_cpus, Gpu.node_host_mem_mib)).all()) == {(2, 1024)}
    hog = cli_submit(s, ["--cpus", "2", "-t", "5m", "--", "sh", "-c", "while [ ! -e go ]; do sleep 0.1; done"],
                     cwd=tmp_path)
    assert wait_for_state(s, hog, (State.RUNNING,)) == State.RUNNING
    waits = cli_submit(s, ["--cpus", "1", "-t", "5m", "--", "echo", "waited"], cwd=tmp_path)
    beside = cli_submit(s, ["-t", "1m", "--", "echo", "beside"], cwd=tmp_path)
    # The job reserving a core waits for one, pass after pass, the free GPU kept for it from the
    # moment the first job's limit frees its cores; a job reserving none that ends before then
    # backfills there.
    assert wait_for_state(s, beside, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, two_cores.logs()
    time.sleep(2.0)  # four scheduler passes
    assert _job(s, waits).state == State.PENDING
    why = run_cli(["why", str(waits)], s).stdout
    assert "needs 1 GPU and 1 CPU core (--cpus)" in why, why
    assert "node testnode has 0 of its 2 CPU cores free for jobs (1 running job reserves the rest)" in why, why
    for command in ("devices", "status"):
        assert "node testnode: 2 of its 2 CPU cores reserved by jobs (--cpus)" in run_cli([command], s).stdout
    assert {g["node_cpus_reserved"] for g in json.loads(run_cli(["status", "--json"], s).stdout)["gpus"]} == {2.0}
    listed = json.loads(run_cli(["devices", "--json"], s).stdout)
    assert {(d["node_cpus"], d["node_cpus_reserved"], d["node_host_mem_mib"]) for d in listed} == {(2, 2.0, 1024)}

    (tmp_path / "go").touch()
    assert wait_for_state(s, waits, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, two_cores.logs()
    assert _job(s, waits).started_at >= _job(s, hog).ended_at


def test_cpus_past_what_any_node_offers_is_refused_at_submit_and_update_in_one_line(two_cores, tmp_path):
    s = two_cores.settings

    def count() -> int:
        with write_scope(s) as session:
            return session.scalar(select(func.count()).select_from(Job)) or 0

    before = count()
    refused = run_cli(["submit", "--cpus", "3", "--", "true"], s, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        "gpuq: --cpus 3 is more CPU cores than node testnode offers jobs (2; GPUQ_NODE_CPUS): it would never start"]
    assert count() == before

    held = cli_submit(s, ["--hold", "--cpus", "1", "--", "true"], cwd=tmp_path)
    refused = run_cli(["update", str(held), "--cpus", "2.5"], s)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "--cpus 2.5 is more CPU cores than node testnode offers" in refused.stderr
    assert _job(s, held).cpus == 1
    assert run_cli(["update", str(held), "--cpus", "2"], s).returncode == 0
    assert _job(s, held).cpus == 2
    run_cli(["cancel", str(held)], s)


def test_a_job_waits_for_its_nodes_host_memory_and_starts_once_it_is_back(two_cores, tmp_path):
    s = two_cores.settings
    hog = cli_submit(s, ["--host-mem", "768M", "-t", "5m", "--", "sh", "-c",
                         "while [ ! -e free ]; do sleep 0.1; done"], cwd=tmp_path)
    assert wait_for_state(s, hog, (State.RUNNING,)) == State.RUNNING
    waits = cli_submit(s, ["--host-mem", "512M", "-t", "5m", "--", "echo", "waited"], cwd=tmp_path)
    time.sleep(2.0)  # four scheduler passes, a GPU free all along
    assert _job(s, waits).state == State.PENDING
    why = run_cli(["why", str(waits)], s).stdout
    assert "needs 1 GPU and 0.5 GiB of host memory (--host-mem)" in why, why
    assert "node testnode has 0.2 GiB of its 1.0 GiB of host memory free for jobs (1 running job reserves" in why
    assert "node testnode: 768 of its 1024 MiB of host memory reserved by jobs (--host-mem)" in run_cli(
        ["devices"], s).stdout

    (tmp_path / "free").touch()
    assert wait_for_state(s, waits, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, two_cores.logs()
    assert _job(s, waits).started_at >= _job(s, hog).ended_at

    refused = run_cli(["submit", "--host-mem", "2G", "--", "true"], s, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "gpuq: --host-mem 2048 MiB is more MiB of host memory than node testnode offers jobs (1024; "
        "GPUQ_NODE_HOST_MEM_MIB): it would never start"]


def test_host_mem_per_gpu_gives_a_command_without_host_mem_its_limit_and_reservation(tmp_path):
    from dataclasses import replace

    from gpuq.service import constants as c
    from gpuq.service.spec import command_spec
    from gpuq.service.submitting import _with_default_host_mem
    from tests.conftest import make_settings

    settings = make_settings(tmp_path, "sqlite://", "redis://", host_mem_per_gpu_mib=4096)
    bare, asked = command_spec(["true"], gpus=2, cwd="/"), replace(command_spec(["true"], cwd="/"), host_mem_mib=512)
    workload = replace(bare, kind=c.KIND_WORKLOAD)
    assert [s.host_mem_mib for s in _with_default_host_mem(settings, [bare, asked, workload])] == [8192, 512, None]
    assert _with_default_host_mem(settings.with_overrides(host_mem_per_gpu_mib=0), [bare]) == [bare]


@pytest.mark.parametrize("name, value", [("GPUQ_HOST_MEM_PER_GPU_MIB", "-1"), ("GPUQ_NODE_HOST_MEM_MIB", "-5"),
                                         ("GPUQ_NODE_CPUS", "5000")])
def test_a_node_offer_or_per_gpu_default_out_of_range_is_refused_naming_the_setting(name, value):
    from gpuq.service.errors import ConfigError
    from gpuq.service.settings import load_settings

    with pytest.raises(ConfigError, match=rf"^setting {name[5:].lower()} must (not be negative|be between 0 )"):
        load_settings({name: value, "GPUQ_CONFIG": "/nonexistent/gpuq.toml"})


def test_update_changes_a_pending_commands_host_mem_within_what_its_node_offers(two_cores, tmp_path):
    s = two_cores.settings
    held = cli_submit(s, ["--hold", "--host-mem", "256M", "--", "true"], cwd=tmp_path)
    out = run_cli(["update", str(held), "--host-mem", "512M"], s)
    assert (out.returncode, out.stdout) == (0, f"job {held}: host memory 256M → 512M\n"), out.stderr
    assert _job(s, held).host_mem_mib == 512
    refused = run_cli(["update", str(held), "--host-mem", "2G"], s)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "gpuq: --host-mem 2048 MiB is more MiB of host memory than node testnode offers jobs (1024; "
        "GPUQ_NODE_HOST_MEM_MIB): it would never start"]
    out = run_cli(["update", str(held), "--host-mem", "none"], s)
    assert (out.returncode, out.stdout) == (0, f"job {held}: host memory 512M → none\n"), out.stderr
    assert _job(s, held).host_mem_mib is None
    workload = cli_submit(s, ["--hold", "matmul", "--size", "64"], cwd=tmp_path)
    refused = run_cli(["update", str(workload), "--host-mem", "128M"], s)
    assert refused.returncode == 4 and refused.stderr == (
        f"gpuq: job {workload} is a built-in workload: --host-mem holds a command's processes\n")
    assert run_cli(["cancel", str(held), str(workload)], s).returncode == 0
