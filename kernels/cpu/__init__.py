"""Fused float32 CPU kernels in C++: the decode step's ops, the linear layers and the fused MoE
(``csrc/decode_ops.cpp``; linear and MoE serve prefill too), and the Gated DeltaNet prefill, the gated delta rule
and the packed causal conv1d (``csrc/prefill_ops.cpp``).

On the CPU a forward is made of small ops, and dispatching each one (Python, then ATen) costs more than its
arithmetic: a GDN layer of the references is a hundred-odd dispatched ops. Each kernel here computes what one
reference in ``kernels/<family>/naive.py`` computes, in one call and one pass over its operands. They are the
CPU's fast path for float32 data (``dispatch.use_native``); the references stay the definition and the path for
other dtypes.

The sources are compiled with torch's ``cpp_extension`` on first use (g++ and ninja must be on the machine; the
build takes a while and says so once, at WARNING) into ``SGLANG_CPU_KERNEL_CACHE`` (default
``~/.cache/sglang_lite/cpu_kernels``), one build folder per set of sources, flags, torch installation and CPU
(``-march=native``), named by their hash, and loaded from there afterwards. The sources are copied into that folder
and compiled from there: the build's files then name only the cache's paths, so two checkouts of the same code
share one build instead of rebuilding each other's. When it cannot be built the CPU runs the references and says
why once. ``SGLANG_KERNEL_BACKEND=torch`` turns these kernels off for a run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading

import torch

from sglang_lite import envs

logger = logging.getLogger(__name__)

_SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_COMPILED = (
    "decode_ops.cpp",
    "prefill_ops.cpp",
)  # the rest of csrc/ (headers) is included by these
_LIBRARY = "sglang_lite_cpu_ops"
# -fopenmp: at::parallel_for's OpenMP region is inlined from the headers; the library it links (libgomp.so.1) is
# the one torch has already loaded, so both share torch's thread pool.
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_error = ""


def available() -> bool:
    """True when the kernels are built and loaded (building them on the first call)."""
    global _loaded, _error
    if _loaded is not None:  # asked before every op: no lock once decided
        return _loaded
    with _lock:
        if _loaded is None:
            try:
                _build_and_load()
                _loaded = True
            except Exception as exc:  # noqa: BLE001 - any build failure means: run the references
                _loaded, _error = False, f"{type(exc).__name__}: {exc}"
                logger.warning(
                    "fused CPU kernels unavailable, the CPU runs the PyTorch references: %s", _error
                )
        return _loaded


def prepare() -> str:
    """Build (or load) the kernels now unless a run forces another backend, so that an engine starting on the CPU
    pays the first build at start rather than in its first request; says which path float32 models will take."""
    if envs.SGLANG_KERNEL_BACKEND.get() in ("torch", "triton"):
        return f"off (SGLANG_KERNEL_BACKEND={envs.SGLANG_KERNEL_BACKEND.get()})"
    return "on" if available() else f"off, the PyTorch references run ({_error})"


def require() -> None:
    """Raise, with the build's reason, when the kernels cannot be built (``SGLANG_KERNEL_BACKEND=native``)."""
    if not available():
        raise RuntimeError(f"the fused CPU kernels (kernels/cpu) could not be built: {_error}")


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    build_dir = build_directory()
    sources = stage_sources(build_dir)
    if not os.path.exists(os.path.join(build_dir, _LIBRARY + ".so")):
        logger.warning("building the C++ CPU kernels (once, ~30-60 s) into %s", build_dir)
    cpp_extension.load(
        name=_LIBRARY,
        sources=sources,
        build_directory=build_dir,
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        is_python_module=False,
        verbose=False,
    )


def build_directory(source_dir: str = _SOURCE_DIR) -> str:
    """The cache folder of the build of ``source_dir``'s sources: named by their content, never by their path."""
    return os.path.join(_cache_root(), _build_key(source_dir))


