// A bf16 weight stored [in, out], kept a second time in 12 bits a weight without losing a bit, for the products of
// one row: a decode step at batch 1 reads each weight once from memory, and there the bytes are the time.
//
// A bf16 value is a low byte (the exponent's last bit and the 7 mantissa bits: near uniform, kept whole) and a high
// byte (the sign and the exponent's first 7 bits). Within one weight row (row k of W^T, the columns an input feeds)
// the high bytes take few values: trained or random weights of one matrix span a few binades, two of them a high
// byte. Each row keeps a table of its 16 most frequent high bytes and each weight a 4-bit index into it; the few
// weights whose high byte is not in the table (values far below the row's others) are kept apart, as exceptions,
// and put back in place after their chunk is decoded. A weight is then 12 bits (plus 16 bytes a row of tables):
// the Gated DeltaNet projections of a Quark MXFP4 export, which it keeps in bf16 (the big bench shape's ~151 MB a
// step), read three quarters of the bytes.
//
// The values are the weights' own: a chunk decodes to the float32 values Bf16Weight::load widens the bf16 ones to,
// and add_rows sums them as one_row_add_long_run does (each column its products in k order, the same expression), so
// a product through the planes is bitwise the product through the bf16 weight.
//
// Layout: columns in chunks of 64 (the last N % 64 columns are left to the bf16 weight). Within a chunk, the byte at
// position p holds column column_at(p): the order in which the x86 decode below (byte unpacks, then a shift for the
// even words and a mask for the odd ones) puts 16 columns into each of 4 vectors (AVX-512: one register each; AVX2:
// two halves of 8) in natural order. A chunk's 64 indices take 32 bytes (position p's in byte p / 2, the low nibble
// for even p), its low bytes 64.
// Rows go in groups of kGroupRows (the rows a pass adds to the sums together), and a group's bytes chunk by chunk:
// chunk c of every row of the group (all indices, then all low bytes), then chunk c + 1, so that a pass reads one
// stream in address order. Each row's table [16] apart.
#pragma once

#include "common.h"
#include "gemm.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The decode's instruction set: AVX-512 BW (vec16 one register), AVX2 (vec16 two halves), else one value at a time.
#if defined(__AVX512BW__)
#define SGL_PLANES_AVX512 1
#define SGL_PLANES_AVX2 0
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define SGL_PLANES_AVX512 0
#define SGL_PLANES_AVX2 1
#else
#define SGL_PLANES_AVX512 0
#define SGL_PLANES_AVX2 0
#endif

namespace sgl_cpu {

class Bf16Planes {
 public:
  static constexpr int64_t kChunk = 64;
  // More weights outside the tables than this share and the planes are not kept (the weight is read as bf16).
  static constexpr double kMostExceptions = 1.0 / 256;
  // Whether this build's decode beats reading the bf16 weight (the decode blocks keep planes by default only then). A
  // one-row product through 1024 x 6144 from memory on 2 Zen 4 threads: AVX-512 1.20-1.30x the bf16 weight's speed,
  // 256 x 1024 in cache 1.3x; the AVX2 build (two rows a group, twice the instructions a chunk) 1.02-1.06x from
  // memory and 0.82-0.88x in cache.
  static constexpr bool kPays = SGL_PLANES_AVX512;
  // How many chunks ahead of the one it decodes a group's bytes are asked for, into L2 (locality 2). The
  // non-temporal hint (locality 0) this took before cost an Intel Xeon (AVX-512, AMX; 2 threads) a quarter of its
  // big-shape MXFP4 decode: 19.3 against 14.7 ms a token by medians, 8 alternating rounds in one process (the planes
  // were then slower than the bf16 weights: 18.5 against 15-16 ms); 16 chunks ahead read 15.0 ms, 4 15.5, locality
  // 3 15.9. Zen 4, where the hint was chosen, not measured again.
  static constexpr int64_t kAheadChunks = 8;

  // The planes of W's first N / 64 * 64 columns, W's rows (row k of W^T: N bf16 values) ldw apart; null where the
  // weight is narrower than a chunk or its high bytes do not fit the tables.
  static std::unique_ptr<Bf16Planes> build(const uint16_t* w, int64_t ldw, int64_t K, int64_t N) {
    const int64_t n = N / kChunk * kChunk;
    if (n == 0 || K == 0) return nullptr;
    std::unique_ptr<Bf16Planes> planes(new Bf16Planes(K, n));
    if (!planes->fill(w, ldw)) return nullptr;
    return planes;
  }

