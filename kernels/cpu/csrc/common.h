// Helpers shared by the fused CPU kernels: argument checks, index and row views, a vectorisable exp, and the
// register-blocked small matmuls that the linear layers, the experts and attention use.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace sgl_cpu {


inline void check_float(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor, got ",
              t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// A 1-D int32 or int64 index tensor, read as int64.
class Index {
 public:
  Index(const at::Tensor& t, const char* name) : ptr_(t.data_ptr()), wide_(t.scalar_type() == at::kLong) {
    TORCH_CHECK(t.device().is_cpu() && (wide_ || t.scalar_type() == at::kInt), name,
                " must be an int32 or int64 CPU tensor, got ", t.scalar_type(), " on ", t.device());
    TORCH_CHECK(t.dim() == 1 && (t.numel() <= 1 || t.stride(0) == 1), name, " must be a contiguous 1-D tensor");
  }
  int64_t operator[](int64_t i) const {
    return wide_ ? static_cast<const int64_t*>(ptr_)[i] : static_cast<const int32_t*>(ptr_)[i];
  }

 private:
  const void* ptr_;
  bool wide_;
};

inline void check_slots(const Index& slots, int64_t count, int64_t pool_size, const char* name) {
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < pool_size, name, "[", i, "] = ", slots[i], " is outside the pool of ",
                pool_size, " slots");
  }
}

// exp that vectorises inside `omp simd` loops (std::exp does not): 2^n e^r with |r| <= ln2 / 2 and e^r by its
// Taylor polynomial of degree 7 (its truncation, 5e-9, is below float rounding). Inputs are clamped to [-87, 88],
// so results stay normal floats: exp(-100) reads 1.6e-38, which no sum or sigmoid here can tell from 0.
inline float vexp(float x) {
  const float clamped = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (clamped * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  const float r = (clamped - n * 0.693145752f) - n * 1.42860677e-6f;   // ln 2 split in two (Cody-Waite)
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x != x ? x : p * scale;  // NaN stays NaN
}

inline float sigmoid(float x) { return 1.0f / (1.0f + vexp(-x)); }

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

inline float sum_of_squares(const float* x, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += x[i] * x[i];
  return acc;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// t as an [A, B, n] view of its rows of the last dimension (a copy only when no view exists or the last dimension is
// strided): the norms take any shape this way, without the Python views around each call (each a dispatched op).
inline at::Tensor as_rows(const at::Tensor& t) {
  TORCH_CHECK(t.dim() >= 1, "expected a tensor of at least one dimension");
  at::Tensor rows = t.dim() == 3   ? t
                    : t.dim() == 2 ? t.unsqueeze(0)
                    : t.dim() == 1 ? t.view({1, 1, t.size(0)})
                                   : t.reshape({-1, t.size(-2), t.size(-1)});
  return rows.size(-1) <= 1 || rows.stride(-1) == 1 ? rows : rows.contiguous();
}

// Rows of a [A, B, n] view (any strides on A and B): row r is (r / B, r % B).
struct Rows {
  float* data;
  int64_t inner, stride0, stride1;
  Rows(const at::Tensor& t) : data(t.data_ptr<float>()), inner(t.size(1)), stride0(t.stride(0)), stride1(t.stride(1)) {}
  float* operator[](int64_t r) const { return data + (r / inner) * stride0 + (r % inner) * stride1; }
};

// Grain of at::parallel_for: below this many elements of work a range runs on the calling thread.
inline constexpr int64_t kGrainElements = 16384;

inline int64_t grain(int64_t work_per_item) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, work_per_item));
}

// The gated delta rule's operands: q, k [T, HK, dk]; v [T, HV, dv] with HV a multiple of HK; g, beta [T, HV];
// ssm_states [S, HV, dk, dv] with contiguous states (all float32, last dimensions contiguous).
struct GdnShapes {
  int64_t tokens, hk, dk, hv, dv;
};

