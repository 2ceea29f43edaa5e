// Products of a few rows of float32 activations with a weight matrix stored [in, out] (row k of W^T contiguous over
// the output columns), whose elements are float32, bf16 or e4m3 (FP8) with one float32 scale per block: each weight
// is widened to float32 in registers and every product accumulates in float32, so a 16-bit or 8-bit weight costs
// half or a quarter of the bytes a float32 one does, which is what a decode step waits on.
//
// bf16 weights may instead take AVX512-BF16's vdpbf16ps (two products per float32 lane per instruction): the
// activations are then rounded to bf16 too, as llama.cpp rounds them. Where it pays depends on the CPU
// (bf16_dot_for). The widening path stays the definition and the path on CPUs without the instruction.
#pragma once

#include "common.h"

#include <chrono>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace sgl_cpu {

// ---- weight element types: each widens 16 consecutive weights to float32 ---------------------------------------

struct F32Weight {
  using T = float;
  static constexpr bool kScaled = false;
  static vec16 load(const float* p) { return load16(p); }
  static float at(const float* p) { return *p; }
};

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as vcvtneps2bf16 does; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// bf16 is the upper half of a float32: widening is a shift.
struct Bf16Weight {
  using T = uint16_t;
  static constexpr bool kScaled = false;
  static vec16 load(const uint16_t* p) {
#if defined(__AVX512F__)  // one vpmovzxwd and one shift (the generic form compiles to 256-bit halves)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    vec16 v;
    std::memcpy(&v, &f, sizeof(v));
    return v;
#elif defined(__AVX2__)  // two vpmovzxwd and two shifts, one per 8 weights
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
    vec16 v;
    v.part[0] = (vreg)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16));
    v.part[1] = (vreg)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16));
    return v;
#else
    float wide[16];
    for (int i = 0; i < 16; ++i) wide[i] = bf16_to_float(p[i]);
    return load16(wide);
#endif
  }
  static float at(const uint16_t* p) { return bf16_to_float(*p); }
};

// e4m3fn (sign, 4 exponent bits of bias 7, 3 mantissa bits) moved to float16's bit positions reads as its value times
// 2^-8 exactly, subnormals included; vcvtph2ps widens that to float32, and kUnbias, folded into the block scales,
// restores the value. The NaN pattern (0x7f) reads as a finite 480: checkpoints hold no NaN weights.
struct Fp8Weight {
  using T = uint8_t;
  static constexpr bool kScaled = true;
  static constexpr float kUnbias = 256.0f;
  static vec16 load(const uint8_t* p) {
#if defined(__AVX512F__)
    const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(static_cast<short>(0xbf80)));
    const __m512 f = _mm512_cvtph_ps(half);
    vec16 v;
    std::memcpy(&v, &f, sizeof(v));
    return v;
#elif defined(__AVX2__) && defined(__F16C__)  // the same moves on 16 bytes, then two vcvtph2ps of 8 halves
    const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(static_cast<short>(0xbf80)));
    vec16 v;
    v.part[0] = (vreg)_mm256_cvtph_ps(_mm256_castsi256_si128(half));
    v.part[1] = (vreg)_mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
    return v;
#else
    float wide[16];
    for (int i = 0; i < 16; ++i) wide[i] = at(p + i);
    return load16(wide);
#endif
  }
  static float at(const uint8_t* p) {  // the same value times 2^-8
    const int exponent = (*p >> 3) & 15, mantissa = *p & 7;
    const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -17)
                                          : std::ldexp(static_cast<float>(8 + mantissa), exponent - 18);
    return (*p & 0x80) ? -magnitude : magnitude;
  }
};

// ---- block scales -------------------------------------------------------------------------------------------------

// The scales of one group of output columns (all inside one block of bn columns): one per bk rows of K.
struct KScales {
  const float* row = nullptr;
  int64_t stride = 0, block = 0;
  float factor = 1.0f;
  float at(int64_t k_block) const { return row[k_block * stride] * factor; }
};

// The scales of a whole [N, K] weight (W = w * scale over each bn x bk block); empty for unscaled weights.
struct WeightScales {
  const float* data = nullptr;
  int64_t n_stride = 0, k_stride = 0, bn = 0, bk = 0;
  float factor = 1.0f;
  KScales columns(int64_t n0) const {
    return data == nullptr ? KScales{} : KScales{data + (n0 / bn) * n_stride, k_stride, bk, factor};
  }
};

// The k range [k0, k1) of the scale block that starts at k0 (all of K for unscaled weights), and its scale.
template <class W>
inline int64_t k_block_end(const KScales& s, int64_t k0, int64_t K) {
  return W::kScaled ? std::min(K, k0 + s.block) : K;
}

template <class W>
inline float k_block_scale(const KScales& s, int64_t k0) {
  return W::kScaled ? s.at(k0 / s.block) : 1.0f;
}

// ---- widening products --------------------------------------------------------------------------------------------

// Rows of A that a register tile of 16 NV columns takes (common.h's kVec16Registers): its TB NV accumulators, NV
// weight vectors reused across the rows and a broadcast activation fit the target's registers. AVX-512: 8 rows of
// 32 columns, 4 of 64, 2 of 128; AVX2 and NEON (a quarter of the room): 6 rows of 16 columns (12 ymm accumulators,
// the classic AVX2 tile), 2 of 32, 1 of wider; plain SSE 2 rows of 16.
template <int NV>
constexpr int row_tile() {
  if constexpr (kVec16Registers >= 32) return NV <= 2 ? 8 : (NV <= 4 ? 4 : (NV <= 8 ? 2 : 1));
  if constexpr (kVec16Registers >= 8) return NV == 1 ? 6 : (NV == 2 ? 2 : 1);
  return NV == 1 ? 2 : 1;
}

// Whether many rows through 16 NV columns run faster as NV passes of 16 columns: where row_tile<1> rows of 16
// columns do more FMAs per weight vector loaded than row_tile<NV> rows of NV vectors, or the wide tile does not fit
// (AVX2: 6 x 16 against 2 x 32). On AVX-512 the wide tiles fit and are kept.
template <int NV>
constexpr bool kSplitColumns =
    NV > 1 && (row_tile<1>() > NV * row_tile<NV>() || NV * (row_tile<NV>() + 1) > kVec16Registers);

// Vectors of 16 columns that one or two rows' products take at a time, reading long runs of each weight row: as many
// as the registers hold with room for the weights (8 on AVX-512, 4 on AVX2 and NEON).
inline constexpr int kWideVectors = kVec16Registers >= 32 ? 8 : 4;

// C[t, 0:16 NV] = sum_k A[t, k] W[k, 0:16 NV] for TB rows t: TB NV accumulators in registers, each W row segment
// loaded (and widened) once for all TB rows; a scaled weight's block scale multiplies the activation instead.
// `add`: C's values are added to (a later part of K), instead of written.
template <class W, int TB, int NV>
void rows_times_columns(const float* A, int64_t lda, const typename W::T* Wp, int64_t ldw, int64_t K, float* C,
                        int64_t ldc, const KScales& s, bool add = false) {
  vec16 acc[TB][NV];
  for (int t = 0; t < TB; ++t) {
    for (int v = 0; v < NV; ++v) acc[t][v] = add ? load16(C + t * ldc + 16 * v) : vec16{};
  }
  for (int64_t k0 = 0; k0 < K;) {
    const int64_t k1 = k_block_end<W>(s, k0, K);
    const float scale = k_block_scale<W>(s, k0);
    for (int64_t k = k0; k < k1; ++k) {
      vec16 w[NV];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) w[v] = W::load(Wp + k * ldw + 16 * v);
#pragma GCC unroll 16
      for (int t = 0; t < TB; ++t) {
        const float a = W::kScaled ? A[t * lda + k] * scale : A[t * lda + k];
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) acc[t][v] += a * w[v];
      }
    }
    k0 = k1;
  }
  for (int t = 0; t < TB; ++t) {
    for (int v = 0; v < NV; ++v) store16(C + t * ldc + 16 * v, acc[t][v]);
  }
}

