"""Server arguments: one frozen dataclass, the single source of the command-line flags and their defaults.

The engine reads it to load the model and size the pools; per-rank copies come from ``dataclasses.replace``.
Later layers (the HTTP server, DP ranks) extend the same dataclass rather than growing a second flag list.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_lite import assets
from sglang_lite.utils import cpu_flags, http_flags, schedule_flags, speculative_flags

if TYPE_CHECKING:
    from sglang_lite.distributed.parallel_state import ParallelConfig

SCHEDULE_POLICIES = ("fcfs", "sjf")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("fp8", "mxfp4", "quark", "none")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")
ALT_STREAM_OVERLAP = ("flags", "auto")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake",)
TOOL_CALL_PARSERS = ("qwen3_coder", "qwen25")  # SGLang's names; sglang_lite/server/parsers/
REASONING_PARSERS = ("qwen3",)
LOG_LEVELS = ("debug", "info", "warning", "error")

_HELP = {
    "model_path": "Checkpoint folder or Hugging Face hub id (org/name); empty = the built-in tiny Qwen3.5 MoE model "
    "(trained on Python's stdlib).",
    "tokenizer_path": "Tokenizer folder (or hub id); defaults to the model folder.",
    "revision": "Hub revision (branch, tag or commit) when model_path is a Hugging Face hub id.",
    "load_format": "auto: read the checkpoint weights; dummy: random weights of the checkpoint's shapes.",
    "quantization": "fp8: a block-FP8 checkpoint as it is, or a bf16/fp32 one quantized at load into 128x128 e4m3 "
    "blocks; mxfp4 (quark): an AMD Quark MXFP4 checkpoint as it is, or a bf16/fp32 one's experts and attention "
    "projections quantized at load; none: dequantize a quantized checkpoint into --dtype at load; default: what "
    "the checkpoint's config says (docs/quantization.md).",
    "dtype": "Weight and activation dtype; auto: the checkpoint's on GPU; on CPU float32 activations, a bf16 "
    "checkpoint's weights kept bf16 (read by the C++ kernels).",
    "device": "Torch device to run on.",
    "random_seed": "Seeds the weights of dummy models and the samplers of requests without their own seed.",
    "context_length": "Longest request (prompt + output) in tokens; default: the model's max_position_embeddings.",
    "max_total_tokens": "KV pool size in tokens; default: derived from mem_fraction_static.",
    "page_size": "Tokens per KV page: the KV pool, the request page tables and the prefix cache work in pages (a PD "
    "transfer writes a run of consecutive pages as one block).",
    "mem_fraction_static": "Fraction of device memory for weights, KV pool and linear-attention states.",
    "max_running_requests": "Requests decoding at once; also the number of linear-attention state slots. With "
    "--enable-dp-attention the total over the DP ranks (each gets its share).",
    "dp_size": "Data-parallel ranks (one scheduler each): with --enable-dp-attention the attention groups of one "
    "world, else independent replicas of --tp-size processes each.",
    "tp_size": "Tensor-parallel size: processes that run one model together (a world; alias --tp).",
    "ep_size": "Expert-parallel size: the routed experts split this many ways inside the world (divides --tp-size).",
    "enable_dp_attention": "Attention runs data-parallel in --dp-size groups of --tp-size/--dp-size ranks inside "
    "one world; the MoE runs over the whole world.",
    "nnodes": "Nodes the world is spread over (divides the processes of the world).",
    "node_rank": "This node's index in [0, --nnodes); node 0 serves HTTP, the others run only their ranks.",
    "dist_init_addr": "HOST:PORT of world rank 0's rendezvous (needed with --nnodes > 1; replica world w "
    "uses PORT + w); default: a free port on 127.0.0.1.",
    "dist_timeout": "Seconds a collective waits for a peer before the world is declared broken.",
    "disaggregation_mode": "PD disaggregation: null serves whole requests; prefill prefills and sends each request's "
    "KV, GDN states and first token to a decode server; decode takes requests only with bootstrap fields.",
    "disaggregation_bootstrap_port": "Prefill server: port of its bootstrap server, where decode ranks say where a "
    "request's data must go (the router passes it as bootstrap_port).",
    "disaggregation_transfer_backend": "How KV and states move between the servers.",
    "disaggregation_ib_device": "RDMA device for the transfer engine (e.g. mlx5_0); unset: TCP.",
    "disaggregation_transfer_timeout": "Seconds a PD request may wait for its destination (prefill side) or its data "
    "(decode side) before it fails.",
    "disable_radix_cache": "Turn the prefix cache off: every request prefills its whole prompt.",
    "mamba_full_memory_ratio": "Memory of the GDN state pool (running requests and the prefix cache's state "
    "snapshots) over the full-attention KV pool's; sizes the snapshot slots (at least max_running_requests).",
    "max_mamba_cache_size": "GDN state slots in all (running requests plus prefix-cache snapshots), overriding "
    "mamba_full_memory_ratio; must exceed max_running_requests. Their bytes come out of the memory budget and "
    "the KV pool gets the rest (a size that leaves it less than the context length is an error).",
    "grammar_compile_timeout": "Seconds a grammar (json_schema, regex, ebnf) may take to compile; past it a 400.",
    "grammar_mask_budget_ms": "CPU ms a grammar's token mask (or accepted token) may take; past it a 400.",
    "enable_cache_report": "Report prefix-cache hits in OpenAI usage (prompt_tokens_details.cached_tokens).",
    "disable_shared_experts_fusion": "Run the MoE shared expert separately instead of as an extra fused expert.",
    "skip_tokenizer_init": "Do not load a tokenizer: requests pass input_ids and get no text.",
    "disable_cuda_graph": "Run decode steps eagerly instead of replaying captured CUDA graphs.",
    "enable_torch_compile": "CPU: run decode steps through torch.compile (compiled on first use, per batch-size "
    "regime; prefill stays eager).",
    "enable_deterministic_inference": "Batch-invariant kernels: a request's tokens and logprobs are the same bits "
    "alone or in any batch, chunk, prefix-cache hit or verify step (docs/determinism.md).",
    "cuda_graph_max_bs": "Largest decode batch captured into a CUDA graph.",
    "alt_stream_overlap": "flags: overlap as the SGLANG_*_ALT_STREAM flags say; auto: per captured batch size, time "
    "both variants and keep the faster.",
    "log_level": "Log level of every process (the server, its ranks, the transfer engine); tracebacks of start-up "
    "failures only at debug.",
    "load_balance_method": "How the DP controller picks a rank for requests that name none.",
    "rank_hang_timeout_s": "A DP rank that leaves a loads query unanswered this long is hung: killed and restarted.",
    "tool_call_parser": "Parse tool calls out of chat output into OpenAI tool_calls: qwen3_coder (Qwen3.5, "
    "Qwen3-Coder: <function=...><parameter=...>) or qwen25 (JSON in <tool_call>); unset: tools are rendered but not "
    "parsed.",
    "reasoning_parser": "Move <think> reasoning into reasoning_content: qwen3 (Qwen3, Qwen3.5); unset: left in "
    "content.",
    "rank_max_restarts": "Restarts of one DP rank (dead or hung) over the server's life; then it stays down. With "
    "--tp-size > 1 a DP rank is never restarted: its world fails as a whole.",
}

_HELP.update(http_flags.HELP)  # connections, timeouts and sizes at the HTTP edge
_HELP.update(schedule_flags.HELP)  # batches and their steps
_HELP.update(speculative_flags.HELP)  # speculative decoding (scheduler/speculative/)
_HELP.update(cpu_flags.HELP)  # threads and their CPUs


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None
    tokenizer_path: str | None = None
    revision: str | None = None
    load_format: str = "auto"
    quantization: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    random_seed: int = 0
    context_length: int | None = None
    max_total_tokens: int | None = None
    page_size: int = 16
    mem_fraction_static: float = 0.8
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 8192
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    stream_interval: int = 1
    num_continuous_decode_steps: int | None = None
    dp_size: int = 1
    # one model over several processes (torch.distributed): see sglang_lite.distributed
    tp_size: int = 1
    ep_size: int = 1
    enable_dp_attention: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = 300.0
    # prefill/decode disaggregation (sglang_lite/scheduler/pd_side.py, sglang_lite/server/bootstrap.py)
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_ib_device: str | None = None
    disaggregation_transfer_timeout: float = 60.0
    disable_radix_cache: bool = False
    mamba_full_memory_ratio: float = 0.9
    max_mamba_cache_size: int | None = None
    enable_cache_report: bool = False
    grammar_compile_timeout: float = 10.0
    grammar_mask_budget_ms: float = 200.0
    disable_shared_experts_fusion: bool = False
    skip_tokenizer_init: bool = False
    disable_cuda_graph: bool = False
    enable_torch_compile: bool = False
    enable_deterministic_inference: bool = False
    cuda_graph_max_bs: int = 64
    alt_stream_overlap: str = "flags"
    log_level: str = "info"
    # the HTTP server (sglang_lite.launch_server)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    load_balance_method: str = "round_robin"
    max_queued_requests: int = 1024
    max_request_body_bytes: int = 16 * 1024 * 1024
    max_concurrent_requests: int = 4096
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 20.0
    http_keep_alive_timeout_s: float = 30.0
    max_connections: int = 8192
    allow_remote_images: bool = False
    cpu_threads_per_rank: int | None = None
    cpu_omp_bind: str = "auto"
    rank_hang_timeout_s: float = 60.0
    rank_max_restarts: int = 5
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_min_match_window_size: int | None = None
    speculative_ngram_max_match_window_size: int | None = None

    def __post_init__(self) -> None:
        self._check_choice("dtype", DTYPES)
        self._check_choice("load_format", LOAD_FORMATS)
        if self.quantization is not None:
            self._check_choice("quantization", QUANTIZATIONS)
        self._check_choice("schedule_policy", SCHEDULE_POLICIES)
        self._check_choice("load_balance_method", LOAD_BALANCE_METHODS)
        http_flags.check(self)
        schedule_flags.check(self)
        self._check_positive("rank_hang_timeout_s", "grammar_mask_budget_ms")
        if self.rank_max_restarts < 0:
            raise ValueError(f"rank_max_restarts must be >= 0, got {self.rank_max_restarts}")
        self._check_choice("alt_stream_overlap", ALT_STREAM_OVERLAP)
        self._check_choice("log_level", LOG_LEVELS)
        if self.tool_call_parser is not None:
            self._check_choice("tool_call_parser", TOOL_CALL_PARSERS)
        if self.reasoning_parser is not None:
            self._check_choice("reasoning_parser", REASONING_PARSERS)
        self._check_positive(
            "max_running_requests", "max_prefill_tokens", "stream_interval", "dp_size", "page_size"
        )
        if self.max_total_tokens is not None and self.max_total_tokens <= 0:
            raise ValueError(f"max_total_tokens must be positive, got {self.max_total_tokens}")
        if self.context_length is not None and self.context_length <= 1:
            raise ValueError(f"context_length must be > 1, got {self.context_length}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}"
            )
        self._check_state_pool()
        if self.schedule_conservativeness < 0:
            raise ValueError(
                f"schedule_conservativeness must be >= 0, got {self.schedule_conservativeness}"
            )
        self._check_parallel()
        self._check_choice("disaggregation_mode", DISAGGREGATION_MODES)
        self._check_choice("disaggregation_transfer_backend", TRANSFER_BACKENDS)
        self._check_positive("disaggregation_transfer_timeout", "grammar_compile_timeout")
        speculative_flags.check(self)
        cpu_flags.check(self)

    @property
    def speculative_steps(self) -> int:  # drafted per decode step; 0: off
        return speculative_flags.draft_steps(self)

    def _check_state_pool(self) -> None:
        if self.mamba_full_memory_ratio < 0:
            raise ValueError(
                f"mamba_full_memory_ratio must be >= 0, got {self.mamba_full_memory_ratio}"
            )
        size = self.max_mamba_cache_size
        if size is not None and size <= self.max_running_requests:
            raise ValueError(
                f"max_mamba_cache_size ({size}) must exceed max_running_requests "
                f"({self.max_running_requests}): one state slot per running request, the rest snapshots"
            )

    def _check_parallel(self) -> None:
        self._check_positive("tp_size", "ep_size", "nnodes", "dist_timeout")
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size}) must divide tp_size ({self.tp_size})")
        if self.enable_dp_attention and self.tp_size % self.dp_size:
            raise ValueError(
                f"dp_size ({self.dp_size}) must divide tp_size ({self.tp_size}) with "
                "enable_dp_attention"
            )
        if self.enable_dp_attention and self.max_running_requests < self.dp_size:
            raise ValueError(
                f"max_running_requests ({self.max_running_requests}) is the total over the "
                f"{self.dp_size} DP ranks with enable_dp_attention: give at least one per rank"
            )
        if self.world_size % self.nnodes:
            raise ValueError(
                f"nnodes ({self.nnodes}) must divide the processes of the world (tp_size "
                f"{self.tp_size})"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}"
            )
        if self.dist_init_addr is not None:
            host, port = self.dist_init_addr.rpartition(":")[::2]
            if not host or not port.isdigit():
                raise ValueError(f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("dist_init_addr (HOST:PORT of node 0) is required with nnodes > 1")
        if self.nnodes > 1 and self.dp_size > 1 and not self.enable_dp_attention:
            raise ValueError(
                f"nnodes > 1 needs dp_size 1 or enable_dp_attention (dp_size {self.dp_size} would "
                "make independent replicas)"
            )

    def _check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        if getattr(self, name) not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")

    def _check_positive(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def model_dir(self) -> str:
        """The checkpoint folder: ``model_path`` (a folder or a Hugging Face hub id, at ``revision``), or the
        built-in tiny model's."""
        return assets.model_dir(self.model_path, self.revision)

    @property
    def tokenizer_dir(self) -> str:
        if self.tokenizer_path:
            return assets.model_dir(self.tokenizer_path, self.revision)
        return self.model_dir

    @property
    def parallel_config(self) -> ParallelConfig:
        """The layout of one world."""
        # torch: only processes that join a world
        from sglang_lite.distributed.parallel_state import ParallelConfig

        return ParallelConfig(self.tp_size, self.ep_size, self.dp_size, self.enable_dp_attention)

    def per_dp_rank(self) -> ServerArgs:
        """The arguments one DP rank runs with: under DP attention ``max_running_requests`` and
        ``chunked_prefill_size`` are the server's totals, divided over its DP ranks (as upstream)."""
        if not self.enable_dp_attention or self.dp_size == 1:
            return self
        chunk = self.chunked_prefill_size
        return dataclasses.replace(
            self,
            max_running_requests=self.max_running_requests // self.dp_size,
            chunked_prefill_size=chunk // self.dp_size if chunk > 0 else chunk,
        )

    @property
    def world_size(self) -> int:
        """Processes of one world (one model)."""
        return self.tp_size

    @property
    def num_worlds(self) -> int:
        """DP attention: one world holds every DP rank; otherwise each DP rank is a world of its own."""
        return 1 if self.enable_dp_attention else self.dp_size

    @property
    def dp_ranks_per_world(self) -> int:
        return self.dp_size // self.num_worlds

    def world_of(self, dp_rank: int) -> int:
        return dp_rank // self.dp_ranks_per_world

    def world_dp_ranks(self, world: int) -> range:
        return range(world * self.dp_ranks_per_world, (world + 1) * self.dp_ranks_per_world)

    @property
    def ranks_per_node(self) -> int:
        """Processes of one world on each node; node n holds world ranks [n * this, (n + 1) * this)."""
        return self.world_size // self.nnodes

    @property
    def node_processes(self) -> int:
        """Scheduler processes on this node: its ranks of every world."""
        return self.num_worlds * self.ranks_per_node

    @property
    def cpu_threads(self) -> int:
        """torch threads of one scheduler process on the CPU: by default the CPUs shared out over the scheduler
        processes of this node."""
        return self.cpu_threads_per_rank or max(1, (os.cpu_count() or 1) // self.node_processes)

    @property
    def prefix_cache(self) -> bool:
        """The radix cache runs unless turned off. A PD prefill rank caches too; a decode rank does not (its
        prompts arrive whole from the prefill side, so it has nothing to reuse)."""
        return not self.disable_radix_cache and self.disaggregation_mode != "decode"

    @property
    def effective_prefill_chunk(self) -> int:
        """Tokens one request may prefill in one forward."""
        chunk = self.chunked_prefill_size
        return chunk if chunk > 0 else self.max_prefill_tokens

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for field in dataclasses.fields(ServerArgs):
            _add_field(parser, field)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


# upstream's other spellings of the parallel sizes
_ALIASES = {
    "tp_size": ["--tp", "--tensor-parallel-size"],
    "dp_size": ["--dp", "--data-parallel-size"],
    "ep_size": ["--ep", "--expert-parallel-size"],
}


def _add_field(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
    flags = ["--" + field.name.replace("_", "-"), *_ALIASES.get(field.name, [])]
    help_text = _HELP.get(field.name, "")
    if field.type in ("bool", bool):
        parser.add_argument(*flags, action="store_true", default=field.default, help=help_text)
        return
    kwargs: dict[str, Any] = {
        "default": field.default,
        "help": f"{help_text} (default: {field.default})",
    }
    kwargs["type"] = _parse_type(field.type)
    choices = {
        "dtype": DTYPES,
        "load_format": LOAD_FORMATS,
        "schedule_policy": SCHEDULE_POLICIES,
        "quantization": QUANTIZATIONS,
        "alt_stream_overlap": ALT_STREAM_OVERLAP,
        "log_level": LOG_LEVELS,
        "load_balance_method": LOAD_BALANCE_METHODS,
        "disaggregation_mode": DISAGGREGATION_MODES,
        "disaggregation_transfer_backend": TRANSFER_BACKENDS,
        "tool_call_parser": TOOL_CALL_PARSERS,
        "reasoning_parser": REASONING_PARSERS,
        "speculative_algorithm": speculative_flags.SPECULATIVE_ALGORITHMS,
    }
    if field.name in choices:
        kwargs["choices"] = choices[field.name]
    parser.add_argument(*flags, dest=field.name, **kwargs)


def _parse_type(annotation: Any) -> type:
    text = annotation if isinstance(annotation, str) else annotation.__name__
    for name, kind in (("int", int), ("float", float)):
        if text.startswith(name):
            return kind
    return str


# The process-global server arguments, the one upstream contract that is not passed explicitly: the scheduler
# process sets them once (runtime/scheduler_process.py), model code reads them lazily, at construction, never at
# import (a module-level read once broke imports in unit tests upstream). Nothing else sets or reads them.
_global_server_args: ServerArgs | None = None


def set_global_server_args(args: ServerArgs | None) -> None:
    global _global_server_args
    _global_server_args = args


def get_global_server_args() -> ServerArgs:
    if _global_server_args is None:
        raise RuntimeError(
            "Global server args is not set yet: call sglang_lite.server_args.set_global_server_args(...) first "
            "(scheduler processes do; standalone load_model uses ServerArgs() defaults)"
        )
    return _global_server_args


def server_args_or_default() -> ServerArgs:
    """For model code: the rank's server arguments, or the defaults when a model is built outside a rank (a script
    or a test calling ``load_model``)."""
    return get_global_server_args() if _global_server_args is not None else ServerArgs()
