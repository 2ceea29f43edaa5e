"""The one place that decides which work overlaps on the alternate stream, and the ``auto`` choice.

Sites (see shared/reference/qwen3_5.md, "Alt streams"):
- GDN input projections: ``in_proj_qkvz`` on the main stream, ``in_proj_ba`` on the alternate one;
- QK norm: ``q_norm`` on main, ``k_norm`` on alternate (otherwise the fused q/k kernel on ROCm, two norms elsewhere);
- MoE: shared expert on main, router + routed experts on alternate (never with shared-expert fusion, where the
  shared expert is inside the fused MoE call).
Everything here is pure: the caller passes the platform, the flags and the server arguments in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sglang_lite import envs

PLATFORMS = ("cuda", "rocm", "cpu")


@dataclass(frozen=True)
class StreamFlags:
    """The environment flags that shape the plan, read once when a model is built."""

    alt_stream: bool = False  # SGLANG_ALT_STREAM: create the alternate stream on ROCm
    gdn_qkvz_ba: bool = False  # SGLANG_GDN_QKVZ_BA_ALT_STREAM
    qk_norm: bool | None = None  # SGLANG_QK_NORM_ALT_STREAM; None: platform default
    eager: bool = False  # SGLANG_ALT_STREAM_EAGER: overlap outside CUDA-graph capture too
    gdn_max_tokens: int = 1024  # SGLANG_GDN_ALT_STREAM_MAX_TOKENS

    @classmethod
    def from_env(cls) -> StreamFlags:
        return cls(
            alt_stream=bool(envs.SGLANG_ALT_STREAM.get()),
            gdn_qkvz_ba=bool(envs.SGLANG_GDN_QKVZ_BA_ALT_STREAM.get()),
            qk_norm=envs.SGLANG_QK_NORM_ALT_STREAM.get(),
            eager=bool(envs.SGLANG_ALT_STREAM_EAGER.get()),
            gdn_max_tokens=envs.SGLANG_GDN_ALT_STREAM_MAX_TOKENS.get(),
        )


@dataclass(frozen=True)
class StreamPlan:
    """What one forward does at each site."""

    alt_stream: bool  # an alternate stream exists on this platform
    gdn_qkvz_ba: bool
    qk_norm: bool
    moe_shared_routed: bool
    fused_qk_norm: bool  # when q/k norms do not overlap: one fused kernel (ROCm) or two norms
    shared_experts_fusion: bool

    @property
    def any_overlap(self) -> bool:
        return self.gdn_qkvz_ba or self.qk_norm or self.moe_shared_routed

    def to_json(self) -> dict:
        return asdict(self)


def has_alt_stream(platform: str, flags: StreamFlags) -> bool:
    """CUDA always has one (upstream fixed a regression that lost it there); ROCm only on request; never the CPU."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    return platform == "cuda" or (platform == "rocm" and flags.alt_stream)


def shared_experts_fusion(disable_shared_experts_fusion: bool, fusion_supported: bool) -> bool:
    return fusion_supported and not disable_shared_experts_fusion


def decide_stream_plan(
    platform: str,
    flags: StreamFlags,
    disable_shared_experts_fusion: bool,
    fusion_supported: bool,
    capturing: bool,
    num_tokens: int,
    overlap_override: bool | None = None,
    has_moe: bool = True,
) -> StreamPlan:
    """The plan of one forward.

    ``fusion_supported``: the model's shapes allow shared-expert fusion; ``has_moe``: it has MoE blocks at all.
    ``overlap_override``: the ``auto`` choice for this batch size (False turns every overlap off).
    """
    alt = has_alt_stream(platform, flags)
    active = alt and (capturing or flags.eager) and overlap_override is not False
    # as upstream's qwen3_5.py: on CUDA both overlaps are always on (``_is_cuda or flag``); on ROCm each waits for
    # its flag (the GDN one regressed there, and the fused q/k kernel beats the QK overlap)
    on_cuda = platform == "cuda"
    qk = active and (on_cuda or bool(flags.qk_norm))
    fusion = has_moe and shared_experts_fusion(disable_shared_experts_fusion, fusion_supported)
    return StreamPlan(
        alt_stream=alt,
        gdn_qkvz_ba=active and (on_cuda or flags.gdn_qkvz_ba) and num_tokens < flags.gdn_max_tokens,
        qk_norm=qk,
        moe_shared_routed=active and has_moe and not fusion,
        fused_qk_norm=not qk and platform == "rocm",
        shared_experts_fusion=fusion,
    )


def choose_overlap_per_batch_size(
    timings_ms: dict[int, tuple[float, float]], min_gain: float = 0.02
) -> dict[int, bool]:
    """``auto``: for each captured batch size, overlap only when its replay is faster by more than ``min_gain``.

    ``timings_ms[bs] = (plain_ms, overlapped_ms)``. A gain inside the margin is noise, and the plain graph has
    fewer moving parts, so it wins ties.
    """
    choice = {}
    for bs, (plain, overlapped) in sorted(timings_ms.items()):
        if plain <= 0 or overlapped <= 0:
            raise ValueError(
                f"batch size {bs}: timings must be positive, got plain={plain}, overlapped={overlapped}"
            )
        choice[bs] = overlapped < plain * (1.0 - min_gain)
    return choice