// Rows of a weight read ahead of their use by the one-row products: a row's run in a block of columns is short and
// far from the next row's, and without being asked for early the loads wait on memory one run at a time.
constexpr int64_t kPrefetchRows = 12;

// y[0:16 NV] = x W[:, 0:16 NV] for one row x, the weight read from memory: four weight rows at a time, each as one
// run of 16 NV elements (four streams the prefetchers follow), the accumulators in registers / L1.
template <class W, int NV>
void one_row_times_columns(const float* x, const typename W::T* Wp, int64_t ldw, int64_t K, float* y,
                           const KScales& s) {
  vec16 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = vec16{};
  for (int64_t k0 = 0; k0 < K;) {
    const int64_t k1 = k_block_end<W>(s, k0, K);
    const float scale = k_block_scale<W>(s, k0);
    int64_t k = k0;
    for (; k + 4 <= k1; k += 4) {
      const float a0 = x[k] * scale, a1 = x[k + 1] * scale, a2 = x[k + 2] * scale, a3 = x[k + 3] * scale;
      const typename W::T *w0 = Wp + k * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
      if constexpr (!std::is_same_v<W, F32Weight>) {  // short runs of narrow weights: ask for them early
        for (int r = 0; r < 4; ++r) {
          const char* ahead = reinterpret_cast<const char*>(w0 + (kPrefetchRows + r) * ldw);
          for (int64_t b = 0; b < NV * 16 * static_cast<int64_t>(sizeof(typename W::T)); b += 64) {
            __builtin_prefetch(ahead + b, 0, 3);
          }
        }
      }
#pragma GCC unroll 16  // widened weights (NV <= 16): the accumulators stay in registers
      for (int v = 0; v < NV; ++v) {  // one product at a time, in k order: the tiles' order (batch invariance)
        acc[v] += a0 * W::load(w0 + 16 * v);
        acc[v] += a1 * W::load(w1 + 16 * v);
        acc[v] += a2 * W::load(w2 + 16 * v);
        acc[v] += a3 * W::load(w3 + 16 * v);
      }
    }
    for (; k < k1; ++k) {
      for (int v = 0; v < NV; ++v) acc[v] += (x[k] * scale) * W::load(Wp + k * ldw + 16 * v);
    }
    k0 = k1;
  }
  for (int v = 0; v < NV; ++v) store16(y + 16 * v, acc[v]);
}

// Widest run of columns whose sums stay in L1 (8 KB of float32) while one weight row at a time passes through them.
constexpr int64_t kRowRunColumns = 2048;

// C[t, 0:n] += sum_k A[t, k] W[k, 0:n] for M rows of A (one or two) and n (a multiple of 16, at most kRowRunColumns)
// columns of an unscaled weight: one weight row at a time, read whole, so that a weight whose rows are n elements
// apart streams in address order (from memory 1.3-1.7x the column blocks' speed up to 1024 columns, on AVX2 and
// AVX-512: docs/performance.md). Each column sums its products in k order, as the other products do.
template <class W, int TM>
void rows_add_weight_rows(const float* A, int64_t lda, const typename W::T* Wp, int64_t ldw, int64_t K, int64_t n,
                          float* C, int64_t ldc) {
  static_assert(!W::kScaled, "scaled weights take their block scales per 128 columns");
  for (int64_t k = 0; k < K; ++k) {
    const typename W::T* w = Wp + k * ldw;
    for (int64_t j = 0; j < n; j += 16) {
      const vec16 wk = W::load(w + j);
#pragma GCC unroll 2
      for (int t = 0; t < TM; ++t) store16(C + t * ldc + j, load16(C + t * ldc + j) + A[t * lda + k] * wk);
    }
  }
}

template <class W>
void rows_add_weight_rows(const float* A, int64_t lda, int64_t M, const typename W::T* Wp, int64_t ldw, int64_t K,
                          int64_t n, float* C, int64_t ldc) {
  TORCH_CHECK(M == 1 || M == 2, "a weight's rows read whole take one or two rows of activations, got ", M);
  if (M == 1) return rows_add_weight_rows<W, 1>(A, lda, Wp, ldw, K, n, C, ldc);
  rows_add_weight_rows<W, 2>(A, lda, Wp, ldw, K, n, C, ldc);
}

// C[t, 0:n] += sum_k A[t, k] W[k, 0:n] for TM rows of A and n (a multiple of 16) columns of an unscaled weight, its
// rows read four at a time as runs of n elements, each widened once for all TM rows (every column sums its products
// in k order, so each row's values are one row's).
template <class W, int TM>
void few_rows_add_long_runs(const float* A, int64_t lda, const typename W::T* Wp, int64_t ldw, int64_t K, int64_t n,
                            float* C, int64_t ldc) {
  static_assert(!W::kScaled, "scaled weights take their block scales per 128 columns");
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const typename W::T *w0 = Wp + k * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
    for (int64_t j = 0; j < n; j += 16) {
      const vec16 x0 = W::load(w0 + j), x1 = W::load(w1 + j), x2 = W::load(w2 + j), x3 = W::load(w3 + j);
#pragma GCC unroll 8
      for (int t = 0; t < TM; ++t) {
        const float* a = A + t * lda + k;
        vec16 sum = load16(C + t * ldc + j);
        sum += a[0] * x0;
        sum += a[1] * x1;
        sum += a[2] * x2;
        sum += a[3] * x3;
        store16(C + t * ldc + j, sum);
      }
    }
  }
  for (; k < K; ++k) {
    for (int64_t j = 0; j < n; j += 16) {
      const vec16 x = W::load(Wp + k * ldw + j);
      for (int t = 0; t < TM; ++t) store16(C + t * ldc + j, load16(C + t * ldc + j) + A[t * lda + k] * x);
    }
  }
}

// y[0:n] += x W[:, 0:n] for one row x and n (a multiple of 16) columns of an unscaled weight, K rows, each read whole
// as one run of n elements, the accumulators y itself: up to kRowRunColumns one row at a time (above); wider, four
// rows at a time, which reads y (in L2 then) a quarter as often (an LM head of 32000 columns: 1.2-1.7x the speed of
// one row at a time).
template <class W>
void one_row_add_long_run(const float* x, const typename W::T* Wp, int64_t ldw, int64_t K, int64_t n, float* y) {
  static_assert(!W::kScaled, "scaled weights take their block scales per 128 columns");
  if (n <= kRowRunColumns) return rows_add_weight_rows<W>(x, 0, 1, Wp, ldw, K, n, y, 0);
  few_rows_add_long_runs<W, 1>(x, 0, Wp, ldw, K, n, y, 0);
}

