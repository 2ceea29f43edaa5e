"""Scheduler processes' threads bound to CPUs (``--cpu-omp-bind``, utils/cpu_flags.py): the slices ``auto`` gives
each process of a node, when it leaves the threads unbound, the lists a user names, and a real scheduler
process's threads on the CPUs it was given."""

from __future__ import annotations

import os

import pytest

from sglang_lite import Engine
from sglang_lite.server_args import ServerArgs
from sglang_lite.utils import cpu_flags


@pytest.fixture
def four_cpus(monkeypatch):
    monkeypatch.setattr(cpu_flags, "_allowed_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(os, "cpu_count", lambda: 4)


def _args(**fields) -> ServerArgs:
    return ServerArgs(load_format="dummy", skip_tokenizer_init=True, **fields)


def _places(*cpus: int) -> dict[str, str]:
    return {"OMP_PLACES": ",".join(f"{{{c}}}" for c in cpus), "OMP_PROC_BIND": "close"}


def test_auto_gives_each_process_of_the_node_its_own_slice(four_cpus):
    worlds = _args(dp_size=2, cpu_threads_per_rank=2)  # two worlds of one rank
    assert worlds.node_processes == 2
    assert cpu_flags.omp_binding(worlds, 0, 0, environ={}) == _places(0, 1)
    assert cpu_flags.omp_binding(worlds, 1, 0, environ={}) == _places(2, 3)
    ranks = _args(tp_size=4, cpu_threads_per_rank=1)  # one world of four ranks
    assert [cpu_flags.omp_binding(ranks, 0, r, environ={}) for r in range(4)] == [
        _places(c) for c in range(4)
    ]
    default = _args()  # the default threads share out every CPU
    assert cpu_flags.omp_binding(default, 0, 0, environ={}) == _places(0, 1, 2, 3)


def test_auto_counts_this_nodes_ranks_only(four_cpus):
    args = _args(
        tp_size=4, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:5000", cpu_threads_per_rank=2
    )
    assert args.ranks_per_node == 2
    assert cpu_flags.omp_binding(args, 0, 2, environ={}) == _places(0, 1)
    assert cpu_flags.omp_binding(args, 0, 3, environ={}) == _places(2, 3)


def test_auto_leaves_threads_unbound_where_it_cannot_share_out_the_cpus(four_cpus):
    fewer = _args(cpu_threads_per_rank=3)  # a CPU left free on purpose: another server may use it
    assert cpu_flags.omp_binding(fewer, 0, 0, environ={}) == {}
    more = _args(dp_size=2, cpu_threads_per_rank=4)
    assert cpu_flags.omp_binding(more, 0, 0, environ={}) == {}
    args = _args(cpu_threads_per_rank=4)
    for name in cpu_flags.OMP_BINDING_ENV:  # the user told the OpenMP runtime already
        assert cpu_flags.omp_binding(args, 0, 0, environ={name: "x"}) == {}
    assert cpu_flags.omp_binding(_args(cpu_threads_per_rank=4, cpu_omp_bind="off"), 0, 0, {}) == {}


def test_a_list_names_each_process_cpus(four_cpus):
    args = _args(dp_size=2, cpu_threads_per_rank=2, cpu_omp_bind="3,1|0-1")
    assert cpu_flags.omp_binding(args, 0, 0, environ={"OMP_PLACES": "x"}) == _places(3, 1)
    assert cpu_flags.omp_binding(args, 1, 0, environ={}) == _places(0, 1)
    wider = _args(cpu_threads_per_rank=2, cpu_omp_bind="0-3")  # the first CPUs, one a thread
    assert cpu_flags.omp_binding(wider, 0, 0, environ={}) == _places(0, 1)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(cpu_omp_bind="0-1"), r"names 1 CPU lists; this node runs 2 scheduler"),
        (dict(cpu_omp_bind="0-1|x"), r"'x' is not a CPU list"),
        (dict(cpu_omp_bind="0-1|3-2"), r"'3-2' is not a CPU list"),
        (dict(cpu_omp_bind="0,0|1,2"), r"'0,0' names a CPU twice"),
        (dict(cpu_omp_bind="0|1-2"), r"process 0 gets 1 CPU\(s\) for its 2 threads"),
    ],
)
def test_a_bad_list_is_one_error_naming_the_flag(four_cpus, fields, message):
    with pytest.raises(ValueError, match=r"cpu_omp_bind .*" + message):
        _args(dp_size=2, cpu_threads_per_rank=2, **fields)


def test_cpus_outside_this_process_are_refused_when_the_processes_start(four_cpus):
    args = _args(dp_size=2, cpu_threads_per_rank=2, cpu_omp_bind="0-1|2-9")
    with pytest.raises(ValueError, match=r"CPUs \[4, 5, 6, 7, 8, 9\] are not among this process's"):
        cpu_flags.omp_binding(args, 0, 0, environ={})


def _single_cpu_threads(pid: int) -> list[int]:
    """The CPU of each thread of ``pid`` allowed exactly one."""
    cpus = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as status:
            allowed = next(line for line in status if line.startswith("Cpus_allowed_list:"))
        value = allowed.split(":")[1].strip()
        if value.isdigit():
            cpus.append(int(value))
    return sorted(cpus)


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="reads threads' CPUs from Linux's /proc"
)
def test_a_scheduler_process_runs_its_threads_on_the_cpus_it_was_given():
    cpus = sorted(os.sched_getaffinity(0))[-2:]  # the last one or two this test may use
    bind = ",".join(map(str, cpus))
    with Engine(
        load_format="dummy",
        skip_tokenizer_init=True,
        max_total_tokens=256,
        cpu_threads_per_rank=len(cpus),
        cpu_omp_bind=bind,
    ) as engine:
        out = engine.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 2})
        assert len(out[0]["output_ids"]) == 2
        pid = engine._client.core.processes[0].pid
        # a thread on each (threads started after the runtime bound the main one share its CPU: ZMQ's)
        assert set(_single_cpu_threads(pid)) == set(cpus)
