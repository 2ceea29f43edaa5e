"""The scheduling section of the server arguments: their help, and what ``--num-continuous-decode-steps`` comes
to on a rank. ``server_args.py`` holds the fields."""

from __future__ import annotations

from typing import Any

# runs end early when a command arrives, so a longer cap costs a waiting request nothing; it spreads each run's
# scheduling over more steps (mid MXFP4 at batch 1, one Engine alternating: 0.97 -> 0.91 ms a token against 8)
CPU_DECODE_STEPS = 32
# a run of steps in which a request streams (its tokens leave after the run) ends before its expected time passes
# this; so does every run where the rank cannot watch for arriving requests (one arriving meanwhile waits for it)
RUN_BUDGET_S = 0.02
HELP = {
    "chunked_prefill_size": "Longest prefill chunk of one request in tokens; <= 0 disables chunking. With "
    "--enable-dp-attention the total over the DP ranks (each gets its share).",
    "max_prefill_tokens": "Token budget of one prefill batch.",
    "schedule_policy": "Order of the waiting queue: fcfs (arrival) or sjf (shortest prompt first).",
    "schedule_conservativeness": "Scales how many future decode tokens admission reserves; 0 reserves none.",
    "stream_interval": "Stream outputs every this many decode tokens.",
    "num_continuous_decode_steps": "Decode steps run back to back without scheduling between them while no "
    "request waits (SGLang's flag): each step samples and appends as alone, a run ends early when a request "
    "finishes or a command arrives (a new request waits one step), and, while a request streams, before ~20 ms "
    "pass; its outputs leave after it. Spares each step's scheduling and batch building, and on the CPU runs "
    "greedy steps in one C++ call. "
    "Used on a rank that runs a whole model without speculation or PD; 1: off; default: "
    f"{CPU_DECODE_STEPS} on the CPU, 1 on GPUs.",
}


def check(args: Any) -> None:
    steps = args.num_continuous_decode_steps
    if steps is not None and steps < 1:
        raise ValueError(f"num_continuous_decode_steps must be >= 1, got {steps}")


def decode_steps(args: Any) -> int:
    """Decode steps a rank may run back to back: the flag's (by default ``CPU_DECODE_STEPS`` on the CPU, 1 on a
    GPU, where CUDA graphs already keep a step's host work small), where nothing needs the ranks or servers to step
    together or a step to hold other work (tensor / data parallelism, PD, speculation); else 1."""
    alone = args.tp_size == 1 and not args.enable_dp_attention
    plain = args.disaggregation_mode == "null" and args.speculative_algorithm is None
    steps = args.num_continuous_decode_steps
    if steps is None:
        steps = CPU_DECODE_STEPS if args.device == "cpu" else 1
    return steps if alone and plain else 1
