// Products of float32 rows with MXFP4 weights read in the checkpoint's layout (kernels/quant/mxfp4.py): a weight
// W [N, K] is `packed` uint8 [N, K / 2] (two e2m1 codes a byte, element 2j in the low nibble) and `scales` uint8
// [N, ceil(K / 32)] (e8m0, 2^(s - 127) for each 32 consecutive k of a row). The tensors that serve the reference and
// the GPU are read as they are, with no dequantized or repacked copy: each output is a dot product along a weight row
// ([out, in], the form llama.cpp's MXFP4 blocks take), a group of 32 weights being 16 bytes and one scale.
//
// A group widens in registers: the 16 e2m1 values times the group's scale make a 16-entry table (exact: a power of
// two times a value of two significant bits), and each nibble picks its entry (AVX-512: vpermps over 16 lanes; AVX2:
// vpshufb from the value's two high bytes, a table of each made once for every scale; elsewhere a scalar lookup). The
// low nibbles of a group's bytes are its even k, the high ones its odd k, so the rows are rearranged once per call
// to the order the registers come out in (k_at; AVX-512 [even k | odd k] per group): the weights then widen with no
// reordering shuffle. Every product accumulates in float32.
//
// Arithmetic, the same at every row count (batch invariant whether or not the switch is on): each output keeps one
// vector register of partial sums over the whole of K, adding the group's products by fused multiply-adds in group
// order, register by register, then sums that register's lanes in a fixed order. One row (a decode step) widens
// each weight in registers as it streams from memory; more rows widen a block of weight rows once (all of K, into
// L1 or L2) and run every row through it, each register tile's partial sums in registers over the whole of K.
//
// e8m0 to float shifts the byte into a float's exponent; s = 0 (2^-127, below float32's normal range) is given its
// exact value, the subnormal 2^-127, and s = 255 (the NaN code) reads as infinity, as the reference reads both.
#pragma once

#include <algorithm>
#include <array>
#include <utility>

#include "common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace sgl_cpu {
namespace mxfp4 {

constexpr int64_t kGroup = 32;       // weights per scale
constexpr int64_t kGroupBytes = 16;  // bytes of one group's codes
constexpr int kGroupRegs = static_cast<int>(kGroup / kLanes);  // vector registers of one widened group

// 2^(s - 127): the byte shifted into a float's exponent; s = 0 is the subnormal 2^-127 (the larger of the two bit
// patterns), s = 255 infinity.
inline float e8m0_to_float(uint8_t s) {
  const uint32_t bits = std::max<uint32_t>(static_cast<uint32_t>(s) << 23, 0x00400000u);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// A weight [N, K]: packed rows `row` bytes apart (contiguous within a row), scales [n * scale_row + g * scale_col].
struct Matrix {
  const uint8_t* packed;
  int64_t row;
  const uint8_t* scales;
  int64_t scale_row, scale_col;
  int64_t K;
  int64_t groups() const { return (K + kGroup - 1) / kGroup; }
  int64_t padded() const { return groups() * kGroup; }
  uint8_t scale(int64_t n, int64_t g) const { return scales[n * scale_row + g * scale_col]; }  // e8m0
  // The 16 bytes of group g of row n, or, for a last group cut short, a copy zero-padded in `tail`.
  const uint8_t* group(int64_t n, int64_t g, uint8_t* tail) const {
    const uint8_t* p = packed + n * row + g * kGroupBytes;
    const int64_t bytes = std::min<int64_t>(kGroupBytes, K / 2 - g * kGroupBytes);
    if (bytes == kGroupBytes) return p;
    std::memset(tail, 0, kGroupBytes);
    std::memcpy(tail, p, bytes);
    return tail;
  }
};

// ---- one group widened: the scaled table and the lookup, per ISA ----------------------------------------------------

inline constexpr float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

#if defined(__AVX512F__)
struct Table {
  __m512 values;  // the 16 codes' values times the scale
};

inline Table scaled_table(float scale) {
  return Table{_mm512_mul_ps(_mm512_loadu_ps(kValues), _mm512_set1_ps(scale))};
}

// w[0]: the low nibbles (even k), w[1]: the high ones (odd k); vpermps reads the low 4 bits of each index.
inline void widen(const uint8_t* p, const Table& t, vreg* w) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w[0] = (vreg)_mm512_permutexvar_ps(bytes, t.values);
  w[1] = (vreg)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), t.values);
}