def stage_sources(build_dir: str, source_dir: str = _SOURCE_DIR) -> list[str]:
    """Copy the sources into ``build_dir/src`` (once: an unchanged file keeps its mtime, so ninja does not rebuild)
    and return the paths to compile, which lie in the cache whatever checkout they came from."""
    staged = os.path.join(build_dir, "src")
    os.makedirs(staged, exist_ok=True)
    for name in sorted(os.listdir(source_dir)):
        target = os.path.join(staged, name)
        if not os.path.exists(
            target
        ):  # the folder's name is the content's hash: a file there is this one
            partial = f"{target}.{os.getpid()}.tmp"
            shutil.copyfile(os.path.join(source_dir, name), partial)
            os.replace(partial, target)  # atomic: a concurrent build sees the whole file or none
    return [os.path.join(staged, name) for name in _COMPILED]


def _cache_root() -> str:
    configured = envs.SGLANG_CPU_KERNEL_CACHE.get()
    return configured or os.path.join(
        os.path.expanduser("~"), ".cache", "sglang_lite", "cpu_kernels"
    )


def _build_key(source_dir: str) -> str:
    """Sources (headers included, by name and content), flags, the torch installation (its headers and libraries
    are on the build's command line) and the CPU's features: a build made for another machine, another torch or
    from other sources is never loaded."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(source_dir)):
        with open(os.path.join(source_dir, name), "rb") as f:
            digest.update(name.encode() + f.read())
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    digest.update(
        " ".join(_CFLAGS + _LDFLAGS + [torch.__version__, torch_dir, sys.version]).encode()
    )
    digest.update(_cpu_features().encode())
    return digest.hexdigest()[:16]


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _put_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; pip's copy (a dependency) sits beside this Python, which a virtual
    environment run without activation does not have on PATH."""
    beside = os.path.dirname(sys.executable)
    if not shutil.which("ninja") and shutil.which("ninja", path=beside):
        os.environ["PATH"] = beside + os.pathsep + os.environ.get("PATH", "")


def _ops():
    return torch.ops.sglang_lite_cpu


