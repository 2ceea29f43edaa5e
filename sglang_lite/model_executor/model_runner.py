"""The model as the scheduler sees it: ``forward_batch`` eagerly, or by CUDA-graph replay for decode batches."""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang_lite.distributed import get_parallel_state
from sglang_lite.forward_batch import ForwardBatch, ForwardMode, VerifyStates, build_forward_batch
from sglang_lite.kernels import batch_invariant
from sglang_lite.kernels import cpu as cpu_kernels
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang_lite.model_executor.decode_blocks import enable_decode_blocks
from sglang_lite.model_executor.spec_graph_runner import SpecGraphRunner
from sglang_lite.model_executor.weight_layout import store_input_major
from sglang_lite.models.qwen3_5 import Qwen3_5ForCausalLM
from sglang_lite.multimodal.inputs import ImageInputs
from sglang_lite.server_args import ServerArgs

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs forwards for the scheduler and prepares the device for them (the ``Runner`` of ``base.py``).

    On a GPU it captures CUDA graphs of decode batches. On the CPU it stores the weights [in, out] and builds the
    fused C++ kernels before the first request; the kernel dispatch then takes them for float32 calls in decode
    and prefill alike (GDN prefill, conv1d, linear layers, the fused MoE in chunks; see ``kernels/dispatch.py``),
    and decode steps run one C++ call per block (``decode_blocks.py``).
    """

    def __init__(self, model: Qwen3_5ForCausalLM, pools: ModelPools, args: ServerArgs) -> None:
        self.model = model
        self.config = model.config
        # the kernels' batch-invariant mode is the process's: one rank, one process
        batch_invariant.set_enabled(args.enable_deterministic_inference)
        self.graph_runner: CudaGraphRunner | None = None
        self.pools = pools
        on_gpu = model.lm_head.weight.device.type == "cuda"
        # DP attention exchanges every forward's token counts on the host: not something a graph can replay
        dp_attention = get_parallel_state().config.dp_attention
        graphs = on_gpu and not args.disable_cuda_graph and not dp_attention
        max_bs = min(args.cuda_graph_max_bs, args.max_running_requests)
        # speculative decode steps are verify forwards and the MTP head's steps: their own graphs
        self.spec_graphs: SpecGraphRunner | None = None
        if graphs and args.speculative_steps > 0:
            self.spec_graphs = capture_spec_graphs(model, pools, args.speculative_steps, max_bs)
        elif graphs:
            self.graph_runner = CudaGraphRunner(
                model, pools, max_bs, auto=args.alt_stream_overlap == "auto"
            )
        if not on_gpu:
            logger.debug(
                "weights stored [in, out] for the CPU's GEMMs: %d", store_input_major(model)
            )
            logger.info("fused C++ CPU kernels: %s", cpu_kernels.prepare())
            logger.debug(
                "decode steps as one C++ call per block: %s",
                enable_decode_blocks(model, args.enable_torch_compile),
            )
        # Decode steps only: prefill walks variable-length requests with host-side loops, which would keep
        # recompiling. dynamic=True lets one graph serve every batch size after the first few.
        self.compiled_body = None
        if args.enable_torch_compile and not on_gpu:
            # its fused kernels reduce in orders of their own
            if args.enable_deterministic_inference:
                logger.info("torch.compile is off under --enable-deterministic-inference")
            else:
                self.compiled_body = torch.compile(model.model, dynamic=True)
        logger.debug(
            "stream plan: %s; CUDA graphs: %s",
            model.streams.describe(),
            self.graph_runner.batch_sizes if self.graph_runner else "off",
        )

    def forward_batch(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        if self.graph_runner is not None and not all_logits and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        body = self.compiled_body if batch.is_decode else None
        return self.model.forward_batch(batch, all_logits, body)

    def decode_greedy(
        self,
        batch: ForwardBatch,
        out_cache_loc: torch.Tensor,
        stop_ids: torch.Tensor,
        wake_fd: int = -1,
    ) -> torch.Tensor | None:
        if self.graph_runner is not None or self.compiled_body is not None:
            return None
        return self.model.model.decode_greedy(batch, out_cache_loc, stop_ids, wake_fd)

    def extend_greedy(self, batch: ForwardBatch) -> torch.Tensor | None:
        return self.model.extend_greedy(batch)

    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The final hidden state [T, hidden] of every new token (eagerly): what speculation's MTP head takes."""
        return self.model.forward_hidden(batch)

    def forward_verify(
        self, batch: ForwardBatch, counts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, VerifyStates]:
        """A speculative verify forward over ``batch``'s rows (``build_rows_batch``; ``counts[i]`` tokens of
        request i): (hidden [T, hidden], logits [T, vocab], the Gated DeltaNet states after each token), from a
        graph where one was captured."""
        verify = None
        if self.spec_graphs is not None:
            if self.spec_graphs.can_verify(counts):
                return self.spec_graphs.verify(batch)
            verify = self.spec_graphs.eager_states(counts)
        if verify is None:
            verify = VerifyStates(self.pools, counts, batch.input_ids.device)
        batch.verify = verify
        hidden = self.model.forward_hidden(batch)
        return hidden, self.model.logits(hidden), batch.verify

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    @torch.inference_mode()
    def encode_images(self, images: ImageInputs) -> torch.Tensor:
        visual = getattr(self.model, "visual", None)
        if visual is None:
            raise ValueError(
                "images: the served model takes text only (its checkpoint has no vision tower)"
            )
        weight = next(visual.parameters())
        pixels = torch.from_numpy(images.pixel_values).to(weight.device, weight.dtype)
        grid = torch.tensor(images.grid_thw, dtype=torch.int64, device=weight.device)
        return visual(pixels, grid).to(self.model.compute_dtype)

    def forward_mtp(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP head over ``batch`` (the tokens after the positions whose hidden states are ``hidden``): its
        hidden state [T, hidden], for the LM head and the next draft step; from a graph where one was captured."""
        if self.spec_graphs is not None and self.spec_graphs.can_run_head(batch):
            return self.spec_graphs.head(batch, hidden)
        return self.model.mtp(batch, hidden)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def graph_bytes(self) -> int:
        """What the CUDA graphs of decode batches (or of speculation's steps) took, measured at capture."""
        graphs = (self.graph_runner, self.spec_graphs)
        return sum(g.memory_bytes for g in graphs if g is not None)

    def stream_plan(self) -> dict[str, Any] | None:
        return self.model.streams.describe()

    def forward_idle(self) -> None:
        """An empty forward: under DP attention, a DP rank with nothing to run joins the other ranks' MLPs."""
        device = self.model.lm_head.weight.device
        batch = build_forward_batch(self.pools, ForwardMode.DECODE, [], [], [], [], device, [])
        with torch.inference_mode():
            self.model.forward_batch(batch)


def capture_spec_graphs(
    model: torch.nn.Module, pools: ModelPools, steps: int, max_bs: int
) -> SpecGraphRunner | None:
    """Speculation's graphs (``SpecGraphRunner``), or None with a warning when capturing fails: those steps then
    run eagerly, as they do with ``--disable-cuda-graph``."""
    try:
        return SpecGraphRunner(model, pools, steps, max_bs)
    except Exception:  # noqa: BLE001 - any capture failure leaves the eager path, which is always correct
        logger.warning(
            "speculative CUDA graphs not captured; the draft and verify steps run eagerly",
            exc_info=True,
        )
        return None