// The cache lines of the next weight block, asked for a few at a time before each register tile of this one: a
// block's rows are a whole weight row apart, no hardware prefetcher follows them, and widening the next block would
// otherwise wait on memory one row at a time (the 128-token prefill at the 120M shape, AVX2: 1-4% faster).
struct BlockAhead {
  const char* base = nullptr;
  int64_t stride = 0, lines = 0, row_lines = 1, next = 0, per_tile = 0;
  void step() {
    for (int64_t i = 0; i < per_tile && next < lines; ++i, ++next) {
      __builtin_prefetch(base + (next / row_lines) * stride + (next % row_lines) * 64, 0, 3);
    }
  }
};

// Independent accumulator registers a tile needs to keep the FMA units busy (two units, four cycles' latency): with
// fewer, each k waits on the previous k's sums.
inline constexpr int kFmaChains = 8;

// Every row of A through one block of 16 NV columns, row_tile<NV> rows at a time, so that the tile's accumulators stay
// in registers (or NV passes of 16 columns, kSplitColumns). A last tile of too few rows to fill kFmaChains registers
// and the full tile before it run as two tiles of nearly equal size (AVX2, bf16 experts of 13, 14 and 19 rows: 6 + 6
// + 1 rows took as long as 6 + 6 + 3, and 6 + 4 + 3 ran 5% faster; 1.5-5% for those row counts, nothing for the
// others). Each row's sums are the same either way. `ahead`: stepped before each full tile (and that pair).
template <class W, int NV>
void all_rows_times_columns(const float* A, int64_t lda, int64_t M, const typename W::T* Wp, int64_t ldw, int64_t K,
                            float* C, int64_t ldc, const KScales& s, bool add = false, BlockAhead* ahead = nullptr) {
  constexpr int RB = row_tile<NV>();
  if constexpr (kSplitColumns<NV>) {
    if (M > RB) {  // one pass per 16 columns (their scale block is this one's: s stays)
      for (int v = 0; v < NV; ++v) {
        all_rows_times_columns<W, 1>(A, lda, M, Wp + 16 * v, ldw, K, C + 16 * v, ldc, s, add, ahead);
      }
      return;
    }
  }
  int64_t t = 0;
  const bool balance = M > RB && M % RB > 0 && (M % RB) * NV * (16 / kLanes) < kFmaChains;
  const int64_t stop = balance ? M - RB - M % RB : M;
  for (; t + RB <= stop; t += RB) {
    if (ahead != nullptr) ahead->step();
    rows_times_columns<W, RB, NV>(A + t * lda, lda, Wp, ldw, K, C + t * ldc, ldc, s, add);
  }
  if (balance) {
    if (ahead != nullptr) ahead->step();
    const int64_t first = (M - t + 1) / 2;
    all_rows_times_columns<W, NV>(A + t * lda, lda, first, Wp, ldw, K, C + t * ldc, ldc, s, add);
    t += first;
  }
  const float* a = A + t * lda;
  float* c = C + t * ldc;
  switch (M - t) {
    case 7: return rows_times_columns<W, (RB > 7 ? 7 : 1), NV>(a, lda, Wp, ldw, K, c, ldc, s, add);
    case 6: return rows_times_columns<W, (RB > 6 ? 6 : 1), NV>(a, lda, Wp, ldw, K, c, ldc, s, add);
    case 5: return rows_times_columns<W, (RB > 5 ? 5 : 1), NV>(a, lda, Wp, ldw, K, c, ldc, s, add);
    case 4: return rows_times_columns<W, (RB > 4 ? 4 : 1), NV>(a, lda, Wp, ldw, K, c, ldc, s, add);
    case 3: return rows_times_columns<W, (RB > 3 ? 3 : 1), NV>(a, lda, Wp, ldw, K, c, ldc, s, add);
    case 2: return rows_times_columns<W, (RB > 2 ? 2 : 1), NV>(a, lda, Wp, ldw, K, c, ldc, s, add);
    case 1: return rows_times_columns<W, 1, NV>(a, lda, Wp, ldw, K, c, ldc, s, add);
    default: return;
  }
}

// ---- many rows through a block of a weight: widened (or copied) once --------------------------------------------

// Rows of K whose widened block of 32 columns (32 KB of float32) stays in L1 while every group of rows passes.
constexpr int64_t kPackedDepth = 256;
// More rows of A than this (more than three groups of 8, or four of 6 on AVX2) and a block is widened once into a
// contiguous float32 copy instead of by each group: the groups then run float32 FMAs only, from a copy whose rows
// are adjacent (a weight's rows a whole row apart map to few cache sets, and each group would fetch them again; the
// figures: docs/performance.md). Below it the copy costs more than it saves: 9-24 rows (a prefill's experts, ~16
// rows each) ran 13-25% faster widened by each group (AVX2, 1 thread), the 128-token MoE 10-25% (AVX2 and AVX-512
// widened). The same values either way: each column sums its rows' products in k order.
constexpr int64_t kPackRows = 24;

// The 32 columns at Wp of K weight rows (ldw apart), widened into a thread's buffer: row k at 32 k.
template <class W>
const float* pack_widened(const typename W::T* Wp, int64_t ldw, int64_t K) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < K * 32) buffer.resize(K * 32);
  float* out = buffer.data();
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(Wp + (k + kPrefetchRows) * ldw, 0, 3);  // rows far apart: no hardware prefetcher follows
    store16(out + k * 32, W::load(Wp + k * ldw));
    store16(out + k * 32 + 16, W::load(Wp + k * ldw + 16));
  }
  return out;
}

// A's M rows times the scales of their k blocks, into a thread's buffer (rows K apart): each activation as the tiles
// of a scaled weight multiply it before its product.
inline const float* scaled_rows(const float* A, int64_t lda, int64_t M, int64_t K, const KScales& s) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < M * K) buffer.resize(M * K);
  float* out = buffer.data();
  for (int64_t k0 = 0; k0 < K; k0 += s.block) {
    const int64_t k1 = std::min(K, k0 + s.block);
    const float scale = s.at(k0 / s.block);
    for (int64_t t = 0; t < M; ++t) {
      for (int64_t k = k0; k < k1; ++k) out[t * K + k] = A[t * lda + k] * scale;
    }
  }
  return out;
}

// C[:, 0:32] = A W[:, 0:32] for M (> kPackRows) rows: the block widened once (a scaled weight's values as W::load
// gives them, its scales taken into the activations: the same products as the tiles of W make), then K in parts of
// kPackedDepth rows, each part through every group of 8 rows (the later parts adding to C); `next`: the block this
// thread takes next, asked for while this one runs.
template <class W>
void many_rows_times_32_columns(const float* A, int64_t lda, int64_t M, const typename W::T* Wp, int64_t ldw,
                                int64_t K, float* C, int64_t ldc, const KScales& s,
                                const typename W::T* next = nullptr) {
  const float* packed = pack_widened<W>(Wp, ldw, K);
  if constexpr (W::kScaled) {
    A = scaled_rows(A, lda, M, K, s);
    lda = K;
  }
  BlockAhead ahead;
  if (next != nullptr) {  // spread over the full tiles of every part of K
    constexpr int RB1 = row_tile<1>(), RB2 = row_tile<2>();
    const int64_t per_part = kSplitColumns<2> && M > RB2 ? 2 * (M / RB1) : M / RB2;
    const int64_t tiles = std::max<int64_t>(1, (K + kPackedDepth - 1) / kPackedDepth * per_part);
    ahead.base = reinterpret_cast<const char*>(next);
    ahead.stride = ldw * static_cast<int64_t>(sizeof(typename W::T));
    ahead.row_lines = (32 * static_cast<int64_t>(sizeof(typename W::T)) + 63) / 64;
    ahead.lines = K * ahead.row_lines;
    ahead.per_tile = (ahead.lines + tiles - 1) / tiles;
  }
  for (int64_t k0 = 0; k0 < K; k0 += kPackedDepth) {
    const int64_t depth = std::min(kPackedDepth, K - k0);
    all_rows_times_columns<F32Weight, 2>(A + k0, lda, M, packed + k0 * 32, 32, depth, C, ldc, KScales{}, k0 > 0,
                                         next != nullptr ? &ahead : nullptr);
  }
}

