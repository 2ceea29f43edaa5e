"""Sampling: per-request parameters and the batched sampler."""

from sglang_lite.sampling.params import SamplingParams
from sglang_lite.sampling.sampler import make_generator, sample

__all__ = ["SamplingParams", "make_generator", "sample"]