inline vreg fma(vreg a, vreg b, vreg c) { return (vreg)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }

// The sum of v's lanes, pairs added in a fixed order: lane i + lane i + 8, then i + i + 4, i + i + 2, 0 + 1.
inline float lane_sum(vreg v) {
  const __m512 x = (__m512)v;
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd((__m512d)x, 1)));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}

// lane_sum of a, b, c and d into out[0:4], the same pairs added four registers at a time.
inline void lane_sums4(vreg a, vreg b, vreg c, vreg d, float* out) {
  const auto halves = [](__m512 x, __m512 y) {  // [x's i + i + 8 | y's]
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  const __m512 ab = halves((__m512)a, (__m512)b), cd = halves((__m512)c, (__m512)d);
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));  // i + i + 4, a register a lane
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512 sums = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t);
  _mm_storeu_ps(out, _mm512_castps512_ps128(sums));
}
#elif defined(__AVX2__) && defined(__FMA__)
// A group's scaled values are exact and have at most two significant bits, so each is a float whose low 16 bits are
// zero: its two high bytes, picked by the code with vpshufb from a 16-byte table each, make it. The tables of all 256
// scales are made once (8 KB): a group's table is where its scale byte points.
struct Table {
  const uint8_t* bytes;  // [16 third bytes | 16 high bytes] of the 16 codes' values times the scale
};

inline std::array<uint8_t, 256 * 32> make_scale_tables() {
  std::array<uint8_t, 256 * 32> t{};
  for (int s = 0; s < 256; ++s) {
    for (int c = 0; c < 16; ++c) {
      const float value = kValues[c] * e8m0_to_float(static_cast<uint8_t>(s));
      uint32_t bits;
      std::memcpy(&bits, &value, sizeof(bits));
      t[s * 32 + c] = static_cast<uint8_t>(bits >> 16);
      t[s * 32 + 16 + c] = static_cast<uint8_t>(bits >> 24);
    }
  }
  return t;
}

alignas(64) inline const std::array<uint8_t, 256 * 32> kScaleTables = make_scale_tables();

using ScaleEntry = const uint8_t*;  // the scale's tables

inline ScaleEntry scale_entry(uint8_t s) { return kScaleTables.data() + 32 * static_cast<int64_t>(s); }

inline Table table_of(ScaleEntry e) { return Table{e}; }

// A group's registers: its 16 bytes in both halves of a register, the low nibbles (even k) in the first half and the
// high ones (odd k) in the second (each byte's high nibble brought down by a shift of the second half's dwords), each
// code's two value bytes looked up and interleaved into 16-bit words, and each word put in the high half of a dword:
// the even words shifted up, the odd ones masked: 10 vector operations and three loads a group, where the 8-entry
// vpermps table with the signs xor-ed in took 18 (one row through a 2048 x 1024 weight on one Zen 3 thread: 16 -> 25
// GFLOP/s, the same from L2 as from memory).
// Register r holds k_at(8r) ... k_at(8r + 7).
inline void widen(const uint8_t* p, const Table& t, vreg* w) {
  const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(bytes, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                         _mm256_set1_epi8(0x0f));
  const __m256i third = _mm256_shuffle_epi8(
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.bytes))), codes);
  const __m256i high = _mm256_shuffle_epi8(
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.bytes + 16))), codes);
  const __m256i first = _mm256_unpacklo_epi8(third, high), second = _mm256_unpackhi_epi8(third, high);
  const __m256i odd_words = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  w[0] = (vreg)_mm256_castsi256_ps(_mm256_slli_epi32(first, 16));
  w[1] = (vreg)_mm256_castsi256_ps(_mm256_and_si256(first, odd_words));
  w[2] = (vreg)_mm256_castsi256_ps(_mm256_slli_epi32(second, 16));
  w[3] = (vreg)_mm256_castsi256_ps(_mm256_and_si256(second, odd_words));
}