// C[:, 0:32] = A W[:, 0:32] for every row of A (M rows), widened: once per block for many rows (`next`: as
// many_rows_times_32_columns takes it), else in registers for each group of rows.
template <class W>
void all_rows_times_32_columns(const float* A, int64_t lda, int64_t M, const typename W::T* Wp, int64_t ldw,
                               int64_t K, float* C, int64_t ldc, const KScales& s,
                               const typename W::T* next = nullptr) {
  if (M > kPackRows) return many_rows_times_32_columns<W>(A, lda, M, Wp, ldw, K, C, ldc, s, next);
  all_rows_times_columns<W, 2>(A, lda, M, Wp, ldw, K, C, ldc, s);
}

// Fewer than 16 columns [n, n1) of every row of A (a narrow weight: a router, a gate; or a wider one's last
// columns), side by side in P vector registers, R rows at a time. Each output adds its products in k order, the
// activation times the k block's scale times the weight and then the add, as one row alone would: the values do not
// depend on the rows beside it. (One column a pass, scalar, left each row's adds waiting on the last: 128 rows x 128
// -> 8 columns took 91-103 us, this 6-8 us; docs/performance.md.) `panel` holds the columns widened, P kLanes a k.
template <class W, int P, int R>
void few_columns_tile(const float* A, int64_t lda, const float* panel, int64_t K, const KScales& s, float* out) {
  vreg acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) acc[r][p] = vreg{};
  }
  for (int64_t k0 = 0; k0 < K;) {
    const int64_t k1 = k_block_end<W>(s, k0, K);
    const float scale = k_block_scale<W>(s, k0);
    for (int64_t k = k0; k < k1; ++k) {
      vreg w[P];
      for (int p = 0; p < P; ++p) w[p] = load_reg(panel + (k * P + p) * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float a = A[r * lda + k] * scale;
        for (int p = 0; p < P; ++p) {
          vreg product = a * w[p];
          in_register(product);  // rounded, then added, as one row alone is (GCC fuses vector forms)
          acc[r][p] = acc[r][p] + product;
        }
      }
    }
    k0 = k1;
  }
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) std::memcpy(out + (r * P + p) * kLanes, &acc[r][p], sizeof(vreg));
  }
}

// y[0:CB] = x W[:, 0:CB] for one row x, each output's products added in k order, rounded first (as
// few_columns_tile adds them).
template <class W, int CB>
void row_times_columns_in_k_order(const float* x, const typename W::T* Wp, int64_t ldw, int64_t K, const KScales& s,
                                  float* y) {
  float acc[CB] = {};
  for (int64_t k0 = 0; k0 < K;) {
    const int64_t k1 = k_block_end<W>(s, k0, K);
    const float scale = k_block_scale<W>(s, k0);
    for (int64_t k = k0; k < k1; ++k) {
      const float a = x[k] * scale;
      for (int c = 0; c < CB; ++c) {
        float product = a * W::at(Wp + k * ldw + c);
        in_register(product);
        acc[c] += product;
      }
    }
    k0 = k1;
  }
  std::copy_n(acc, CB, y);
}

// Rows of a few_columns_tile: R while there are, then one at a time.
inline constexpr int kFewColumnRows = kVec16Registers >= 32 ? 8 : 4;

template <class W, int P>
void rows_times_few_columns_of(const float* A, int64_t lda, int64_t M, const float* panel, int64_t K, int64_t cols,
                               const KScales& s, float* C, int64_t ldc) {
  float out[kFewColumnRows * P * kLanes];
  for (int64_t t = 0; t < M;) {
    const int rows = M - t >= kFewColumnRows ? kFewColumnRows : 1;
    if (rows == kFewColumnRows) {
      few_columns_tile<W, P, kFewColumnRows>(A + t * lda, lda, panel, K, s, out);
    } else {
      few_columns_tile<W, P, 1>(A + t * lda, lda, panel, K, s, out);
    }
    for (int r = 0; r < rows; ++r) std::memcpy(C + (t + r) * ldc, out + r * P * kLanes, cols * sizeof(float));
    t += rows;
  }
}

// C[:, n:n1] = A W[:, n:n1] for n1 - n < 16 columns (inside one scale block of a scaled weight); the same values for
// a row whatever M is.
template <class W>
void rows_times_few_columns(const float* A, int64_t lda, int64_t M, const typename W::T* Wp, int64_t ldw, int64_t K,
                            int64_t n, int64_t n1, float* C, int64_t ldc, const KScales& s) {
  const int64_t cols = n1 - n;
  if (M < kFewColumnRows) {  // a few rows (decode): CB columns' adds interleaved, each rounded as in the tile
    for (int64_t t = 0; t < M; ++t) {
      int64_t c = 0;
      for (; c + 4 <= cols; c += 4) row_times_columns_in_k_order<W, 4>(A + t * lda, Wp + n + c, ldw, K, s, C + t * ldc + n + c);
      for (; c < cols; ++c) row_times_columns_in_k_order<W, 1>(A + t * lda, Wp + n + c, ldw, K, s, C + t * ldc + n + c);
    }
    return;
  }
  const int P = static_cast<int>((cols + kLanes - 1) / kLanes);  // 1, or 2 where a register holds 8 or 4
  thread_local std::vector<float> panel;
  panel.assign(K * P * kLanes, 0.0f);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t c = 0; c < cols; ++c) panel[k * P * kLanes + c] = W::at(Wp + k * ldw + n + c);
  }
  switch (P) {
    case 1: return rows_times_few_columns_of<W, 1>(A, lda, M, panel.data(), K, cols, s, C + n, ldc);
    case 2: return rows_times_few_columns_of<W, 2>(A, lda, M, panel.data(), K, cols, s, C + n, ldc);
    case 3: return rows_times_few_columns_of<W, 3>(A, lda, M, panel.data(), K, cols, s, C + n, ldc);
    default: return rows_times_few_columns_of<W, 4>(A, lda, M, panel.data(), K, cols, s, C + n, ldc);
  }
}