inline GdnShapes check_gdn_operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                    const at::Tensor& beta, const at::Tensor& ssm_states) {
  check_float(q, "q", 3);
  check_float(k, "k", 3);
  check_float(v, "v", 3);
  check_float(g, "g", 2);
  check_float(beta, "beta", 2);
  check_float(ssm_states, "ssm_states", 4);
  const GdnShapes s{q.size(0), q.size(1), q.size(2), v.size(1), v.size(2)};
  TORCH_CHECK(k.sizes() == q.sizes(), "k must be shaped like q ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.size(0) == s.tokens && s.hv % s.hk == 0, "v must be [", s.tokens, ", HV, dv] with HV a multiple of ",
              s.hk, " key heads, got ", v.sizes());
  TORCH_CHECK(g.size(0) == s.tokens && g.size(1) == s.hv && beta.sizes() == g.sizes(), "g and beta must be [",
              s.tokens, ", ", s.hv, "], got ", g.sizes(), " and ", beta.sizes());
  TORCH_CHECK(ssm_states.size(1) == s.hv && ssm_states.size(2) == s.dk && ssm_states.size(3) == s.dv &&
                  ssm_states.stride(2) == s.dv,
              "ssm_states must be [S, ", s.hv, ", ", s.dk, ", ", s.dv, "] with contiguous states, got ",
              ssm_states.sizes());
  return s;
}

// ---- register-blocked products of a few rows with a row-major [K, N] weight ------------------------------------

// 16 floats: one AVX-512 register, two AVX2 ones, four NEON ones (the compiler splits it for the target).
typedef float vec16 __attribute__((vector_size(64)));

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// C[t, n0:n0+16 NV] = sum_k A[t, k] W[k, n0:n0+16 NV] for TB rows t: TB NV accumulators in registers, each W row
// segment loaded once for all TB rows.
template <int TB, int NV>
void rows_times_columns(const float* A, int64_t lda, const float* W, int64_t ldw, int64_t K, float* C, int64_t ldc) {
  vec16 acc[TB][NV];
  for (int t = 0; t < TB; ++t) {
    for (int v = 0; v < NV; ++v) acc[t][v] = vec16{};
  }
  for (int64_t k = 0; k < K; ++k) {
    vec16 w[NV];
    for (int v = 0; v < NV; ++v) w[v] = load16(W + k * ldw + 16 * v);
    for (int t = 0; t < TB; ++t) {
      const float a = A[t * lda + k];
      for (int v = 0; v < NV; ++v) acc[t][v] += a * w[v];
    }
  }
  for (int t = 0; t < TB; ++t) {
    for (int v = 0; v < NV; ++v) store16(C + t * ldc + 16 * v, acc[t][v]);
  }
}

// y[0:16 NV] = x W[:, 0:16 NV] for one row x and a row-major [K, ldw] weight read from memory: four weight rows at a
// time, each as one run of 64 NV bytes (four streams the prefetchers follow), the accumulators in registers / L1.
template <int NV>
void one_row_times_columns(const float* x, const float* W, int64_t ldw, int64_t K, float* y) {
  vec16 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = vec16{};
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const float a0 = x[k], a1 = x[k + 1], a2 = x[k + 2], a3 = x[k + 3];
    const float *w0 = W + k * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
    for (int v = 0; v < NV; ++v) {
      acc[v] += a0 * load16(w0 + 16 * v) + a1 * load16(w1 + 16 * v) + a2 * load16(w2 + 16 * v) +
                a3 * load16(w3 + 16 * v);
    }
  }
  for (; k < K; ++k) {
    for (int v = 0; v < NV; ++v) acc[v] += x[k] * load16(W + k * ldw + 16 * v);
  }
  for (int v = 0; v < NV; ++v) store16(y + 16 * v, acc[v]);
}