// The k (of a group's 32) at position p of its widened registers: position p is dword p % 4 of half p / 4 % 2 of
// register p / 8, and holds byte 8 (p / 16) + 2 (p % 4) + p / 8 % 2's low nibble in the first half, its high one in
// the second (k = twice the byte, plus the half).
constexpr int64_t k_at(int64_t p) { return 16 * (p / 16) + 2 * (p / 8 % 2) + 4 * (p % 4) + p / 4 % 2; }

inline vreg fma(vreg a, vreg b, vreg c) { return (vreg)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }

// The sum of v's lanes, pairs added in a fixed order: lane i + lane i + 4, then i + i + 2, 0 + 1.
inline float lane_sum(vreg v) {
  const __m256 x = (__m256)v;
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// lane_sum of a, b, c and d into out[0:4], the same pairs added two registers at a time.
inline void lane_sums4(vreg a, vreg b, vreg c, vreg d, float* out) {
  const auto halves = [](__m256 x, __m256 y) {  // [x's i + i + 4 | y's], then i + i + 2 and 0 + 1 in lane 0 of each
    __m256 t = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    t = _mm256_add_ps(t, _mm256_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_add_ps(t, _mm256_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  };
  const __m256 mixed = _mm256_unpacklo_ps(halves((__m256)a, (__m256)b), halves((__m256)c, (__m256)d));
  const __m256 sums = _mm256_permutevar8x32_ps(mixed, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
  _mm_storeu_ps(out, _mm256_castps256_ps128(sums));
}
#else
struct Table {
  float values[16];
};

inline Table scaled_table(float scale) {
  Table t;
  for (int i = 0; i < 16; ++i) t.values[i] = kValues[i] * scale;
  return t;
}

inline void widen(const uint8_t* p, const Table& t, vreg* w) {
  float wide[kGroup];
  for (int j = 0; j < kGroupBytes; ++j) {
    wide[j] = t.values[p[j] & 15];
    wide[kGroupBytes + j] = t.values[p[j] >> 4];
  }
  for (int r = 0; r < kGroupRegs; ++r) w[r] = load_reg(wide + kLanes * r);
}

inline vreg fma(vreg a, vreg b, vreg c) { return a * b + c; }

inline float lane_sum(vreg v) {
  float s = v[0];
  for (int i = 1; i < kLanes; ++i) s += v[i];
  return s;
}

inline void lane_sums4(vreg a, vreg b, vreg c, vreg d, float* out) {
  out[0] = lane_sum(a);
  out[1] = lane_sum(b);
  out[2] = lane_sum(c);
  out[3] = lane_sum(d);
}
#endif

#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
// The float tables (AVX-512, scalar): a group's entry is its scale, and the registers hold [even k | odd k].
using ScaleEntry = float;

inline ScaleEntry scale_entry(uint8_t s) { return e8m0_to_float(s); }

inline Table table_of(ScaleEntry scale) { return scaled_table(scale); }

// The k (of a group's 32) at position p of its widened registers: the even k, then the odd.
constexpr int64_t k_at(int64_t p) { return p < kGroupBytes ? 2 * p : 2 * (p - kGroupBytes) + 1; }
#endif

// out[c] = lane_sum(v[c]) for N registers, four at a time.
template <int N>
inline void lane_sums(const vreg* v, float* out) {
  int c = 0;
  for (; c + 4 <= N; c += 4) lane_sums4(v[c], v[c + 1], v[c + 2], v[c + 3], out + c);
  if constexpr (N % 4 == 3) {  // as four, the last twice
    float four[4];
    lane_sums4(v[c], v[c + 1], v[c + 2], v[c + 2], four);
    std::copy_n(four, 3, out + c);
    return;
  }
  for (; c < N; ++c) out[c] = lane_sum(v[c]);
}

inline void store_reg(float* p, vreg v) { std::memcpy(p, &v, sizeof(v)); }

// `floats` floats of `buffer`, from a 64-byte boundary: a row of whole groups then starts each vector on a cache
// line of its own (a load across two lines costs two).
inline float* aligned(std::vector<float>& buffer, int64_t floats) {
  constexpr int64_t kLine = 64 / sizeof(float);
  if (static_cast<int64_t>(buffer.size()) < floats + kLine) buffer.resize(floats + kLine);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + (kLine - static_cast<int64_t>(address % 64) / 4) % kLine;
}

// The scale entries (what table_of takes) of row n, into out [groups] (16 at a time on AVX-512 where they are
// contiguous).
inline void scale_entries(const Matrix& w, int64_t n, ScaleEntry* out) {
  const uint8_t* s = w.scales + n * w.scale_row;
  const int64_t groups = w.groups();
  int64_t g = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  for (; w.scale_col == 1 && g < groups; g += 16) {  // the last 16 or fewer masked
    const __mmask16 mask = groups - g >= 16 ? __mmask16(0xffff) : __mmask16((1u << (groups - g)) - 1);
    const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, s + g)), 23);
    _mm512_mask_storeu_epi32(out + g, mask, _mm512_max_epu32(bits, _mm512_set1_epi32(0x00400000)));
  }
#endif
  for (; g < groups; ++g) out[g] = scale_entry(s[g * w.scale_col]);
}

// ---- rows rearranged to the weights' order --------------------------------------------------------------------------

// Register R of a whole group's rearranged values (positions kLanes R on, k_at), from the two registers of x it
// draws on, by one constant shuffle (the scalar loop took ~1 us a 1024-wide row: ~8 us of a big-shape MoE layer's
// eight).
template <int R, size_t... J>
inline vreg rearranged_register(const float* x, std::index_sequence<J...>) {
  constexpr int64_t ks[] = {k_at(kLanes * R + static_cast<int64_t>(J))...};  // the register's positions' k
  constexpr int64_t first = *std::min_element(ks, ks + kLanes) / kLanes;
  static_assert(*std::max_element(ks, ks + kLanes) < (first + 2) * kLanes,
                "a register's positions span at most two registers of x");
  const vreg a = load_reg(x + first * kLanes), b = load_reg(x + (first + 1) * kLanes);
  return __builtin_shufflevector(a, b, static_cast<int>(ks[J] - first * kLanes)...);
}

template <size_t... R>
inline void rearrange_group(const float* x, float* out, std::index_sequence<R...>) {
  (store_reg(out + kLanes * R, rearranged_register<R>(x, std::make_index_sequence<kLanes>())), ...);
}

// A row x [K] into out [padded K]: each group of 32 in its widened registers' order (k_at), zeros past K.
inline void rearrange_row(const float* x, int64_t K, float* out) {
  const int64_t groups = (K + kGroup - 1) / kGroup, whole = K / kGroup;
  for (int64_t g = 0; g < whole; ++g) {
    rearrange_group(x + g * kGroup, out + g * kGroup, std::make_index_sequence<kGroup / kLanes>());
  }
  for (int64_t g = whole; g < groups; ++g) {  // the last group, cut short
    for (int64_t p = 0; p < kGroup; ++p) {
      const int64_t k = g * kGroup + k_at(p);
      out[g * kGroup + p] = k < K ? x[k] : 0.0f;
    }
  }
}

// ---- one row: widened in registers as the weights stream in ------------------------------------------------------

// Outputs computed together by one row: their partial sums and the group's widened weights fit the registers.
inline constexpr int kOneRowColumns = kVec16Registers >= 32 ? 8 : 4;

// y[c] = x . W[n0 + c] for NB rows of W from one rearranged row xr.
template <int NB>
void one_row_columns(const float* xr, const Matrix& w, int64_t n0, float* y) {
  const int64_t groups = w.groups(), full = w.K / kGroup;
  thread_local std::vector<ScaleEntry> scales;
  scales.resize(NB * groups);
  ScaleEntry* entries = scales.data();
  for (int c = 0; c < NB; ++c) scale_entries(w, n0 + c, entries + c * groups);
  vreg acc[NB];
  for (int c = 0; c < NB; ++c) acc[c] = vreg{};
  const auto step = [&](int64_t g, const uint8_t* const* bytes) {
    vreg xv[kGroupRegs];
    for (int r = 0; r < kGroupRegs; ++r) xv[r] = load_reg(xr + g * kGroup + kLanes * r);
#pragma GCC unroll 8
    for (int c = 0; c < NB; ++c) {
      vreg wv[kGroupRegs];
      widen(bytes[c], table_of(entries[c * groups + g]), wv);
      for (int r = 0; r < kGroupRegs; ++r) acc[c] = fma(xv[r], wv[r], acc[c]);
    }
  };
  const uint8_t* bytes[NB];
  // The weight rows two tiles on asked for while these run, as many cache lines a step as a step reads: a tile's
  // rows are too short for the hardware prefetchers to follow (the figures: docs/performance.md).
  const int64_t row_lines = (w.K / 2 + 63) / 64;
  int64_t next_row = 0, next_line = 0;
  for (int64_t g = 0; g < full; ++g) {
    for (int c = 0; c < NB; ++c) bytes[c] = w.packed + (n0 + c) * w.row + g * kGroupBytes;
    for (int64_t b = 0; b < NB * kGroupBytes && next_row < NB; b += 64) {
      __builtin_prefetch(w.packed + (n0 + 2 * NB + next_row) * w.row + 64 * next_line, 0, 3);
      if (++next_line == row_lines) {
        next_line = 0;
        ++next_row;
      }
    }
    step(g, bytes);
  }
  if (full < groups) {  // the last group, cut short
    uint8_t tails[NB][kGroupBytes];
    for (int c = 0; c < NB; ++c) bytes[c] = w.group(n0 + c, full, tails[c]);
    step(full, bytes);
  }
  lane_sums<NB>(acc, y);
}

// y[n0:n1] for one rearranged row.
inline void one_row(const float* xr, const Matrix& w, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + kOneRowColumns <= n1; n += kOneRowColumns) one_row_columns<kOneRowColumns>(xr, w, n, y + n);
  for (; n < n1; ++n) one_row_columns<1>(xr, w, n, y + n);
}