// C[:, n0:n1] = A W[:, n0:n1] for every row of A (M rows): blocks of 16 NV columns (wide blocks read longer runs of
// each weight row, for one or two rows of A; blocks of 32 widened once for many rows), then of 32 and 16, then the
// last few side by side. Scaled weights: n0 must start
// a block of 16 NV columns inside one scale block (bn a multiple of 128).
template <class W, int NV = 2>
void rows_times_weight_columns(const float* A, int64_t lda, int64_t M, const typename W::T* Wp, int64_t ldw, int64_t K,
                               int64_t n0, int64_t n1, float* C, int64_t ldc, const WeightScales& sc) {
  int64_t n = n0;
  if (M > kPackRows) {  // many rows: blocks widened once
    for (; n + 32 <= n1; n += 32) {
      many_rows_times_32_columns<W>(A, lda, M, Wp + n, ldw, K, C + n, ldc, sc.columns(n),
                                    n + 64 <= n1 ? Wp + n + 32 : nullptr);
    }
  }
  for (; n + 16 * NV <= n1; n += 16 * NV) {
    all_rows_times_columns<W, NV>(A, lda, M, Wp + n, ldw, K, C + n, ldc, sc.columns(n));
  }
  for (; n + 32 <= n1; n += 32) all_rows_times_columns<W, 2>(A, lda, M, Wp + n, ldw, K, C + n, ldc, sc.columns(n));
  if (n + 16 <= n1) {
    all_rows_times_columns<W, 1>(A, lda, M, Wp + n, ldw, K, C + n, ldc, sc.columns(n));
    n += 16;
  }
  if (n < n1) rows_times_few_columns<W>(A, lda, M, Wp, ldw, K, n, n1, C, ldc, sc.columns(n));
}

// ---- vdpbf16ps: bf16 activations and weights, float32 accumulators ---------------------------------------------------

// Rows of A rounded to bf16, each padded with a zero to an even length: read as uint32, entry kp of a row is the
// pair (A[t, 2kp], A[t, 2kp + 1]) that vdpbf16ps multiplies with a pair of weight rows.
struct Bf16Pairs {
  std::vector<uint16_t> data;
  int64_t pairs = 0;  // per row
  const uint32_t* row(int64_t t) const { return reinterpret_cast<const uint32_t*>(data.data()) + t * pairs; }
};

inline void to_bf16_pairs(const float* A, int64_t lda, int64_t M, int64_t K, Bf16Pairs& out) {
  out.pairs = (K + 1) / 2;
  out.data.assign(M * 2 * out.pairs, 0);
  for (int64_t t = 0; t < M; ++t) {
    uint16_t* dst = out.data.data() + t * 2 * out.pairs;
    const float* src = A + t * lda;
#pragma omp simd
    for (int64_t k = 0; k < K; ++k) dst[k] = float_to_bf16(src[k]);
  }
}

#if defined(__AVX512BF16__)
constexpr bool kHaveDpbf16 = true;

// C[t, 0:32] for TB rows from bf16 weight rows taken in pairs: unpacklo/hi_epi16 of rows k and k + 1 interleave
// them within each 128-bit lane, so `lo` accumulates columns {0-3, 8-11, 16-19, 24-27} and `hi` the others; the
// store puts them back in order. An odd K's last row pairs with zeros (the activations' padding is zero too).
// The pairs of rows of a block of 32 bf16 weight columns as vdpbf16ps operands, read from the weight itself ...
struct DirectPairs {
  const uint16_t* w;
  int64_t ldw, K;
  void at(int64_t kp, __m512bh& lo, __m512bh& hi) const {
    const uint16_t* w0 = w + 2 * kp * ldw;
    const __m512i r0 = _mm512_loadu_si512(w0);
    const __m512i r1 = 2 * kp + 1 < K ? _mm512_loadu_si512(w0 + ldw) : _mm512_setzero_si512();
    lo = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
    hi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
  }
};

// ... or from a contiguous copy of them, interleaved once (pack_pairs) for a block that many rows go through: rows
// of the weight a whole row apart map to few cache sets (a 6144-column bf16 weight: one L1 set), and every group of
// rows would fetch the block again from L2 or beyond (the figures: docs/performance.md).
struct PackedPairs {
  const uint16_t* p;
  void at(int64_t kp, __m512bh& lo, __m512bh& hi) const {
    lo = (__m512bh)_mm512_loadu_si512(p + kp * 64);
    hi = (__m512bh)_mm512_loadu_si512(p + kp * 64 + 32);
  }
};

inline const uint16_t* pack_pairs(const DirectPairs& src, int64_t pairs) {
  thread_local std::vector<uint16_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < pairs * 64) buffer.resize(pairs * 64);
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512bh lo, hi;
    src.at(kp, lo, hi);
    _mm512_storeu_si512(buffer.data() + kp * 64, (__m512i)lo);
    _mm512_storeu_si512(buffer.data() + kp * 64 + 32, (__m512i)hi);
  }
  return buffer.data();
}

// Stores a block's 32 column sums in column order from its lo and hi accumulators (interleaved as above).
__attribute__((always_inline)) inline void store_in_order(__m512 lo, __m512 hi, float* c) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(c, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(c + 16, _mm512_permutex2var_ps(lo, second, hi));
}

template <int TB, class Pairs>
void rows_times_32_columns_dp(const Bf16Pairs& A, int64_t t0, const Pairs& w, float* C, int64_t ldc) {
  __m512 lo[TB], hi[TB];
  for (int t = 0; t < TB; ++t) lo[t] = hi[t] = _mm512_setzero_ps();
  const uint32_t* rows[TB];
  for (int t = 0; t < TB; ++t) rows[t] = A.row(t0 + t);
  for (int64_t kp = 0; kp < A.pairs; ++kp) {
    __m512bh wl, wh;
    w.at(kp, wl, wh);
    for (int t = 0; t < TB; ++t) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(rows[t][kp]));
      lo[t] = _mm512_dpbf16_ps(lo[t], a, wl);
      hi[t] = _mm512_dpbf16_ps(hi[t], a, wh);
    }
  }
  for (int t = 0; t < TB; ++t) store_in_order(lo[t], hi[t], C + t * ldc);
}

template <class Pairs>
void all_rows_times_32_columns_dp(const Bf16Pairs& A, int64_t first_row, int64_t M, const Pairs& w, float* C,
                                  int64_t ldc) {
  int64_t t = 0;
  for (; t + 8 <= M; t += 8) rows_times_32_columns_dp<8>(A, first_row + t, w, C + t * ldc, ldc);
  const int64_t r = first_row + t;
  float* c = C + t * ldc;
  switch (M - t) {
    case 7: return rows_times_32_columns_dp<7>(A, r, w, c, ldc);
    case 6: return rows_times_32_columns_dp<6>(A, r, w, c, ldc);
    case 5: return rows_times_32_columns_dp<5>(A, r, w, c, ldc);
    case 4: return rows_times_32_columns_dp<4>(A, r, w, c, ldc);
    case 3: return rows_times_32_columns_dp<3>(A, r, w, c, ldc);
    case 2: return rows_times_32_columns_dp<2>(A, r, w, c, ldc);
    case 1: return rows_times_32_columns_dp<1>(A, r, w, c, ldc);
    default: return;
  }
}

// One pair of weight rows (w0 and the row ldw after it, zeros where `paired` is false) into NV groups of 32
// columns' accumulators: the pair interleaved by unpacklo/hi (lo and hi as above), times the activation pair `a`.
template <int NV>
__attribute__((always_inline)) inline void dp_pair_step(const uint16_t* w0, int64_t ldw, bool paired, __m512bh a,
                                                        __m512* lo, __m512* hi) {
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    const __m512i r0 = _mm512_loadu_si512(w0 + 32 * v);
    const __m512i r1 = paired ? _mm512_loadu_si512(w0 + ldw + 32 * v) : _mm512_setzero_si512();
    lo[v] = _mm512_dpbf16_ps(lo[v], a, (__m512bh)_mm512_unpacklo_epi16(r0, r1));
    hi[v] = _mm512_dpbf16_ps(hi[v], a, (__m512bh)_mm512_unpackhi_epi16(r0, r1));
  }
}

