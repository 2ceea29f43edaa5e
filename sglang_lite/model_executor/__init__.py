"""Running a model's forwards: eagerly, or as replays of CUDA graphs captured for decode batch sizes (or, with
speculative decoding, for its verify forward and its MTP head)."""

from sglang_lite.model_executor.base import Runner
from sglang_lite.model_executor.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes
from sglang_lite.model_executor.model_runner import ModelRunner
from sglang_lite.model_executor.spec_graph_runner import SpecGraphRunner

__all__ = ["CudaGraphRunner", "ModelRunner", "Runner", "SpecGraphRunner", "capture_batch_sizes"]
