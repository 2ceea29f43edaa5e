"""Running a model's forwards: eagerly, or as replays of CUDA graphs captured for decode batch sizes."""

from sglang_lite.model_executor.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes
from sglang_lite.model_executor.model_runner import ModelRunner

__all__ = ["CudaGraphRunner", "ModelRunner", "capture_batch_sizes"]