// y[0:32 NV] = x W[:, 0:32 NV] for one row x, as bf16 pairs, and bf16 weight rows taken two at a time (interleaved
// as above), each read once from memory, kPrefetchRows ahead (half the instructions of widening; the figures:
// docs/performance.md).
constexpr int64_t kPrefetchPairs = kPrefetchRows / 2;

template <int NV>
void one_row_times_columns_dp(const uint32_t* x, int64_t pairs, const uint16_t* Wp, int64_t ldw, int64_t K,
                              float* y) {
  __m512 lo[NV], hi[NV];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) lo[v] = hi[v] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* w0 = Wp + 2 * kp * ldw;
    const uint16_t* ahead = w0 + 2 * kPrefetchPairs * ldw;  // prefetches never fault, past the end included
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 32 * v), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + ldw + 32 * v), _MM_HINT_T0);
    }
    dp_pair_step<NV>(w0, ldw, 2 * kp + 1 < K, (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp])), lo, hi);
  }
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) store_in_order(lo[v], hi[v], y + 32 * v);
}

// Pairs of weight rows a chunk of one_row_long_run_dp takes before its next group of columns: 16 rows of a 1 KB
// weight row are 16 KB, still in L1 / L2 when the chunk's later groups read them.
constexpr int64_t kLongRunPairs = 8;

// One chunk of pairs of rows through G groups of 32 columns, their accumulators kept in `sums` (lo, then hi).
template <int G>
void long_run_chunk_dp(const uint32_t* x, int64_t kp0, int64_t kp1, const uint16_t* Wp, int64_t ldw, int64_t K,
                       float* sums) {
  __m512 lo[G], hi[G];
#pragma GCC unroll 8
  for (int v = 0; v < G; ++v) {
    lo[v] = _mm512_loadu_ps(sums + 32 * v);
    hi[v] = _mm512_loadu_ps(sums + 32 * v + 16);
  }
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    dp_pair_step<G>(Wp + 2 * kp * ldw, ldw, 2 * kp + 1 < K, (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp])),
                    lo, hi);
  }
#pragma GCC unroll 8
  for (int v = 0; v < G; ++v) {
    _mm512_storeu_ps(sums + 32 * v, lo[v]);
    _mm512_storeu_ps(sums + 32 * v + 16, hi[v]);
  }
}

// y[0:n] = x W[:, 0:n] for one row x, as bf16 pairs, and n (a multiple of 128) columns read as whole weight rows: a
// chunk of kLongRunPairs pairs of rows passes through every group of 256 (then 128) columns, the groups' accumulators
// kept in `sums` between chunks, so that the rows are read in order, each once and whole (one thread's stream, which
// the hardware prefetchers follow; groups of columns read one after another would read each row in parts, a pass
// apart). Each column sums its pairs in order, as one_row_times_columns_dp: the same values.
inline void one_row_long_run_dp(const uint32_t* x, int64_t pairs, const uint16_t* Wp, int64_t ldw, int64_t K,
                                int64_t n, float* y) {
  thread_local std::vector<float> sums;
  sums.assign(n, 0.0f);  // per group of 32 columns: its lo accumulator, then its hi one
  for (int64_t kp0 = 0; kp0 < pairs; kp0 += kLongRunPairs) {
    const int64_t kp1 = std::min(pairs, kp0 + kLongRunPairs);
    int64_t c = 0;
    for (; c + 256 <= n; c += 256) long_run_chunk_dp<8>(x, kp0, kp1, Wp + c, ldw, K, sums.data() + c);
    for (; c < n; c += 128) long_run_chunk_dp<4>(x, kp0, kp1, Wp + c, ldw, K, sums.data() + c);
  }
  for (int64_t c = 0; c < n; c += 32) {
    store_in_order(_mm512_loadu_ps(sums.data() + c), _mm512_loadu_ps(sums.data() + c + 16), y + c);
  }
}

// Rows first_row .. first_row + M of A through one block of 32 columns, 8 rows at a time (16 accumulators); the
// block packed first when more than one group of rows reads it.
inline void all_rows_times_32_columns_dp(const Bf16Pairs& A, int64_t first_row, int64_t M, const uint16_t* Wp,
                                         int64_t ldw, int64_t K, float* C, int64_t ldc) {
  const DirectPairs direct{Wp, ldw, K};
  if (M <= 8) return all_rows_times_32_columns_dp(A, first_row, M, direct, C, ldc);
  all_rows_times_32_columns_dp(A, first_row, M, PackedPairs{pack_pairs(direct, A.pairs)}, C, ldc);
}
#else
constexpr bool kHaveDpbf16 = false;

inline void all_rows_times_32_columns_dp(const Bf16Pairs&, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                                         float*, int64_t) {
  TORCH_CHECK(false, "vdpbf16ps is not available on this CPU");
}

inline void one_row_long_run_dp(const uint32_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "vdpbf16ps is not available on this CPU");
}
#endif

// ---- which path a bf16 product takes -------------------------------------------------------------------------------

// SGLANG_CPU_BF16_DOT as the ops take it: widen every bf16 weight; auto (below); or vdpbf16ps at every row count.
constexpr int64_t kBf16Widen = 0, kBf16Auto = 1, kBf16Dot = 2;

// How many times the float32 FMA's products per second this CPU's vdpbf16ps reaches (each instruction does twice
// the products): twelve independent chains of each instruction in registers, the two timed in turn, best of nine
// short runs each (~2 ms; in turn, so that a neighbour's burst slows both rather than one). A CPU that issues it as
// fast as an FMA reads ~2; the Intel Xeon (Emerald Rapids) this was measured on reads 0.5.
inline double measure_bf16_dot_speed() {
#if defined(__AVX512BF16__)
  constexpr int kChains = 12;
  constexpr int64_t kSteps = 20000;
  float sink = 0.0f;
  const auto dot_chains = [&] {
    __m512 acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_setzero_ps();
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    for (int64_t i = 0; i < kSteps; ++i) {
#pragma GCC unroll 12
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, a);
      asm volatile("" : "+v"(a));  // keeps the loop from being folded
    }
    for (int c = 0; c < kChains; ++c) sink += _mm512_reduce_add_ps(acc[c]);
  };
  const auto fma_chains = [&] {
    __m512 acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_setzero_ps();
    __m512 a = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < kSteps; ++i) {
#pragma GCC unroll 12
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, a);
      asm volatile("" : "+v"(a));
    }
    for (int c = 0; c < kChains; ++c) sink += _mm512_reduce_add_ps(acc[c]);
  };
  const auto seconds = [](auto& body) {
    const auto t0 = std::chrono::steady_clock::now();
    body();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  double dot = 1e30, fma = 1e30;
  for (int run = 0; run < 9; ++run) {
    dot = std::min(dot, seconds(dot_chains));
    fma = std::min(fma, seconds(fma_chains));
  }
  asm volatile("" : : "x"(sink));
  return 2.0 * fma / dot;
#else
  return 0.0;
#endif
}

inline double bf16_dot_speed() {
  static const double speed = measure_bf16_dot_speed();
  return speed;
}