// ---- many rows: a block of weights widened once, every row run through it ---------------------------------------

// The register tile of the float32 products over a widened block: kDotRows rows x kDotColumns outputs of partial
// sums, the columns' weights and the rows' activations, each loaded once a step (AVX-512: 20 + 4 + 5 of 32
// registers; AVX2: 9 + 3 + 3 of 16).
inline constexpr int kDotRows = kVec16Registers >= 32 ? 5 : (kVec16Registers >= 8 ? 3 : 2);
inline constexpr int kDotColumns = kVec16Registers >= 32 ? 4 : (kVec16Registers >= 8 ? 3 : 2);
// Outputs widened together: every row passes over their widened rows (16 x K floats on AVX-512, in L2 up to K of
// 8192), kDotColumns of them at a time, each tile's partial sums in registers over the whole of K.
inline constexpr int64_t kBlockColumns = 4 * kDotColumns;

// C[r, c] (ldc apart) = the products of RB rearranged rows (ldx apart) and NB widened weight rows (ldw apart), over
// `len` k.
template <int RB, int NB>
void dot_tile(const float* xr, int64_t ldx, const float* wb, int64_t ldw, int64_t len, float* C, int64_t ldc) {
  vreg sums[RB][NB];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NB; ++c) sums[r][c] = vreg{};
  }
  for (int64_t k = 0; k < len; k += kLanes) {
    vreg wv[NB], xv[RB];
#pragma GCC unroll 8
    for (int c = 0; c < NB; ++c) wv[c] = load_reg(wb + c * ldw + k);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      xv[r] = load_reg(xr + r * ldx + k);
      in_register(xv[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NB; ++c) sums[r][c] = fma(xv[r], wv[c], sums[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) lane_sums<NB>(sums[r], C + r * ldc);
}

// dot_tile for `cols` <= NB columns.
template <int RB, int NB = kDotColumns>
void dot_tile_columns(int64_t cols, const float* xr, int64_t ldx, const float* wb, int64_t ldw, int64_t len, float* C,
                      int64_t ldc) {
  if constexpr (NB > 1) {
    if (cols < NB) return dot_tile_columns<RB, NB - 1>(cols, xr, ldx, wb, ldw, len, C, ldc);
  }
  dot_tile<RB, NB>(xr, ldx, wb, ldw, len, C, ldc);
}

// dot_tile for `rows` <= RB rows and `cols` <= kDotColumns columns.
template <int RB = kDotRows>
void dot_tile_any(int64_t rows, int64_t cols, const float* xr, int64_t ldx, const float* wb, int64_t ldw, int64_t len,
                  float* C, int64_t ldc) {
  if constexpr (RB > 1) {
    if (rows < RB) return dot_tile_any<RB - 1>(rows, cols, xr, ldx, wb, ldw, len, C, ldc);
  }
  dot_tile_columns<RB>(cols, xr, ldx, wb, ldw, len, C, ldc);
}

// `cols` weight rows from n0, widened into out (row c at c * padded K).
inline void widen_rows(const Matrix& w, int64_t n0, int64_t cols, float* out) {
  const int64_t groups = w.groups(), padded = w.padded();
  uint8_t tail[kGroupBytes];
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t g = 0; g < groups; ++g) {
      vreg wv[kGroupRegs];
      widen(w.group(n0 + c, g, tail), table_of(scale_entry(w.scale(n0 + c, g))), wv);
      float* dst = out + c * padded + g * kGroup;
      for (int r = 0; r < kGroupRegs; ++r) store_reg(dst + kLanes * r, wv[r]);
    }
  }
}