  // The planes of a weight as linear_core takes it, where it is a bf16 [N, K] matrix stored [in, out]; else null.
  static std::shared_ptr<const Bf16Planes> of_weight(const at::Tensor& weight) {
    if (weight.scalar_type() != at::kBFloat16 || weight.dim() != 2 || weight.stride(0) != 1 || weight.size(0) < 2) {
      return nullptr;
    }
    return build(static_cast<const uint16_t*>(weight.data_ptr()), weight.stride(1), weight.size(1), weight.size(0));
  }

  int64_t rows() const { return K_; }
  int64_t columns() const { return n_; }
  // Bytes kept (the planes, the tables and the exceptions).
  int64_t bytes() const {
    return static_cast<int64_t>(buffer_.size() + table_.size() + row_start_.size() * sizeof(int64_t) +
                                exception_column_.size() * (sizeof(int32_t) + sizeof(float)));
  }

  // y[0:n] += sum over k in [k0, k1) of x[k - k0] W[k, 0:n], each column's products added in k order: a group's
  // rows decoded a chunk at a time, then added to y in order (y read and written once a group, not once a row).
  void add_rows(const float* x, int64_t k0, int64_t k1, float* y) const {
    for (int64_t k = k0; k < k1;) {
      const int64_t g = k / kGroupRows, first = g * kGroupRows, rows = group_rows(g);
      const int64_t end = std::min(k1, first + rows);
      if (k == first && end - k == kGroupRows) {
        add_group<kGroupRows>(g, 0, x + (k - k0), y);
      } else {
        for (int64_t r = k - first; r < end - first; ++r) add_group<1>(g, r, x + (first + r - k0), y);
      }
      k = end;
    }
  }

  // The column a chunk's byte position p holds, and back.
  static constexpr int64_t column_at(int64_t p) {
    return 16 * (2 * (p % 16 / 8) + p % 2) + 4 * (p / 16) + p % 8 / 2;
  }
  static constexpr int64_t position_of(int64_t col) {
    return 16 * (col % 16 / 4) + 8 * (col / 32) + 2 * (col % 4) + col / 16 % 2;
  }

 private:
  // Rows added to the sums together (their chunks' values stay in registers: AVX-512's 32 hold four rows', AVX2's 16
  // two rows' halves and the sums).
  static constexpr int64_t kGroupRows = SGL_PLANES_AVX512 ? 4 : 2;
  static constexpr int64_t kChunkBytes = kChunk / 2 + kChunk;  // indices and low bytes

  int64_t group_rows(int64_t g) const { return std::min(kGroupRows, K_ - g * kGroupRows); }
  // Row r of group g: where its chunk c's indices and low bytes lie.
  const uint8_t* chunk_index(int64_t g, int64_t r, int64_t c) const {
    return data_ + g * kGroupRows * (n_ / kChunk) * kChunkBytes + (c / kChunk) * group_rows(g) * kChunkBytes +
           r * (kChunk / 2);
  }
  const uint8_t* chunk_low(int64_t g, int64_t r, int64_t c) const {
    return chunk_index(g, 0, c) + group_rows(g) * (kChunk / 2) + r * kChunk;
  }
  uint8_t* chunk_index(int64_t g, int64_t r, int64_t c) {
    return const_cast<uint8_t*>(static_cast<const Bf16Planes*>(this)->chunk_index(g, r, c));
  }
  uint8_t* chunk_low(int64_t g, int64_t r, int64_t c) {
    return const_cast<uint8_t*>(static_cast<const Bf16Planes*>(this)->chunk_low(g, r, c));
  }