// The speed (above) from which vdpbf16ps runs many rows: where it does more products per second than the FMA (and
// saves the widening's instructions too). CPUs read far from it: 0.5 on the Intel Xeon measured, 2 on AMD Zen 4,
// where a busy VM once read 1.33 (an earlier threshold of 1.5 then flipped the choice from one process to the next).
constexpr double kDotSpeedForManyRows = 1.0;

// Rows up to which auto widens bf16 weights on every CPU: such products are bound by reading the weight, and the
// widened products read it as whole rows in address order (one_row_add_long_run, rows_add_weight_rows), 1.2-1.5x
// the speed of vdpbf16ps's long runs from memory on AMD Zen 4 up to 1024 columns (docs/performance.md). A verify
// step's rows (up to this many) then compute what one row does.
constexpr int64_t kWidenedRows = 8;

// Whether a bf16 product of `rows` rows takes vdpbf16ps under `mode`. auto: above kWidenedRows rows, where the CPU's
// speed reaches kDotSpeedForManyRows (widening runs more rows at the FMA's rate; the figures: docs/performance.md).
// Batch invariant, auto takes it at every row count: a choice by the CPU's features alone, never by a timing, which
// could read differently in another process (a DP rank).
inline bool bf16_dot_for(int64_t mode, int64_t rows) {
  if (!kHaveDpbf16 || mode == kBf16Widen) return false;
  if (mode == kBf16Dot || batch_invariant()) return true;
  return rows > kWidenedRows && bf16_dot_speed() >= kDotSpeedForManyRows;
}

// C[:, n0:n1] = A W[:, n0:n1] for bf16 weights: blocks of 32 columns through vdpbf16ps from the rows' bf16 pairs
// (P, from first_row), the last (n1 - n0) % 32 columns widened from the float32 rows of A.
inline void rows_times_weight_columns_dp(const Bf16Pairs& P, int64_t first_row, const float* A, int64_t lda,
                                         int64_t M, const uint16_t* Wp, int64_t ldw, int64_t K, int64_t n0,
                                         int64_t n1, float* C, int64_t ldc) {
  int64_t n = n0;
  for (; n + 32 <= n1; n += 32) all_rows_times_32_columns_dp(P, first_row, M, Wp + n, ldw, K, C + n, ldc);
  rows_times_weight_columns<Bf16Weight>(A, lda, M, Wp, ldw, K, n, n1, C, ldc, WeightScales{});
}

// ---- the weight tensors' types ----------------------------------------------------------------------------------

// Calls fn(W{}) with the weight type of t: float32, bfloat16 or float8_e4m3fn.
template <class Fn>
void visit_weight_type(const at::Tensor& t, const char* name, Fn&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat: return fn(F32Weight{});
    case at::kBFloat16: return fn(Bf16Weight{});
    case at::kFloat8_e4m3fn: return fn(Fp8Weight{});
    default:
      TORCH_CHECK(false, name, " must be float32, bfloat16 or float8_e4m3fn, got ", t.scalar_type());
  }
}

template <class W>
const typename W::T* weight_data(const at::Tensor& t) {
  return static_cast<const typename W::T*>(t.data_ptr());
}

// The block scales of matrix `index` of a weight [..., N, K] in (bn, bk) blocks: scale [..., ceil(N / bn),
// ceil(K / bk)] float32 (index 0 of a 2-D one). Unscaled weight types take none.
template <class W>
WeightScales weight_scales(const c10::optional<at::Tensor>& scale, const at::Tensor& weight, at::IntArrayRef block,
                           int64_t index = 0) {
  if (!W::kScaled) {
    TORCH_CHECK(!scale.has_value(), "only FP8 weights take block scales, got a ", weight.scalar_type(), " weight");
    return WeightScales{};
  }
  TORCH_CHECK(scale.has_value() && block.size() == 2, "FP8 weights need their block scales and a block [bn, bk]");
  const int64_t bn = block[0], bk = block[1], N = weight.size(-2), K = weight.size(-1);
  TORCH_CHECK(bn > 0 && bn % 128 == 0 && bk > 0, "FP8 blocks must be [bn, bk] with bn a multiple of 128, got [", bn,
              ", ", bk, "]");
  const at::Tensor& s = *scale;
  TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.dim() == weight.dim() &&
                  s.size(-2) == (N + bn - 1) / bn && s.size(-1) == (K + bk - 1) / bk,
              "the block scales of a ", weight.sizes(), " weight in [", bn, ", ", bk,
              "] blocks must be float32 [..., ", (N + bn - 1) / bn, ", ", (K + bk - 1) / bk, "], got ",
              s.scalar_type(), " ", s.sizes());
  const float* data = s.data_ptr<float>() + (s.dim() == 3 ? index * s.stride(0) : 0);
  return WeightScales{data, s.stride(-2), s.stride(-1), bn, bk, Fp8Weight::kUnbias};
}

// ---- small matmuls of a weight in any layout (the experts' as loaded, attention's, [out, in] linear rows) -------

// Their register tiles: kMatmulRows rows of A at a time, kMatmulColumns columns of a [in, out] weight or kMatmulDepth
// lanes of four [out, in] weight rows, so that the accumulators (16 vec16 on AVX-512, 6 on AVX2 and NEON, 2 on
// SSE) fit with room for the weights.
inline constexpr int kMatmulRows = kVec16Registers >= 32 ? 4 : (kVec16Registers >= 8 ? 3 : 2);
inline constexpr int64_t kMatmulColumns = kVec16Registers >= 32 ? 64 : (kVec16Registers >= 8 ? 32 : 16);
inline constexpr int64_t kMatmulDepth = kVec16Registers >= 32 ? 16 : (kVec16Registers >= 8 ? 8 : 4);

// Columns n0 .. n0 + width of C = A W^T for TB rows, W^T's row k contiguous over n (width <= kMatmulColumns; FULL:
// exactly that, a constant trip count, so the block's accumulators stay in registers).
template <class W, int TB, bool FULL>
void contiguous_n_block(const float* A, int64_t lda, const typename W::T* Wp, int64_t wk, int64_t K, float* C,
                        int64_t ldc, int64_t width) {
  constexpr int64_t NB = kMatmulColumns;
  const int64_t cols = FULL ? NB : width;
  float acc[TB][NB];
  for (int t = 0; t < TB; ++t) {
    for (int64_t j = 0; j < cols; ++j) acc[t][j] = 0.0f;
  }
  for (int64_t k = 0; k < K; ++k) {
    const typename W::T* w = Wp + k * wk;
    for (int t = 0; t < TB; ++t) {
      const float a = A[t * lda + k];
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) acc[t][j] += a * W::at(w + j);
    }
  }
  for (int t = 0; t < TB; ++t) std::copy(acc[t], acc[t] + cols, C + t * ldc);
}

template <class W, int TB>
void matmul_rows_contiguous_n(const float* A, int64_t lda, const typename W::T* Wp, int64_t wk, int64_t N, int64_t K,
                              float* C, int64_t ldc) {  // wn == 1: row k of W^T is contiguous over n
  constexpr int64_t NB = kMatmulColumns;
  int64_t n0 = 0;
  for (; n0 + NB <= N; n0 += NB) contiguous_n_block<W, TB, true>(A, lda, Wp + n0, wk, K, C + n0, ldc, NB);
  if (n0 < N) contiguous_n_block<W, TB, false>(A, lda, Wp + n0, wk, K, C + n0, ldc, N - n0);
}

