"""The CPU section of the server arguments: how many OpenMP threads a scheduler process runs, and which CPUs they
are bound to. ``server_args.py`` holds the fields; the front end applies the binding when it starts a scheduler
process (``runtime/scheduler_process.py``), through the OpenMP runtime's own environment (``OMP_PLACES``,
``OMP_PROC_BIND``), which torch's intra-op pool and the C++ kernels' read when they start.

Why bind by default: on 2 vCPUs of an AMD EPYC, the Engine's one-token request after 100 ms of idling took 13.5-15.6
ms with the threads unbound against 3.7-4.0 ms bound (back to back 1.2-2 ms either way; docs/performance.md). The
likely cause: threads free to float are woken onto one CPU after an idle spell, and one that spins at an OpenMP
barrier holds the CPU its partner waits for until the kernel preempts it. SGLang's and vLLM's CPU
backends bind each rank's threads too (``SGLANG_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

HELP = {
    "cpu_threads_per_rank": "torch threads per scheduler process when the device is the CPU (default: CPUs / "
    "scheduler processes on this node).",
    "cpu_omp_bind": "CPU: the CPUs each scheduler process's threads are bound to, one thread a CPU. auto: when "
    "the processes of this node share out exactly the CPUs this process may use (processes x --cpu-threads-per-rank "
    "= CPUs, as by default), each takes its own consecutive slice, else none is bound; an OMP_PLACES, "
    "OMP_PROC_BIND or GOMP_CPU_AFFINITY already set is left to rule. off: never bound. Or a list of CPUs per "
    "process of this node in rank order, '|' between processes: 0-3|4-7.",
}
# what the user may already have told the OpenMP runtime; auto leaves those alone
OMP_BINDING_ENV = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY")


def check(args: Any) -> None:
    """The flags' own sense; whether a list's CPUs are this process's to use is checked where the front end starts
    the processes (a scheduler process's own thread is bound by then)."""
    if args.cpu_threads_per_rank is not None and args.cpu_threads_per_rank <= 0:
        raise ValueError(f"cpu_threads_per_rank must be positive, got {args.cpu_threads_per_rank}")
    if args.cpu_omp_bind not in ("auto", "off"):
        explicit_cpus(args, check_allowed=False)


def explicit_cpus(args: Any, check_allowed: bool = True) -> list[list[int]]:
    """The CPU list of each scheduler process of this node that ``--cpu-omp-bind`` names."""
    text, processes = args.cpu_omp_bind, args.node_processes
    threads = args.cpu_threads
    entries = text.split("|")
    if len(entries) != processes:
        raise ValueError(
            f"cpu_omp_bind {text!r} names {len(entries)} CPU lists; this node runs {processes} scheduler "
            "process(es), one list each"
        )
    lists = [_cpu_list(entry, text) for entry in entries]
    allowed = _allowed_cpus() if check_allowed else None
    for i, cpus in enumerate(lists):
        if len(cpus) < threads:
            raise ValueError(
                f"cpu_omp_bind {text!r}: process {i} gets {len(cpus)} CPU(s) for its {threads} threads "
                "(--cpu-threads-per-rank)"
            )
        outside = sorted(set(cpus) - set(allowed)) if allowed is not None else []
        if outside:
            raise ValueError(
                f"cpu_omp_bind {text!r}: CPUs {outside} are not among this process's {allowed}"
            )
    return lists


def omp_binding(
    args: Any, world: int, world_rank: int, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment that binds the scheduler process of ``world_rank`` in ``world`` one thread a CPU; empty
    where its threads stay unbound. This node's processes count world by world, each world's ranks on this node
    in order."""
    environ = os.environ if environ is None else environ
    if args.device != "cpu" or args.cpu_omp_bind == "off":
        return {}
    index = world * args.ranks_per_node + world_rank - args.node_rank * args.ranks_per_node
    if args.cpu_omp_bind == "auto":
        if any(name in environ for name in OMP_BINDING_ENV):
            return {}
        allowed, threads = _allowed_cpus(), args.cpu_threads
        if args.node_processes * threads != len(allowed):
            return {}
        cpus = allowed[index * threads : (index + 1) * threads]
    else:
        cpus = explicit_cpus(args)[index][: args.cpu_threads]
    return {"OMP_PLACES": ",".join(f"{{{cpu}}}" for cpu in cpus), "OMP_PROC_BIND": "close"}


def describe_binding(environ: Mapping[str, str] | None = None) -> str:
    """What a scheduler process's start-up log says of its threads' CPUs."""
    environ = os.environ if environ is None else environ
    places = environ.get("OMP_PLACES")
    if places is None:
        return "not bound to CPUs (--cpu-omp-bind)"
    cpus = places.replace("{", "").replace("}", "")
    return (
        f"bound to CPUs {cpus} (OMP_PLACES, OMP_PROC_BIND={environ.get('OMP_PROC_BIND', 'unset')})"
    )


def _allowed_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _cpu_list(entry: str, text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]."""
    cpus: list[int] = []
    try:
        for part in entry.split(","):
            first, _, last = part.strip().partition("-")
            start, end = int(first), int(last or first)
            if start < 0 or end < start:
                raise ValueError
            cpus.extend(range(start, end + 1))
    except ValueError:
        raise ValueError(
            f"cpu_omp_bind {text!r}: {entry!r} is not a CPU list (as 0-3,8); expected auto, off or lists "
            "joined by '|'"
        ) from None
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu_omp_bind {text!r}: {entry!r} names a CPU twice")
    return cpus
