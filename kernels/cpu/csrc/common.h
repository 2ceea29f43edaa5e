// Helpers shared by the fused CPU kernels: argument checks, index and row views, a vectorisable exp, and the
// register-blocked small matmuls that the linear layers, the experts and attention use.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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
  Index(const int32_t* p) : ptr_(p), wide_(false) {}
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
  Rows(const float* p, int64_t inner_, int64_t stride0_, int64_t stride1_)
      : data(const_cast<float*>(p)), inner(inner_), stride0(stride0_), stride1(stride1_) {}
  float* operator[](int64_t r) const { return data + (r / inner) * stride0 + (r % inner) * stride1; }
};

// Grain of at::parallel_for: below this many elements of work a range runs on the calling thread.
inline constexpr int64_t kGrainElements = 16384;

inline int64_t grain(int64_t work_per_item) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, work_per_item));
}

// Items [0, n) run by the threads, each thread taking the next run of items not yet taken as it finishes its last
// (guided: a run is 1 / (2 threads) of the items left, so runs start long and end single), not a fixed share of the
// range as at::parallel_for gives. A thread whose core is slower for a while (a shared host's other tenants) or whose
// items cost more (experts of more rows) then takes fewer, instead of the others waiting for it at the end; the long
// runs keep each thread's items adjacent (weights read in address order). f(item, next): `next` is the item this
// thread runs after it (claimed before `item` runs, so that its weights can be asked for early), or -1 (none, or
// not yet known: a run is taken early only while at least one is left for every thread, so that a thread that
// starts late still finds work). An item's values must not depend on the thread that runs it or on the order.
// `grain_items`: as at::parallel_for's grain (fewer items than that run on the calling thread).
template <class F>
void parallel_items(int64_t n, int64_t grain_items, const F& f) {
  if (n <= 0) return;
  grain_items = std::max<int64_t>(1, grain_items);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain_items - 1) / grain_items);
  std::atomic<int64_t> counter{0};
  const auto claim = [&](int64_t& begin, int64_t& end) {  // begin and end set only when a run was taken
    int64_t taken = counter.load(std::memory_order_relaxed), until = 0;
    do {
      if (taken >= n) return false;
      until = taken + std::max<int64_t>(1, (n - taken) / (2 * threads));
    } while (!counter.compare_exchange_weak(taken, until, std::memory_order_relaxed));
    begin = taken;
    end = until;
    return true;
  };
  const auto run = [&]() {
    int64_t begin = 0, end = 0;
    if (!claim(begin, end)) return;
    for (;;) {
      int64_t next_begin = -1, next_end = -1;
      for (int64_t item = begin; item < end; ++item) {
        int64_t next = item + 1;
        if (next == end) {  // the next run taken early only while every thread has one left to take
          const bool plenty = n - counter.load(std::memory_order_relaxed) >= threads;
          next = plenty && claim(next_begin, next_end) ? next_begin : -1;
        }
        f(item, next);
      }
      if (next_begin < 0 && !claim(next_begin, next_end)) return;
      begin = next_begin;
      end = next_end;
    }
  };
  if (threads <= 1 || at::in_parallel_region()) return run();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { run(); });
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

// ---- batch invariance (--enable-deterministic-inference) -----------------------------------------------------------

// Whether every kernel computes each row of its result in an order that does not depend on how many rows it has
// (kernels/batch_invariant.py): in the products (gemm.h) no split of K over the threads, no MKL, the same bf16 path
// at every row count (every product already adds each output's k terms one at a time in k order, whatever its tile;
// these are the paths that chose by row count); the decode blocks run a decode token through the prefill kernels.
// One switch per process, as SGLang's batch-invariant mode; kernels/cpu sets it.
inline std::atomic<bool>& batch_invariant_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}

inline bool batch_invariant() { return batch_invariant_flag().load(std::memory_order_relaxed); }

// ---- the target's vector registers ------------------------------------------------------------------------------