  // y += a[0] W[k] + ... + a[R - 1] W[k + R - 1] for rows k = g * kGroupRows + r0 on, added in that order, a chunk of
  // 64 columns at a time.
  template <int R>
  void add_group(int64_t g, int64_t r0, const float* a, float* y) const {
    int64_t e[R], e_end[R];
#if SGL_PLANES_AVX512
    __m512i tables[R];
#elif SGL_PLANES_AVX2
    __m256i tables[R];
#else
    const uint8_t* tables[R];
#endif
    for (int r = 0; r < R; ++r) {
      const int64_t k = g * kGroupRows + r0 + r;
      e[r] = row_start_[k];
      e_end[r] = row_start_[k + 1];
      const uint8_t* table = table_.data() + k * 16;
#if SGL_PLANES_AVX512
      tables[r] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
#elif SGL_PLANES_AVX2
      tables[r] = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
#else
      tables[r] = table;
#endif
    }
    const int64_t stride = group_rows(g) * kChunkBytes;  // from one chunk of the group to the next
    const uint8_t* index = chunk_index(g, r0, 0);
    const uint8_t* low = chunk_low(g, r0, 0);
    for (int64_t c = 0; c < n_; c += kChunk, index += stride, low += stride) {
      for (int64_t b = 0; b < stride; b += 64) __builtin_prefetch(index + kAheadChunks * stride + b, 0, 2);
      vec16 v[R][4];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        decode(low + r * kChunk, index + r * (kChunk / 2), tables[r], v[r]);
        if (__builtin_expect(e[r] < e_end[r] && exception_column_[e[r]] < c + kChunk, 0)) {
          alignas(64) float values[kChunk];  // (the rare path: the values through memory, not the common one's)
#pragma GCC unroll 4
          for (int t = 0; t < 4; ++t) store16(values + 16 * t, v[r][t]);
          e[r] = put_exceptions(c, e[r], e_end[r], values);
#pragma GCC unroll 4
          for (int t = 0; t < 4; ++t) v[r][t] = load16(values + 16 * t);
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        vec16 sum = load16(y + c + 16 * t);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) sum += a[r] * v[r][t];
        store16(y + c + 16 * t, sum);
      }
    }
  }

  Bf16Planes(int64_t K, int64_t n)
      : K_(K), n_(n), buffer_(K * n / 2 * 3 + 64, 0), table_(K * 16, 0), row_start_(K + 1, 0) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(buffer_.data());
    data_ = buffer_.data() + (64 - at % 64) % 64;  // chunks from a cache line's start
  }

  // Each row's table, indices and low bytes (rows in parallel, each its own exceptions, joined in row order after);
  // false where the exceptions are too many.
  bool fill(const uint16_t* w, int64_t ldw) {
    const int64_t most = static_cast<int64_t>(kMostExceptions * static_cast<double>(K_ * n_));
    std::vector<std::vector<std::pair<int32_t, float>>> apart(K_);
    std::atomic<int64_t> total{0};
    at::parallel_for(0, K_, 16, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end && total.load(std::memory_order_relaxed) <= most; ++k) {
        fill_row(w + k * ldw, k, apart[k]);
        total += static_cast<int64_t>(apart[k].size());
      }
    });
    if (total.load() > most) return false;
    exception_column_.reserve(total.load());
    exception_value_.reserve(total.load());
    for (int64_t k = 0; k < K_; ++k) {
      for (const auto& [column, value] : apart[k]) {
        exception_column_.push_back(column);
        exception_value_.push_back(value);
      }
      row_start_[k + 1] = static_cast<int64_t>(exception_column_.size());
    }
    return true;
  }

  // Row k from its bf16 values: its table (the 16 commonest high bytes), each weight's index and low byte, and the
  // weights whose high byte the table lacks, in column order.
  void fill_row(const uint16_t* row, int64_t k, std::vector<std::pair<int32_t, float>>& apart) {
    std::array<int64_t, 256> count{};
    for (int64_t j = 0; j < n_; ++j) ++count[row[j] >> 8];
    std::array<int, 256> order;
    for (int i = 0; i < 256; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return count[a] > count[b]; });
    std::array<int, 256> slot;
    slot.fill(-1);
    uint8_t* table = table_.data() + k * 16;
    for (int i = 0; i < 16 && count[order[i]] > 0; ++i) {
      table[i] = static_cast<uint8_t>(order[i]);
      slot[order[i]] = i;
    }
    const int64_t g = k / kGroupRows, r = k % kGroupRows;
    for (int64_t j = 0; j < n_; ++j) {
      const int64_t c = j / kChunk * kChunk, p = position_of(j % kChunk);
      chunk_low(g, r, c)[p] = static_cast<uint8_t>(row[j] & 0xff);
      int i = slot[row[j] >> 8];
      if (i < 0) {
        apart.emplace_back(static_cast<int32_t>(j), bf16_to_float(row[j]));
        i = 0;
      }
      chunk_index(g, r, c)[p / 2] |= static_cast<uint8_t>(i << (4 * (p % 2)));
    }
  }

  // The chunk's exceptions from e on put in place in its 64 values (in column order); the next one's index.
  __attribute__((noinline)) int64_t put_exceptions(int64_t c, int64_t e, int64_t e_end, float* values) const {
    for (; e < e_end && exception_column_[e] < c + kChunk; ++e) values[exception_column_[e] - c] = exception_value_[e];
    return e;
  }