// C[m, n0:n0 + cols] for M rearranged rows (ldx apart) and at most kBlockColumns weight rows, widened once.
inline void many_rows_block(const float* xr, int64_t ldx, int64_t M, const Matrix& w, int64_t n0, int64_t cols,
                            float* C, int64_t ldc) {
  thread_local std::vector<float> buffer;
  const int64_t padded = w.padded();
  float* block = aligned(buffer, kBlockColumns * padded);
  widen_rows(w, n0, cols, block);
  for (int64_t r = 0; r < M; r += kDotRows) {
    for (int64_t c = 0; c < cols; c += kDotColumns) {
      dot_tile_any(std::min<int64_t>(kDotRows, M - r), std::min<int64_t>(kDotColumns, cols - c), xr + r * ldx, ldx,
                   block + c * padded, padded, padded, C + r * ldc + n0 + c, ldc);
    }
  }
}

// ---- the products ----------------------------------------------------------------------------------------------------

// Checks an MXFP4 pair: `packed` [..., N, K / 2] and `scales` [..., N, ceil(K / 32)], uint8 CPU tensors, the packed
// rows contiguous (the scales any strides).
inline void check_pair(const at::Tensor& packed, const c10::optional<at::Tensor>& scales, const char* name) {
  TORCH_CHECK(scales.has_value(), "the MXFP4 ", name, " needs its e8m0 scales");
  const at::Tensor& s = *scales;
  TORCH_CHECK(packed.device().is_cpu() && s.device().is_cpu() && packed.scalar_type() == at::kByte &&
                  s.scalar_type() == at::kByte,
              "the MXFP4 ", name, " and its scales must be uint8 CPU tensors, got ", packed.scalar_type(), " and ",
              s.scalar_type());
  TORCH_CHECK(packed.size(-1) <= 1 || packed.stride(-1) == 1, "the MXFP4 ", name, "'s rows must be contiguous");
  std::vector<int64_t> expected(packed.sizes().begin(), packed.sizes().end());
  expected.back() = (2 * packed.size(-1) + kGroup - 1) / kGroup;
  TORCH_CHECK(s.sizes() == at::IntArrayRef(expected), "the MXFP4 ", name, " ", packed.sizes(), " needs scales ",
              at::IntArrayRef(expected), ", got ", s.sizes());
}