def _float(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def gemma_rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As ``norms.naive.gemma_rmsnorm``: float32 x (and residual) of any shape, normalised over the last dim."""
    y, total = _ops().gemma_rmsnorm(x, _float(weight), eps, residual)  # shaped like x
    return y if residual is None else (y, total)


def fused_qk_gemma_rmsnorm(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``norms.naive.fused_qk_gemma_rmsnorm``: every head_dim-sized row of q and of k."""
    q_rows, k_rows = q.reshape(-1, 1, head_dim), k.reshape(-1, 1, head_dim)
    return gemma_rmsnorm(q_rows, q_weight, eps).view(q.shape), gemma_rmsnorm(
        k_rows, k_weight, eps
    ).view(k.shape)


def gated_rmsnorm(
    o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """As ``norms.naive.gated_rmsnorm``."""
    return _ops().gated_rmsnorm(o, _float(z), _float(weight), eps)  # shaped like o


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """As ``conv1d.naive.causal_conv1d_update``: x [B, D]; the float32 pool's slots are shifted in place."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    return _ops().causal_conv1d_update(
        _last_dim_contiguous(x),
        _float(weight).contiguous(),
        conv_states,
        state_indices,
        activation is not None,
    )


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """As ``conv1d.naive.causal_conv1d_fn``: x [T, D] packed requests; the float32 pool's slots are replaced by
    each request's last K-1 inputs."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    return _ops().causal_conv1d_prefill(
        _last_dim_contiguous(x),
        _float(weight).contiguous(),
        conv_states,
        state_indices,
        cu_seqlens,
        activation is not None,
    )


def fused_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``gated_delta_rule.naive.fused_gdn_gating``: a, b [T, H]."""
    return _ops().gdn_gating(
        _float(A_log), _last_dim_contiguous(a), _float(dt_bias), _last_dim_contiguous(_float(b))
    )


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """As ``gated_delta_rule.naive.chunk_gated_delta_rule`` (whatever its chunk size: this runs the recurrence token
    by token); the float32 pool is updated in place."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    q = _last_dim_contiguous(q)
    k = _last_dim_contiguous(k)
    v = _last_dim_contiguous(v)
    g, beta = _last_dim_contiguous(_float(g)), _last_dim_contiguous(_float(beta))
    return _ops().gated_delta_rule_prefill(
        q, k, v, g, beta, ssm_states, state_indices, cu_seqlens, scale, use_qk_l2norm
    )


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """As ``gated_delta_rule.naive.fused_recurrent_gated_delta_rule``; the float32 pool is updated in place."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    q = _last_dim_contiguous(q)
    k = _last_dim_contiguous(k)
    v = _last_dim_contiguous(v)
    g, beta = _last_dim_contiguous(_float(g)), _last_dim_contiguous(_float(beta))
    return _ops().gated_delta_rule_decode(
        q, k, v, g, beta, ssm_states, state_indices, scale, use_qk_l2norm
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int = 1,
) -> torch.Tensor:
    """As ``attention.naive.decode_attention`` over a float32 pool."""
    return _ops().decode_attention(
        _last_dim_contiguous(q),
        k_cache,
        v_cache,
        page_table,
        req_pool_indices,
        seq_lens,
        scale,
        page_size,
    )


# Where the fused linear beats MKL (the figures: docs/performance.md). An [in, out] weight: from 1 to a few hundred
# rows at every width from 16 columns on; at thousands of rows the two are even, and on a weight of fewer than 16
# columns MKL wins (it parallelises over the rows, the kernel over the columns). An [out, in] weight (a tied LM head,
# which is the embedding): up to 16 rows.
LINEAR_MAX_ROWS = 256
LINEAR_MAX_ROWS_OUT_IN = 16
LINEAR_MIN_COLUMNS = 16


def takes_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The shapes and layouts ``linear`` serves: an [N, K] weight of N >= 16 stored [in, out] and up to
    LINEAR_MAX_ROWS rows, or stored [out, in] (contiguous) and up to LINEAR_MAX_ROWS_OUT_IN rows."""
    if weight.dim() != 2 or weight.shape[0] < LINEAR_MIN_COLUMNS:
        return False
    rows = x.shape[0] if x.dim() == 2 else x.numel() // max(x.shape[-1], 1)
    if weight.stride(0) == 1:
        return 0 < rows <= LINEAR_MAX_ROWS
    return weight.stride(1) == 1 and 0 < rows <= LINEAR_MAX_ROWS_OUT_IN


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` for float32 x [M, K] and weight [N, K] as ``takes_linear`` accepts them."""
    return _ops().linear_rows(_last_dim_contiguous(x), weight)


def moe_route(
    router_logits: torch.Tensor,
    shared_logits: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    shared_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``moe.naive.moe_route``: float32 router logits [T, E] (and shared-expert logits [T, 1])."""
    return _ops().moe_route(
        _last_dim_contiguous(router_logits), shared_logits, top_k, renormalize, shared_id
    )


# The fused MoE runs a prefill's tokens in chunks: its buffers (every (token, expert) pair's row) stay small enough
# to be reused from the heap instead of fresh, page-faulting mappings, and each chunk's rows stay in cache. Chunked,
# it beats the reference's padded batched GEMMs at every prefill size measured (docs/performance.md).
MOE_CHUNK_TOKENS = 1024


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """As ``moe.naive.fused_moe`` for float32 x and experts, in either weight layout."""
    x = _last_dim_contiguous(x)
    topk_weights = _float(topk_weights)
    topk_ids = topk_ids.contiguous()
    if x.shape[0] <= MOE_CHUNK_TOKENS:
        return _ops().fused_moe(x, w13, w2, topk_weights, topk_ids)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[0], MOE_CHUNK_TOKENS):
        rows = slice(start, start + MOE_CHUNK_TOKENS)
        out[rows] = _ops().fused_moe(x[rows], w13, w2, topk_weights[rows], topk_ids[rows])
    return out