// Every row of A through one block of 16 NV columns, RB rows at a time: RB NV accumulators stay in registers (16:
// 8 rows of 32 columns, 4 of 64, 2 of 128).
template <int NV>
void all_rows_times_columns(const float* A, int64_t lda, int64_t M, const float* W, int64_t ldw, int64_t K, float* C,
                            int64_t ldc) {
  constexpr int RB = NV <= 2 ? 8 : (NV <= 4 ? 4 : (NV <= 8 ? 2 : 1));
  int64_t t = 0;
  for (; t + RB <= M; t += RB) rows_times_columns<RB, NV>(A + t * lda, lda, W, ldw, K, C + t * ldc, ldc);
  const float* a = A + t * lda;
  float* c = C + t * ldc;
  switch (M - t) {
    case 7: return rows_times_columns<(RB > 7 ? 7 : 1), NV>(a, lda, W, ldw, K, c, ldc);
    case 6: return rows_times_columns<(RB > 6 ? 6 : 1), NV>(a, lda, W, ldw, K, c, ldc);
    case 5: return rows_times_columns<(RB > 5 ? 5 : 1), NV>(a, lda, W, ldw, K, c, ldc);
    case 4: return rows_times_columns<(RB > 4 ? 4 : 1), NV>(a, lda, W, ldw, K, c, ldc);
    case 3: return rows_times_columns<(RB > 3 ? 3 : 1), NV>(a, lda, W, ldw, K, c, ldc);
    case 2: return rows_times_columns<(RB > 2 ? 2 : 1), NV>(a, lda, W, ldw, K, c, ldc);
    case 1: return rows_times_columns<1, NV>(a, lda, W, ldw, K, c, ldc);
    default: return;
  }
}

// C[:, n0:n1] = A W[:, n0:n1] for every row of A (M rows), W row-major [K, ldw]: blocks of 16 NV columns (wide
// blocks read longer runs of each weight row, for one or two rows of A), then of 32 and 16, then single columns.
template <int NV = 2>
void rows_times_weight_columns(const float* A, int64_t lda, int64_t M, const float* W, int64_t ldw, int64_t K,
                               int64_t n0, int64_t n1, float* C, int64_t ldc) {
  int64_t n = n0;
  for (; n + 16 * NV <= n1; n += 16 * NV) all_rows_times_columns<NV>(A, lda, M, W + n, ldw, K, C + n, ldc);
  for (; n + 32 <= n1; n += 32) all_rows_times_columns<2>(A, lda, M, W + n, ldw, K, C + n, ldc);
  if (n + 16 <= n1) {
    all_rows_times_columns<1>(A, lda, M, W + n, ldw, K, C + n, ldc);
    n += 16;
  }
  for (; n < n1; ++n) {
    for (int64_t t = 0; t < M; ++t) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += A[t * lda + k] * W[k * ldw + n];
      C[t * ldc + n] = acc;
    }
  }
}

// ---- small matmuls (the experts' in any layout, attention's, [out, in] linear rows) ------------------------------

// Columns n0 .. n0 + width of C = A W^T for TB rows, W^T's row k contiguous over n (width <= 64; FULL: exactly 64,
// a constant trip count, so the block's accumulators stay in registers).
template <int TB, bool FULL>
void contiguous_n_block(const float* A, int64_t lda, const float* W, int64_t wk, int64_t K, float* C, int64_t ldc,
                        int64_t width) {
  constexpr int64_t NB = 64;
  const int64_t cols = FULL ? NB : width;
  float acc[TB][NB];
  for (int t = 0; t < TB; ++t) {
    for (int64_t j = 0; j < cols; ++j) acc[t][j] = 0.0f;
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* w = W + k * wk;
    for (int t = 0; t < TB; ++t) {
      const float a = A[t * lda + k];
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) acc[t][j] += a * w[j];
    }
  }
  for (int t = 0; t < TB; ++t) std::copy(acc[t], acc[t] + cols, C + t * ldc);
}