// Matrix `index` (of a stack [E, N, K / 2], else the matrix itself) of a checked pair.
inline Matrix matrix_of(const at::Tensor& packed, const at::Tensor& scales, int64_t index = 0) {
  const bool stacked = packed.dim() == 3;
  return Matrix{packed.data_ptr<uint8_t>() + (stacked ? index * packed.stride(0) : 0),
                packed.stride(-2),
                scales.data_ptr<uint8_t>() + (stacked ? index * scales.stride(0) : 0),
                scales.stride(-2),
                scales.stride(-1),
                2 * packed.size(-1)};
}

// C[:, n0:n1] = x W[n0:n1]^T for M rearranged rows xr (ldx apart), on the calling thread.
inline void rows_times_columns(const float* xr, int64_t ldx, int64_t M, const Matrix& w, int64_t n0, int64_t n1,
                               float* C, int64_t ldc) {
  if (M == 1) return one_row(xr, w, n0, n1, C);
  for (int64_t n = n0; n < n1; n += kBlockColumns) {
    many_rows_block(xr, ldx, M, w, n, std::min(kBlockColumns, n1 - n), C, ldc);
  }
}

// The rows rearranged (a thread's buffer: M * padded K floats).
inline const float* rearranged(const float* x, int64_t lda, int64_t M, int64_t K) {
  thread_local std::vector<float> buffer;
  const int64_t padded = (K + kGroup - 1) / kGroup * kGroup;
  float* out = aligned(buffer, M * padded);
  at::parallel_for(0, M, grain(padded), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) rearrange_row(x + m * lda, K, out + m * padded);
  });
  return out;
}