// How many vec16 values (16 floats, below) the target's vector registers hold at once, and the target's name. A
// register tile's accumulators plus the operands it reuses must fit in them, or the accumulators live on the stack
// and every FMA waits on a load and a store: AVX-512 has 32 registers of 16 floats; AVX2 16 of 8 (x86-64-v3, two
// to a vec16); NEON 32 of 4 (four to a vec16); plain SSE 16 of 4. The build's -march (SGLANG_CPU_ISA) picks one.
#if defined(__AVX512F__)
inline constexpr int kVec16Registers = 32;
inline constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
inline constexpr int kVec16Registers = 8;
inline constexpr const char* kIsa = "avx2";
#elif defined(__ARM_NEON) || defined(__aarch64__)
inline constexpr int kVec16Registers = 8;
inline constexpr const char* kIsa = "neon";
#else
inline constexpr int kVec16Registers = 4;
inline constexpr const char* kIsa = "generic";
#endif

// ---- 16 floats at a time ---------------------------------------------------------------------------------------

// Floats in one vector register of the target (16 on AVX-512, 8 on AVX2, 4 on NEON and SSE), and that register.
#if defined(__AVX512F__)
inline constexpr int kLanes = 16;
#elif defined(__AVX__)
inline constexpr int kLanes = 8;
#else
inline constexpr int kLanes = 4;
#endif
typedef float vreg __attribute__((vector_size(4 * kLanes)));
typedef int32_t ivreg __attribute__((vector_size(4 * kLanes)));

inline vreg load_reg(const float* p) {
  vreg v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Makes v opaque to the compiler at this point, as if computed here in a register: a value loaded once stays loaded
// once (the compiler would make the load each FMA's memory operand again, and then loads, not FMAs, bound a tile),
// and a product stays rounded before its add (GCC fuses a multiply and an add of vectors into an FMA).
// (A vreg or a float.)
template <class T>
inline void in_register(T& v) {
#if defined(__x86_64__)
  asm("" : "+v"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
}

// 16 floats, the unit of the kernels' tiles: one AVX-512 register, or 16 / kLanes registers held as an array of them.
// (GCC lowers a 64-byte vector type on a target without 64-byte registers through the stack: a tile of them spends
// most of its instructions on loads and stores. An array of native vectors stays in registers.)
#if defined(__AVX512F__)
typedef float vec16 __attribute__((vector_size(64)));

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }
#else
struct vec16 {
  static constexpr int kParts = 16 / kLanes;
  vreg part[kParts];
  vec16& operator+=(const vec16& o) {
    for (int i = 0; i < kParts; ++i) part[i] += o.part[i];
    return *this;
  }
};

inline vec16 operator+(vec16 a, const vec16& b) { return a += b; }

inline vec16 operator*(float s, const vec16& v) {
  vec16 r;
  for (int i = 0; i < vec16::kParts; ++i) r.part[i] = s * v.part[i];
  return r;
}

inline vec16 operator*(const vec16& v, float s) { return s * v; }

inline vec16 operator*(const vec16& a, const vec16& b) {
  vec16 r;
  for (int i = 0; i < vec16::kParts; ++i) r.part[i] = a.part[i] * b.part[i];
  return r;
}

inline vec16 load16(const float* p) {
  vec16 v;
  for (int i = 0; i < vec16::kParts; ++i) v.part[i] = load_reg(p + kLanes * i);
  return v;
}

inline void store16(float* p, const vec16& v) {
  for (int i = 0; i < vec16::kParts; ++i) std::memcpy(p + kLanes * i, &v.part[i], sizeof(vreg));
}
#endif

// silu(gate) * up over one row [gate (inter) | up (inter)] of an MLP's first projection, in place over the gate half.
inline void silu_and_mul(float* gate_up, int64_t inter) {
#pragma omp simd
  for (int64_t j = 0; j < inter; ++j) gate_up[j] = gate_up[j] * sigmoid(gate_up[j]) * gate_up[inter + j];
}

}  // namespace sgl_cpu
