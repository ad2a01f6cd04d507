"""`--gpu-type` (sbatch's --gpus a100:2): a lab's nodes hold several models of GPU, and a job that
asked for one runs on that model only, whole or shared, never on a model whose name merely
contains its letters (an A10 is no A100); a type no GPU is, or more of it than a node has, is
refused at submit with the models there are. The policy alone, then over SQL through the CLI."""

from __future__ import annotations

import json
import math

import pytest
from sqlalchemy import select, update

from gpuq.service import constants as c
from gpuq.service.db import write_scope
from gpuq.service.explain import why
from gpuq.service.models import Allocation, Gpu
from gpuq.service.next_up_choice import choose as next_up
from gpuq.service.policy import PRIORITY, RESOURCES, GpuState, JobRequest, QueueState, decide, is_model
from gpuq.service.scheduler import Scheduler
from tests.conftest import run_cli
from tests.test_policy_sharing import shares
from tests.test_scheduling import register, state_of, submit

pytestmark = pytest.mark.timeout(120)

NOW = 1_000_000.0
A100, RTX, A10 = "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 3090", "NVIDIA A10"


@pytest.mark.parametrize("model,gpu_type,expected", [
    (A100, "a100", True), (A100, "A100", True), (A100, "a100-sxm4", True), (A100, "80gb", True),
    (A100, "a10", False), (A10, "a100", False), (A10, "a10", True), (RTX, "3090", True), (RTX, "rtx3090", True),
    (RTX, "RTX 3090", True), (RTX, "rtx", True), (RTX, "309", False), ("NVIDIA H100 80GB HBM3", "h100", True),
    ("Simulated GPU", "a100", False)])
def test_a_type_is_whole_consecutive_words_of_the_gpus_name(model, gpu_type, expected):
    assert is_model(model, gpu_type) is expected


def gpu(gpu_id, model, node="a", shared_mib=0, shared_jobs=0, busy=None):
    return GpuState(id=gpu_id, node=node, index=gpu_id, queue=f"q{gpu_id}", memory_total_mib=81920, model=model,
                    shares=shares(shared_mib, shared_jobs, None), busy_until=busy)


def job(job_id, gpu_type=None, gpus=1, mem=None, shared=False, limit=None):
    return JobRequest(id=job_id, user="u", gpus=gpus, submitted=job_id, gpu_type=gpu_type, mem_mib=mem,
                      shared=shared, time_limit_s=limit)


def test_a_typed_job_takes_its_model_only_and_one_behind_it_of_another_shape_is_not_held_up():
    gpus = [gpu(1, RTX), gpu(2, A10), gpu(3, A100, node="b")]
    queue = [job(1, "a100"), job(2, "a100"), job(3, "rtx3090"), job(4), job(5, "A100")]
    d = decide(QueueState(NOW, queue, gpus))
    # No time limits to reserve by: job 2 keeps the A100s for itself (job 5 waits behind it), and the
    # GPUs it could never use stay open to the jobs behind it.
    assert {p.job_id: [g.id for g in p.gpus] for p in d.placements} == {1: [3], 3: [1], 4: [2]}
    assert d.waiting == {2: RESOURCES, 5: PRIORITY}
    # With every GPU busy, it is listed next on a GPU of its type only.
    busy = QueueState(NOW, [job(5, "a100"), job(6)], [gpu(1, RTX, busy=NOW + 60), gpu(3, A100, busy=NOW + 60)])
    assert next_up(busy, decide(busy), 2, 10) == {3: [5, 6], 1: [6]}


def test_a_typed_shared_job_packs_onto_its_model_only():
    gpus = [gpu(1, RTX, shared_mib=4096, shared_jobs=1), gpu(2, A100)]
    d = decide(QueueState(NOW, [job(1, "a100", mem=4096, shared=True), job(2, "3090", mem=4096, shared=True)], gpus))
    assert {p.job_id: [g.id for g in p.gpus] for p in d.placements} == {1: [2], 2: [1]}


def test_a_typed_gang_waits_for_enough_gpus_of_its_model_on_one_node():
    gpus = [gpu(1, A100), gpu(2, RTX), gpu(3, A100, node="b")]
    d = decide(QueueState(NOW, [job(1, "a100", gpus=2)], gpus))
    assert d.placements == [] and d.waiting == {1: RESOURCES}


def test_a_reservation_behind_a_typed_job_that_waits_unprotected_counts_none_of_its_gpus():
    # Job 1 needs both A100s, one busy with no time limit: no reservation can protect it, so they are
    # kept for it. Job 2 needs 2 GPUs of any model: the A100 that frees in 100 s is job 1's, not its,
    # so it counts on the RTX that frees in 1000 s; job 3, done in 500 s, may use the free RTX meanwhile.
    gpus = [gpu(1, A100, busy=math.inf), gpu(2, A100, busy=NOW + 100), gpu(3, RTX, busy=NOW + 1000), gpu(4, RTX)]
    d = decide(QueueState(NOW, [job(1, "a100", gpus=2), job(2, gpus=2), job(3, limit=500)], gpus))
    assert d.reservation is not None and (d.reservation.job_id, d.reservation.start) == (2, NOW + 1000)
    assert d.reservation.gpu_ids == {3, 4}
    assert {p.job_id: [g.id for g in p.gpus] for p in d.placements} == {3: [4]}
    assert d.waiting == {1: RESOURCES, 2: RESOURCES}


def rename(settings, names: dict[int, str]) -> None:
    with write_scope(settings) as session:
        for gpu_id, name in names.items():
            session.execute(update(Gpu).where(Gpu.id == gpu_id).values(name=name))