// Rows of a prefill run in panels of this many, so that a panel of rearranged rows (128 x K floats) stays in L2
// while every block of the weight passes over it (each block widened once a panel).
inline constexpr int64_t kPanelRows = 128;

// C [M, N] (contiguous) = x W^T for x's M rows (lda apart), the threads taking blocks of outputs (more than one
// row: as they free up, common.h's parallel_items).
inline void linear(const float* x, int64_t lda, int64_t M, const Matrix& w, int64_t N, float* C) {
  const float* xr = rearranged(x, lda, M, w.K);
  const int64_t padded = w.padded();
  if (M == 1) {
    const int64_t tiles = (N + kOneRowColumns - 1) / kOneRowColumns;
    // a tile's weights are its work: a 256 x 256 weight (a mid shape's shared expert) splits over the threads, 12.0 ->
    // 10.6 us a call on 2 Zen 3 threads (at an eighth of them it ran on the calling thread, the others idle)
    at::parallel_for(0, tiles, grain(kOneRowColumns * padded), [&](int64_t begin, int64_t end) {
      one_row(xr, w, begin * kOneRowColumns, std::min(N, end * kOneRowColumns), C);
    });
    return;
  }
  const int64_t blocks = (N + kBlockColumns - 1) / kBlockColumns;
  for (int64_t m0 = 0; m0 < M; m0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, M - m0);
    parallel_items(blocks, 1, [&](int64_t b, int64_t) {
      const int64_t n0 = b * kBlockColumns;
      rows_times_columns(xr + m0 * padded, padded, rows, w, n0, std::min(N, n0 + kBlockColumns), C + m0 * N, N);
    });
  }
}

}  // namespace mxfp4
}  // namespace sgl_cpu
