"""The stream plan's truth table: platform x flags x fusion x capture x batch size."""

from __future__ import annotations

import itertools

import pytest

from sglang_lite.streams.plan import StreamFlags, choose_overlap_per_batch_size, decide_stream_plan

PLATFORMS = ("cuda", "rocm", "cpu")
THRESHOLD = 1024


def all_cases():
    for (
        platform,
        alt,
        gdn,
        qk,
        eager,
        disable_fusion,
        supported,
        capturing,
        tokens,
    ) in itertools.product(
        PLATFORMS,
        (False, True),
        (False, True),
        (None, False, True),
        (False, True),
        (False, True),
        (False, True),
        (False, True),
        (1, THRESHOLD - 1, THRESHOLD),
    ):
        flags = StreamFlags(
            alt_stream=alt, gdn_qkvz_ba=gdn, qk_norm=qk, eager=eager, gdn_max_tokens=THRESHOLD
        )
        plan = decide_stream_plan(platform, flags, disable_fusion, supported, capturing, tokens)
        yield (
            dict(
                platform=platform,
                flags=flags,
                disable_fusion=disable_fusion,
                supported=supported,
                capturing=capturing,
                tokens=tokens,
            ),
            plan,
        )


CASES = list(all_cases())


def test_truth_table_size():
    assert len(CASES) == 3 * 2 * 2 * 3 * 2 * 2 * 2 * 2 * 3


def test_plan_rules_over_the_whole_table():
    for case, plan in CASES:
        check_rules(case, plan)


def check_rules(case, plan):
    platform, flags = case["platform"], case["flags"]
    alt = platform == "cuda" or (platform == "rocm" and flags.alt_stream)
    assert plan.alt_stream == alt
    active = alt and (case["capturing"] or flags.eager)
    fusion = case["supported"] and not case["disable_fusion"]
    assert plan.shared_experts_fusion == fusion
    # GDN and QK norm, as upstream: always on CUDA, by their own flags (default off) on ROCm; GDN only under the
    # token threshold
    on_cuda = platform == "cuda"
    assert plan.gdn_qkvz_ba == (
        active and (on_cuda or flags.gdn_qkvz_ba) and case["tokens"] < THRESHOLD
    )
    assert plan.qk_norm == (active and (on_cuda or bool(flags.qk_norm)))
    # the fused q/k kernel: on ROCm whenever the norms do not overlap; never elsewhere
    assert plan.fused_qk_norm == (platform == "rocm" and not plan.qk_norm)
    # MoE overlap never together with shared-expert fusion
    assert plan.moe_shared_routed == (active and not fusion)


def test_named_rows():
    off = StreamFlags()
    cuda_decode = decide_stream_plan("cuda", off, False, False, capturing=True, num_tokens=8)
    assert (cuda_decode.qk_norm, cuda_decode.moe_shared_routed, cuda_decode.gdn_qkvz_ba) == (
        True,
        True,
        True,
    )
    cuda_off_flags = decide_stream_plan(
        "cuda", StreamFlags(qk_norm=False), False, False, capturing=True, num_tokens=8
    )
    assert (
        cuda_off_flags.qk_norm and cuda_off_flags.gdn_qkvz_ba
    )  # the flags are ROCm's; CUDA always overlaps
    rocm_default = decide_stream_plan("rocm", off, False, True, capturing=True, num_tokens=8)
    assert (
        not rocm_default.any_overlap
        and rocm_default.fused_qk_norm
        and rocm_default.shared_experts_fusion
    )
    rocm_on = decide_stream_plan(
        "rocm", StreamFlags(alt_stream=True, gdn_qkvz_ba=True), True, True, True, 8
    )
    assert (
        rocm_on.gdn_qkvz_ba
        and rocm_on.moe_shared_routed
        and not rocm_on.qk_norm
        and rocm_on.fused_qk_norm
    )
    cpu = decide_stream_plan("cpu", StreamFlags(True, True, True, True), True, False, True, 1)
    assert not cpu.alt_stream and not cpu.any_overlap and not cpu.fused_qk_norm


def test_dense_models_have_no_moe_overlap():
    plan = decide_stream_plan("cuda", StreamFlags(), False, False, True, 8, has_moe=False)
    assert plan.qk_norm and not plan.moe_shared_routed and not plan.shared_experts_fusion


def test_auto_override_turns_overlap_off():
    flags = StreamFlags(gdn_qkvz_ba=True)
    assert decide_stream_plan(
        "cuda", flags, True, False, True, 8, overlap_override=True
    ).any_overlap
    assert not decide_stream_plan(
        "cuda", flags, True, False, True, 8, overlap_override=False
    ).any_overlap


def test_unknown_platform():
    with pytest.raises(ValueError, match="platform must be one of"):
        decide_stream_plan("tpu", StreamFlags(), False, False, True, 1)


def test_auto_choice_from_timings():
    timings = {1: (1.00, 1.05), 8: (1.00, 0.99), 32: (2.0, 1.7), 128: (4.0, 3.0)}
    assert choose_overlap_per_batch_size(timings) == {1: False, 8: False, 32: True, 128: True}
    assert choose_overlap_per_batch_size(timings, min_gain=0.2) == {
        1: False,
        8: False,
        32: False,
        128: True,
    }
    with pytest.raises(ValueError, match="batch size 4: timings must be positive"):
        choose_overlap_per_batch_size({4: (0.0, 1.0)})