@pytest.fixture
def settings(settings):
    return settings.with_overrides(place_at_submit=False)


def test_over_sql_a_typed_job_is_placed_on_its_model_and_waits_while_only_others_are_free(settings):
    rtx, a100 = register(settings, "a", 2)
    rename(settings, {rtx: RTX, a100: A100})
    first = submit(settings, gpu_type="a100")
    second = submit(settings, gpu_type="A100")
    anything = submit(settings)
    Scheduler(settings).schedule_once()
    assert state_of(settings, first)[0] == "dispatched" and state_of(settings, anything)[0] == "dispatched"
    assert state_of(settings, second)[:2] == ("pending", RESOURCES)
    with write_scope(settings) as session:
        placed = {j: session.get(Gpu, g).name for j, g in session.execute(select(Allocation.job_id, Allocation.gpu_id))}
    assert placed == {first: A100, anything: RTX}
    with write_scope(settings) as session:
        said = why(session, settings, second)
    # The A100 is busy; the RTX, another model, is not said to be one it could have.
    assert "it needs 1 GPU of type A100 on one node" in said and f"GPU 1 runs job {first} of ann" in said, said
    assert "GPU 0" not in said, said


def test_a_type_no_gpu_is_or_too_many_of_it_are_refused_at_submit_naming_the_models(use_settings):
    s = use_settings
    rtx, a100 = register(s, s.node, 2)  # this node's: its simulated GPUs are these two
    rename(s, {rtx: RTX, a100: A100})
    for args, says in (
            (["--gpu-type", "h100"], "--gpu-type h100: no GPU is one (gpuq's GPUs: NVIDIA A100-SXM4-80GB (1), "
                                     "NVIDIA GeForce RTX 3090 (1))"),
            (["--gpu-type", "a10"], "--gpu-type a10: no GPU is one"),
            (["--gpu-type", "a100", "--gpus", "2"], "--gpus 2 is more than any node has of --gpu-type a100 (the "
                                                    f"most, {s.node}, has 1)"),
            (["--gpu-type", "a100;rm"], "--gpu-type takes a GPU model"),
            (["--gpus", "a100:2"], "--gpus 2 is more than any node has of --gpu-type a100"),  # sbatch's TYPE:COUNT
            (["--gpus", "a100:1", "--gpu-type", "rtx"], "--gpus a100:1 and --gpu-type rtx name two GPU types"),
            (["--gpus", "a100:"], "'a100:' is not a GPU count: give COUNT (2) or TYPE:COUNT (a100:2)")):
        out = run_cli(["submit", *args, "--", "true"], s)
        assert (out.returncode, out.stdout) == (c.EXIT_USAGE, ""), out
        assert says in out.stderr and out.stderr.count("\n") == 1, out.stderr
    made = json.loads(run_cli(["submit", "--json", "--hold", "--gpu-type", "rtx 3090", "--", "true"], s).stdout)
    assert made["gpu_type"] == "rtx 3090"
    assert "GPU type rtx 3090" in run_cli(["show", str(made["id"])], s).stdout
    line = next(ln for ln in run_cli(["status"], s).stdout.splitlines() if ln.lstrip().startswith(str(made["id"])))
    assert "  1 rtx 3090  " in line, line  # the GPUS column, as squeue's TRES gives gpu:a100:1
    typed = json.loads(run_cli(["submit", "--json", "--hold", "--gpus", "A100:1", "--gpu-type", "a100", "--", "true"],
                               s).stdout)
    assert (typed["gpus"], typed["gpu_type"]) == (1, "a100")  # the same type, as --gpu-type wrote it


@pytest.fixture(scope="module", params=["sqlite"])
def two_models(request, tmp_path_factory, redis_url):
    """A stack whose node holds an A100 (GPU 0) and an RTX 3090 (GPU 1): simulated GPUs named as
    NVML names them (GPUQ_FAKE_GPU_NAMES)."""
    from tests.conftest import stack_on_database

    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpu_names=f"{A100},{RTX}")


def test_on_a_node_of_two_models_each_typed_job_runs_on_its_model_and_devices_name_them(two_models):
    from tests.conftest import wait_for_state

    s = two_models.settings
    listed = json.loads(run_cli(["devices", "--json"], s).stdout)
    assert [(d["index"], d["name"]) for d in listed] == [(0, A100), (1, RTX)]
    ids = {}
    for args in (["--gpu-type", "rtx3090"], ["--gpus", "a100:1"], ["--gpu-type", "3090"]):
        out = run_cli(["submit", "--json", *args, "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES; sleep 1"], s)
        assert out.returncode == 0, out.stderr
        ids[tuple(args)] = json.loads(out.stdout)["id"]
    ran_on = {}
    for args, job_id in ids.items():
        assert wait_for_state(s, job_id, c.END_STATES) == c.State.SUCCEEDED
        ran_on[args] = run_cli(["logs", str(job_id)], s).stdout.strip()
    # Each on its model's worker; the second RTX job waited for GPU 1 while GPU 0 was free.
    assert ran_on == {("--gpu-type", "rtx3090"): "1", ("--gpus", "a100:1"): "0", ("--gpu-type", "3090"): "1"}
    refused = run_cli(["submit", "--gpu-type", "h100", "--", "true"], s)
    assert refused.returncode == c.EXIT_USAGE
    assert f"no GPU is one (gpuq's GPUs: {A100} (1), {RTX} (1))" in refused.stderr, refused.stderr
