"""`gpuq retire NODE [--gpu I]`: an admin takes GPUs whose workers are gone for good (compose, a
`gpuq worker` by hand, a node taken out) off gpuq's lists, so that they are neither listed offline
for ever nor counted among a node's GPUs; never a GPU with a live worker or a job."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from gpuq.service import constants as c
from gpuq.service import inventory
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec, StateConflict
from gpuq.service.models import Allocation, Gpu, utcnow
from tests.conftest import run_cli, stack_on_database
from tests.test_scheduling import register, submit

pytestmark = pytest.mark.timeout(120)


def _silent(settings, gpu_ids):
    """Their workers last beat long ago: lost, as a worker that is gone for good."""
    with write_scope(settings) as session:
        session.execute(update(Gpu).where(Gpu.id.in_(gpu_ids)).values(heartbeat_at=utcnow() - timedelta(hours=1)))


def _listed(settings, node):
    with write_scope(settings) as session:
        return sorted(session.scalars(select(Gpu.index).where(Gpu.node == node, Gpu.retired_at.is_(None))))


def test_only_gpus_without_a_live_worker_or_a_job_are_retired_and_a_worker_brings_one_back(settings):
    ids = register(settings, "a", 3)
    with write_scope(settings) as session, pytest.raises(StateConflict, match="GPU 0 of node a has a live worker"):
        inventory.retire(session, settings, "a")
    _silent(settings, ids)
    with write_scope(settings) as session:  # a job's GPU stays its own until it ends
        session.add(Allocation(gpu_id=ids[2], job_id=submit(settings, hold=True), rank=0))
    for indices, error, says in ((None, StateConflict, "GPU 2 of node a holds job"),
                                 ([1, 7], InvalidSpec, "node a has no GPU 7 (its GPUs: 0, 1, 2)")):
        with write_scope(settings) as session, pytest.raises(error, match=re.escape(says)):
            inventory.retire(session, settings, "a", indices)
        assert _listed(settings, "a") == [0, 1, 2]  # refused whole: nothing retired
    for node, says in (("zz", "no node zz with GPUs"), (" ", "give the node's name")):
        with write_scope(settings) as session, pytest.raises(InvalidSpec, match=says):
            inventory.retire(session, settings, node)
    with write_scope(settings) as session:
        assert inventory.retire(session, settings, "a", [1, 0]) == [0, 1]
    assert _listed(settings, "a") == [2]
    # No longer counted: a node of one GPU now, as a submit checks it (this node's own has 2).
    with pytest.raises(InvalidSpec, match="--gpus 3 is more than any node has"):
        submit(settings, gpus=3)
    register(settings, "a", 1)  # GPU 0's worker starts again
    assert _listed(settings, "a") == [0, 2]


@pytest.fixture(scope="module", params=["sqlite"])
def one_gpu(request, tmp_path_factory, redis_url):
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=1)


def test_gpuq_retire_takes_a_gone_nodes_gpus_off_status_and_refuses_a_live_one_in_one_line(one_gpu):
    s = one_gpu.settings
    _silent(s, register(s, "gone", 2))
    done = run_cli(["retire", "gone"], s)
    assert (done.returncode, done.stdout) == (0, "retired GPUs 0,1 of node gone: no longer listed or counted; a "
                                                 "worker that starts on one brings it back\n"), done
    assert {g["node"] for g in json.loads(run_cli(["status", "--json"], s).stdout)["gpus"]} == {s.node}
    for args, code, says in ((["retire", s.node], c.EXIT_CONFLICT, f"GPU 0 of node {s.node} has a live worker"),
                             (["retire", "gone"], c.EXIT_USAGE, "no node gone with GPUs is known to gpuq"),
                             (["retire", s.node, "--gpu", "-1"], c.EXIT_USAGE, "")):
        refused = run_cli(args, s)
        assert (refused.returncode, refused.stderr.count("\n")) == (code, 1) and says in refused.stderr, refused
    assert _listed(s, s.node) == [0]
