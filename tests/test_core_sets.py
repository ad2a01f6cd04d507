"""Which CPU cores a job with --cpus is bound to (service/core_sets.py, pure), and the node's record
its workers keep of them together (workers/core_binding.py, a real file under a real flock, real
processes)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import settings as examples
from hypothesis import strategies as st

from gpuq.service import core_sets
from gpuq.service.devices import SimulatedDevices, parse_cores
from gpuq.service.errors import ConfigError, InvalidSpec
from gpuq.workers import core_binding
from tests.conftest import make_settings, settings_env

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def settings(tmp_path):
    """A stack's settings: only its home is used (the record lives there)."""
    return make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'gpuq.db'}", "redis://127.0.0.1:1/0")


def test_a_fraction_of_a_core_is_bound_to_the_whole_core_it_rounds_up_to():
    assert [core_sets.cores_for(c) for c in (0.5, 1, 1.5, 2, 2.0000000001, 16)] == [1, 1, 2, 2, 2, 16]


def test_free_cores_come_before_held_ones_and_near_ones_before_far_ones():
    held = Counter({0: 1, 1: 1})
    assert core_sets.choose(2, range(8), held) == (2, 3)
    assert core_sets.choose(2, range(8), held, near={5, 6, 7}) == (5, 6)
    # A free core far from the GPUs beats a near one another job holds.
    assert core_sets.choose(2, range(4), held, near={0, 1, 3}) == (2, 3)
    # Only where none is free are held ones shared: the least held first.
    assert core_sets.choose(3, range(4), Counter({0: 2, 1: 1, 2: 1, 3: 1})) == (1, 2, 3)


def test_a_job_asking_as_many_cores_as_the_worker_may_use_or_more_gets_them_all():
    assert core_sets.choose(4, [3, 1, 2], Counter()) == (1, 2, 3)
    assert core_sets.choose(3, [3, 1, 2], Counter({1: 5})) == (1, 2, 3)


@examples(max_examples=300, deadline=None)
@given(count=st.integers(1, 20), available=st.sets(st.integers(0, 63), min_size=1, max_size=24),
       held=st.dictionaries(st.integers(0, 63), st.integers(1, 3)), near=st.sets(st.integers(0, 63)))
def test_a_choice_is_that_many_distinct_available_cores_none_held_while_a_free_one_is_passed_over(
        count, available, held, near):
    chosen = core_sets.choose(count, available, Counter(held), near)
    assert len(chosen) == min(count, len(available)) == len(set(chosen))
    assert set(chosen) <= available and list(chosen) == sorted(chosen)
    left = available - set(chosen)
    for core in chosen:  # nothing left out was strictly better than a core taken
        assert not any((held.get(o, 0), o not in near) < (held.get(core, 0), core not in near) for o in left)


@given(st.sets(st.integers(0, 300)))
def test_a_core_list_reads_back_as_written(cores):
    text = core_sets.format_list(cores)
    assert core_sets.parse_list(text) == cores if cores else text == ""