#if SGL_PLANES_AVX512
  // A chunk's 64 values: the indices widened to a byte each, their high bytes looked up (vpshufb), the low and high
  // bytes unpacked to bf16 words, and each dword's two words made float32 by a shift (the even word) and a mask (the
  // odd one): four shuffles and six plain ops, 16 columns a register, in natural order.
  static void decode(const uint8_t* low, const uint8_t* index, __m512i tables, vec16* v) {
    const __m512i packed = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(index)));
    // (packed | packed << 4) & 0x0f in each byte: a word's low byte its byte's low nibble, its high byte the high one
    const __m512i positions =
        _mm512_ternarylogic_epi32(packed, _mm512_slli_epi16(packed, 4), _mm512_set1_epi8(0x0f), 0xa8);
    const __m512i high = _mm512_shuffle_epi8(tables, positions);
    const __m512i lows = _mm512_loadu_si512(low);
    const __m512i words[2] = {_mm512_unpacklo_epi8(lows, high), _mm512_unpackhi_epi8(lows, high)};
    const __m512i odd = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
    for (int h = 0; h < 2; ++h) {
      const __m512i f[2] = {_mm512_slli_epi32(words[h], 16), _mm512_and_si512(words[h], odd)};
      std::memcpy(&v[2 * h], &f[0], sizeof(vec16));
      std::memcpy(&v[2 * h + 1], &f[1], sizeof(vec16));
    }
  }
#elif SGL_PLANES_AVX2
  // As above in two halves of 32 positions: the first half's registers hold columns 16 t .. 16 t + 7, the second's
  // 16 t + 8 .. 16 t + 15.
  static void decode(const uint8_t* low, const uint8_t* index, __m256i tables, vec16* v) {
    const __m256i odd = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < 2; ++h) {
      const __m256i packed = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(index + 16 * h)));
      const __m256i positions = _mm256_and_si256(_mm256_or_si256(packed, _mm256_slli_epi16(packed, 4)), nibble);
      const __m256i high = _mm256_shuffle_epi8(tables, positions);
      const __m256i lows = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + 32 * h));
      const __m256i words[2] = {_mm256_unpacklo_epi8(lows, high), _mm256_unpackhi_epi8(lows, high)};
      for (int w = 0; w < 2; ++w) {
        const __m256i f[2] = {_mm256_slli_epi32(words[w], 16), _mm256_and_si256(words[w], odd)};
        std::memcpy(&v[2 * w].part[h], &f[0], sizeof(vreg));
        std::memcpy(&v[2 * w + 1].part[h], &f[1], sizeof(vreg));
      }
    }
  }
#else
  static void decode(const uint8_t* low, const uint8_t* index, const uint8_t* table, vec16* v) {
    alignas(64) float values[kChunk];
    for (int64_t p = 0; p < kChunk; ++p) {
      const int i = (index[p / 2] >> (4 * (p % 2))) & 0x0f;
      values[column_at(p)] = bf16_to_float(static_cast<uint16_t>(low[p] | (table[i] << 8)));
    }
    for (int t = 0; t < 4; ++t) v[t] = load16(values + 16 * t);
  }
#endif

  int64_t K_, n_;
  std::vector<uint8_t> buffer_, table_;  // buffer_: the groups' chunks, from data_ (a cache line's start) on
  uint8_t* data_ = nullptr;
  std::vector<int64_t> row_start_;  // [K + 1]: row k's exceptions are [row_start[k], row_start[k + 1])
  std::vector<int32_t> exception_column_;
  std::vector<float> exception_value_;
};

}  // namespace sgl_cpu