// kLanes widened values of an unscaled weight at p, contiguous.
template <class W>
inline vreg load_lanes(const typename W::T* p) {
  if constexpr (std::is_same_v<W, F32Weight>) {
    return load_reg(p);
  }
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<W, Bf16Weight>) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return (vreg)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<W, Bf16Weight>) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return (vreg)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
#endif
  float wide[kLanes];
  for (int i = 0; i < kLanes; ++i) wide[i] = W::at(p + i);
  return load_reg(wide);
}

// C[t, n] = sum_k A[t, k] W[n, k] for TB rows, row n of W contiguous over k: tiles of TB rows x 4 weight rows, each
// output's kMatmulDepth lanes of partial sums in registers (the TB rows' activations loaded once a k step for the 4
// weight rows, each weight row widened once for the TB rows), then added lane by lane and the last K % kMatmulDepth
// terms after them, in k order; the last N % 4 columns one at a time. Each output's sum is the same at any TB.
template <class W, int TB>
void matmul_rows_contiguous_k(const float* A, int64_t lda, const typename W::T* Wp, int64_t wn, int64_t N, int64_t K,
                              float* C, int64_t ldc) {  // wk == 1: row n of W is contiguous over k
  constexpr int RB = 4;
  constexpr int64_t KB = kMatmulDepth;
  constexpr int P = KB / kLanes;  // registers a row's lanes take (NEON: two)
  static_assert(KB % kLanes == 0, "the lanes of partial sums fill whole registers");
  const int64_t k_main = K - K % KB;
  int64_t n0 = 0;
  for (; n0 + RB <= N; n0 += RB) {
    vreg acc[TB][RB][P];
    for (int t = 0; t < TB; ++t) {
      for (int r = 0; r < RB; ++r) {
        for (int p = 0; p < P; ++p) acc[t][r][p] = vreg{};
      }
    }
    for (int64_t k0 = 0; k0 < k_main; k0 += KB) {
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) {
        vreg a[TB];
#pragma GCC unroll 8
        for (int t = 0; t < TB; ++t) a[t] = load_reg(A + t * lda + k0 + p * kLanes);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) {
          const vreg w = load_lanes<W>(Wp + (n0 + r) * wn + k0 + p * kLanes);
#pragma GCC unroll 8
          for (int t = 0; t < TB; ++t) acc[t][r][p] += a[t] * w;
        }
      }
    }
    for (int t = 0; t < TB; ++t) {
      for (int r = 0; r < RB; ++r) {
        float lanes[KB];
        std::memcpy(lanes, acc[t][r], sizeof(lanes));
        float total = 0.0f;
        for (int64_t j = 0; j < KB; ++j) total += lanes[j];
        for (int64_t k = k_main; k < K; ++k) total += A[t * lda + k] * W::at(Wp + (n0 + r) * wn + k);
        C[t * ldc + n0 + r] = total;
      }
    }
  }
  for (int t = 0; t < TB; ++t) {
    for (int64_t n = n0; n < N; ++n) {
      float acc = 0.0f;
      const typename W::T* w = Wp + n * wn;
      const float* a = A + t * lda;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += a[k] * W::at(w + k);
      C[t * ldc + n] = acc;
    }
  }
}

template <class W, int TB>
void matmul_block(const float* A, int64_t lda, const typename W::T* Wp, int64_t wn, int64_t wk, int64_t N, int64_t K,
                  float* C, int64_t ldc) {
  if (wn == 1) return matmul_rows_contiguous_n<W, TB>(A, lda, Wp, wk, N, K, C, ldc);
  for (int t = 0; t < TB; ++t) {
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += A[t * lda + k] * W::at(Wp + n * wn + k * wk);
      C[t * ldc + n] = acc;
    }
  }
}

// Rows of A a tile of matmul_rows_contiguous_k takes: its TB x 4 outputs' lanes, TB activation registers and a
// weight register fit the target's registers (AVX-512: 24 + 6 + 1 of 32). 128 rows through a bf16 [24000, 512] tied
// LM head, 2 threads: 86 -> 141 GFLOP/s natively, 58 -> 143 on AVX2, against the loop before (4 and 3 rows a tile,
// each activation loaded again for each weight row, bf16 widened one value at a time on AVX2); the same sums.
inline constexpr int kContiguousKRows = kVec16Registers >= 32 ? 6 : (kVec16Registers >= 8 ? 3 : 2);

template <class W>
void contiguous_k_rows(const float* A, int64_t lda, int64_t rows, const typename W::T* Wp, int64_t wn, int64_t N,
                       int64_t K, float* C, int64_t ldc) {
  constexpr int TB = kContiguousKRows;
  int64_t t = 0;
  for (; t + TB <= rows; t += TB) matmul_rows_contiguous_k<W, TB>(A + t * lda, lda, Wp, wn, N, K, C + t * ldc, ldc);
  const float* a = A + t * lda;
  float* c = C + t * ldc;
  switch (rows - t) {
    case 5: return matmul_rows_contiguous_k<W, (TB > 5 ? 5 : 1)>(a, lda, Wp, wn, N, K, c, ldc);
    case 4: return matmul_rows_contiguous_k<W, (TB > 4 ? 4 : 1)>(a, lda, Wp, wn, N, K, c, ldc);
    case 3: return matmul_rows_contiguous_k<W, (TB > 3 ? 3 : 1)>(a, lda, Wp, wn, N, K, c, ldc);
    case 2: return matmul_rows_contiguous_k<W, (TB > 2 ? 2 : 1)>(a, lda, Wp, wn, N, K, c, ldc);
    case 1: return matmul_rows_contiguous_k<W, 1>(a, lda, Wp, wn, N, K, c, ldc);
    default: return;
  }
}

// C[t, n] = sum_k A[t, k] W[n, k] for a few rows t, W an [N, K] view with strides (wn, wk) of unscaled weights. The
// two layouts the engine stores (kernels' [out, in] and weight_layout's [in, out] under the same shape) each get a
// register-blocked loop that vectorises along W's contiguous dimension; other strides take the plain loop.
template <class W = F32Weight>
void matmul_wt(const float* A, int64_t lda, int64_t rows, const typename W::T* Wp, int64_t wn, int64_t wk, int64_t N,
               int64_t K, float* C, int64_t ldc) {
  static_assert(!W::kScaled, "block-scaled weights take the [in, out] products");
  if (wk == 1 && wn != 1) return contiguous_k_rows<W>(A, lda, rows, Wp, wn, N, K, C, ldc);
  constexpr int TB = kMatmulRows;
  int64_t t = 0;
  for (; t + TB <= rows; t += TB) matmul_block<W, TB>(A + t * lda, lda, Wp, wn, wk, N, K, C + t * ldc, ldc);
  const float* a = A + t * lda;
  float* c = C + t * ldc;
  switch (rows - t) {
    case 3: return matmul_block<W, (TB > 3 ? 3 : 1)>(a, lda, Wp, wn, wk, N, K, c, ldc);
    case 2: return matmul_block<W, (TB > 2 ? 2 : 1)>(a, lda, Wp, wn, wk, N, K, c, ldc);
    case 1: return matmul_block<W, 1>(a, lda, Wp, wn, wk, N, K, c, ldc);
    default: return;
  }
}

}  // namespace sgl_cpu