def test_core_lists_are_written_as_linux_writes_them():
    assert core_sets.format_list([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    assert core_sets.parse_list("0-3, 8,10-11") == {0, 1, 2, 3, 8, 10, 11}


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-", "-2", "1,,2", "0x3"])
def test_a_list_that_is_not_one_of_cores_is_refused(text):
    with pytest.raises(InvalidSpec, match="is not a list of CPU cores"):
        core_sets.parse_list(text)


def test_nvmls_cpu_mask_words_give_the_gpus_cores():
    assert core_sets.from_mask([0b1011, 0]) == {0, 1, 3}
    assert core_sets.from_mask([0, 1 << 63, 3]) == {127, 128, 129}


def test_simulated_gpus_have_the_near_cores_their_setting_gives_and_none_past_its_lists(tmp_path):
    gpus = SimulatedDevices(3, 1024, "n1", cores="0-15 16-31").list()
    assert [g.cores for g in gpus] == [frozenset(range(16)), frozenset(range(16, 32)), frozenset()]
    with pytest.raises(ConfigError, match="fake_gpu_cores takes a list of CPU cores for each GPU"):
        parse_cores("0-15,x", 2)


# The node's record, shared by its workers.


def _entries(settings_obj):
    return json.loads(core_binding.record_path(settings_obj, "n1").read_text())


def test_a_taken_binding_is_in_the_nodes_record_until_it_is_let_go_and_the_next_takes_other_cores(settings):
    workable = len(os.sched_getaffinity(0))
    if workable < 2:
        pytest.skip("needs two cores the tests may run on")
    with core_binding.bound(settings, "n1", 7, 1) as first:
        assert first is not None and len(first.cores) == 1 and first.own
        assert [(e["job"], e["cores"]) for e in _entries(settings)] == [(7, list(first.cores))]
        with core_binding.bound(settings, "n1", 8, 1) as second:
            assert second is not None and second.own and set(second.cores).isdisjoint(first.cores)
        # All the cores the worker may use, and one of them held: not its own.
        with core_binding.bound(settings, "n1", 9, workable) as third:
            assert third is not None and not third.own and len(third.cores) == workable
    assert _entries(settings) == []
    # Another node's record is its own.
    with core_binding.bound(settings, "n1", 7, 1) as here, core_binding.bound(settings, "n2", 8, 1) as there:
        assert here is not None and there is not None and here.cores == there.cores


def test_no_binding_without_cpus_or_with_cpu_bind_none(settings):
    with core_binding.bound(settings, "n1", 7, None) as unasked:
        assert unasked is None
    with core_binding.bound(dataclasses.replace(settings, cpu_bind="none"), "n1", 7, 1) as off:
        assert off is None
    assert not core_binding.record_path(settings, "n1").exists()


def test_held_by_cores_alone_needs_as_many_as_asked_and_none_shared():
    assert core_binding.held_by(core_binding.Binding(1, (0, 1), own=True, mark="m"), 2)
    assert not core_binding.held_by(core_binding.Binding(1, (0, 1), own=True, mark="m"), 1.5)
    assert not core_binding.held_by(core_binding.Binding(1, (0, 1), own=False, mark="m"), 2)
    assert not core_binding.held_by(None, 2)


def test_the_cores_of_a_worker_that_is_gone_are_free_for_the_next_job(settings):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores the tests may run on")
    # A worker (a real process) takes a core and is SIGKILLed holding it.
    code = ("import os; from gpuq.service.settings import get_settings; from gpuq.workers import core_binding;"
            "b = core_binding.take(get_settings(), 'n1', 5, 1, near={1}); print(b.cores[0], flush=True);"
            "os.kill(os.getpid(), 9)")
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                          env=settings_env(settings))
    assert dead.returncode == -9, dead.stderr
    gone_core = int(dead.stdout)
    assert gone_core == 1 and [e["job"] for e in _entries(settings)] == [5]
    # The next worker finds it gone, drops its entry and takes that core as free.
    with core_binding.bound(settings, "n1", 6, 1, near={1}) as b:
        assert b is not None and b.cores == (1,) and b.own
        assert [e["job"] for e in _entries(settings)] == [6]


def _take_one(settings_obj, job: int, out) -> None:
    out.put(core_binding.take(settings_obj, "n1", job, 1).cores)


def test_workers_taking_cores_at_once_each_get_their_own(settings):
    workable = len(os.sched_getaffinity(0))
    if workable < 2:
        pytest.skip("needs two cores the tests may run on")
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_take_one, args=(settings, job, out)) for job in range(workable)]
    for p in procs:
        p.start()
    got = [out.get(timeout=20) for _ in procs]
    for p in procs:
        p.join(20)
    # Each took its core under the lock: all different, though they asked at once (the takers are
    # gone now, so nothing is left held).
    assert sorted(c for cores in got for c in cores) == sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("name, value, says", [
    ("GPUQ_CPU_BIND", "socket", "setting cpu_bind must be cores or none (whether a command with --cpus runs on "
                                "cores of its own), got 'socket'"),
    ("GPUQ_FAKE_GPU_CORES", "0-15 16-x", "setting fake_gpu_cores takes a list of CPU cores for each GPU, separated "
                                         "by spaces (as 0-15 16-31): '16-x' is not a list of CPU cores"),
])
def test_a_cpu_bind_or_simulated_cores_setting_that_is_not_one_is_refused_naming_it(name, value, says):
    from gpuq.service.settings import load_settings

    with pytest.raises(ConfigError) as refused:
        load_settings({name: value, "GPUQ_CONFIG": "/nonexistent/gpuq.toml"})
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value), refused.value


def test_entries_that_are_not_a_live_workers_are_dropped_and_a_record_that_is_not_json_is_started_afresh(settings):
    path = core_binding.record_path(settings, "n1")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps([{"job": 1, "cores": [0], "pid": "x"}, {"job": 2, "cores": "0", "pid": os.getpid()},
                                {"job": 3, "cores": [0], "pid": 0, "since": None}, 7]))
    with core_binding.bound(settings, "n1", 4, 1, near={0}) as b:
        assert b is not None and b.cores == (0,) and b.own and [e["job"] for e in _entries(settings)] == [4]
    path.write_text("{not json")
    with core_binding.bound(settings, "n1", 5, 1, near={0}) as b:
        assert b is not None and b.cores == (0,) and [e["job"] for e in _entries(settings)] == [5]