template <int TB>
void matmul_rows_contiguous_n(const float* A, int64_t lda, const float* W, int64_t wk, int64_t N, int64_t K,
                              float* C, int64_t ldc) {  // wn == 1: row k of W^T is contiguous over n
  constexpr int64_t NB = 64;
  int64_t n0 = 0;
  for (; n0 + NB <= N; n0 += NB) contiguous_n_block<TB, true>(A, lda, W + n0, wk, K, C + n0, ldc, NB);
  if (n0 < N) contiguous_n_block<TB, false>(A, lda, W + n0, wk, K, C + n0, ldc, N - n0);
}

template <int TB>
void matmul_rows_contiguous_k(const float* A, int64_t lda, const float* W, int64_t wn, int64_t N, int64_t K,
                              float* C, int64_t ldc) {  // wk == 1: row n of W is contiguous over k
  constexpr int64_t RB = 4, KB = 16;
  const int64_t k_main = K - K % KB;
  int64_t n0 = 0;
  for (; n0 + RB <= N; n0 += RB) {
    float acc[TB][RB][KB] = {};
    for (int64_t k0 = 0; k0 < k_main; k0 += KB) {
      for (int r = 0; r < RB; ++r) {
        const float* w = W + (n0 + r) * wn + k0;
        for (int t = 0; t < TB; ++t) {
          const float* a = A + t * lda + k0;
#pragma omp simd
          for (int64_t j = 0; j < KB; ++j) acc[t][r][j] += a[j] * w[j];
        }
      }
    }
    for (int t = 0; t < TB; ++t) {
      for (int r = 0; r < RB; ++r) {
        float total = 0.0f;
        for (int64_t j = 0; j < KB; ++j) total += acc[t][r][j];
        for (int64_t k = k_main; k < K; ++k) total += A[t * lda + k] * W[(n0 + r) * wn + k];
        C[t * ldc + n0 + r] = total;
      }
    }
  }
  for (int t = 0; t < TB; ++t) {
    for (int64_t n = n0; n < N; ++n) C[t * ldc + n] = dot(A + t * lda, W + n * wn, K);
  }
}

template <int TB>
void matmul_block(const float* A, int64_t lda, const float* W, int64_t wn, int64_t wk, int64_t N, int64_t K,
                  float* C, int64_t ldc) {
  if (wn == 1) return matmul_rows_contiguous_n<TB>(A, lda, W, wk, N, K, C, ldc);
  if (wk == 1) return matmul_rows_contiguous_k<TB>(A, lda, W, wn, N, K, C, ldc);
  for (int t = 0; t < TB; ++t) {
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += A[t * lda + k] * W[n * wn + k * wk];
      C[t * ldc + n] = acc;
    }
  }
}

// C[t, n] = sum_k A[t, k] W[n, k] for a few rows t, W an [N, K] view with strides (wn, wk). The two layouts the
// engine stores (kernels' [out, in] and weight_layout's [in, out] under the same shape) each get a register-blocked
// loop that vectorises along W's contiguous dimension; other strides take the plain loop.
inline void matmul_wt(const float* A, int64_t lda, int64_t rows, const float* W, int64_t wn, int64_t wk, int64_t N,
                      int64_t K, float* C, int64_t ldc) {
  constexpr int64_t TB = 4;
  int64_t t = 0;
  for (; t + TB <= rows; t += TB) matmul_block<TB>(A + t * lda, lda, W, wn, wk, N, K, C + t * ldc, ldc);
  const float* a = A + t * lda;
  float* c = C + t * ldc;
  switch (rows - t) {
    case 3: return matmul_block<3>(a, lda, W, wn, wk, N, K, c, ldc);
    case 2: return matmul_block<2>(a, lda, W, wn, wk, N, K, c, ldc);
    case 1: return matmul_block<1>(a, lda, W, wn, wk, N, K, c, ldc);
    default: return;
  }
}

// silu(gate) * up over one row [gate (inter) | up (inter)] of an MLP's first projection, in place over the gate half.
inline void silu_and_mul(float* gate_up, int64_t inter) {
#pragma omp simd
  for (int64_t j = 0; j < inter; ++j) gate_up[j] = gate_up[j] * sigmoid(gate_up[j]) * gate_up[inter + j];
}

}  // namespace sgl_cpu
