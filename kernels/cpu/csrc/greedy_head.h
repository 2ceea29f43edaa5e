// The argmax of a few rows' logits x W^T through a float32 or bf16 LM head W [V, K] without reading all of W: an
// int8 copy of W (per-row absmax scales, one pass for all the rows) against each x rounded to int16 gives every
// logit to within a bound proven from per-row norms of both rounding errors and of float32 summation; only the rows
// of W whose interval reaches the best lower end can be the maximum, and those few are computed exactly (in double,
// from W and the row linear_core reads) and separated by float32 summation's error bound. The token is then the one linear_core's logits would give,
// bitwise: where the bound cannot separate the candidates (a near tie, two equal rows of W, a row of x with a
// non-finite value, too many candidates), it answers "undecided" and the caller reads the whole head.
//
// Why: at batch 1 a decode step reads its whole LM head from memory (a bf16 head of 32000 x 256 is 16 MB, the step's
// largest read: 38% of a mid-shape MXFP4 step); the int8 copy is half of that, and integer products run 16 a vector
// instruction. The decode loop at mid, MXFP4, one process, alternating: 610 -> 766 tok/s by medians (AMD EPYC, 2
// threads; docs/performance.md).
//
// The bound. With W's row w = s q + e (q int8, |q| <= 127, s its scale) and x = t p + r (p int16, |p| <= P, the
// largest for which 127 P K stays an int32: x's rounding error is then a small part of the bound; with x in int8 it
// was more than half of it at K = 2048, and a random 248320 x 2048 head left 25x the candidates, most steps over
// kMaxCandidates):
//   |x.w - s t (p.q)| <= s |q|_2 |r|_2 + |e|_2 |x|_2                                  (Cauchy-Schwarz, twice)
// and linear_core's float32 sum of K products, in any order (FMA or not, split over K, vdpbf16ps' exact products),
// is within gamma_{2K} sum |x_k w_k| <= gamma_{2K} |w|_2 |x|_2 of x.w (gamma_n = n u / (1 - n u), u = 2^-24). Where
// linear_core rounds x to bf16 first (vdpbf16ps), x.w moves by at most |w|_2 |x - bf16(x)|_2 more. Every norm is
// taken in double and rounded up; float32 arithmetic on the bounds is covered by a relative slack of 2^-18.
#pragma once

#include "common.h"
#include "gemm.h"

#include <memory>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace sgl_cpu {

class GreedyHead {
 public:
  // More candidates than this and the head is read whole (an x that separates no logits).
  static constexpr int64_t kMaxCandidates = 64;
  // Weight rows decide() asks for ahead of the one it reads, and the parts of K it reads in parallel at most.
  static constexpr int64_t kAheadRows = 16;
  static constexpr int64_t kMaxParts = 8;
  // |p.q| <= 127 * 127 * K stays below 2^31 (P at least 127)
  static constexpr int64_t kMaxK = 131072;

  // The screen of head_w [V, K] (float32 or bf16, any strides), or null where its values are not all finite or K
  // is too long for int32 sums of int8 products.
  static std::unique_ptr<GreedyHead> build(const at::Tensor& head_w) {
    TORCH_CHECK(head_w.dim() == 2 && (head_w.scalar_type() == at::kFloat || head_w.scalar_type() == at::kBFloat16),
                "the greedy head takes a float32 or bf16 [V, K] weight, got ", head_w.scalar_type(), " ",
                head_w.sizes());
    if (head_w.size(1) > kMaxK || head_w.size(0) == 0) return nullptr;
    std::unique_ptr<GreedyHead> screen(new GreedyHead(head_w.size(0), head_w.size(1)));
    return screen->quantize(head_w) ? std::move(screen) : nullptr;
  }

  // Each row's argmax of xs [rows, K] (float32, rows lda apart; at most kMaxRows) W^T as linear_core computes it for
  // the rows together with `bf16_dot` (`head_w` the weight this screen was built from), into out[r]: -1 where the
  // bound cannot decide it. One pass over the int8 copy serves every row.
  void argmax_rows(const float* xs, int64_t lda, int64_t rows, const at::Tensor& head_w, int64_t bf16_dot,
                   int64_t* out) const {
    TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "the greedy head takes 1 to ", kMaxRows, " rows, got ", rows);
    const int64_t V = V_;
    // where linear_core takes vdpbf16ps for this head (linear_in_out: a bf16 weight stored [in, out]), the first
    // V / 32 * 32 columns see the rows rounded to bf16 and the rest the rows themselves
    const bool bf16 = head_w.scalar_type() == at::kBFloat16;
    const bool dot = bf16 && head_w.stride(0) == 1 && V != 1 && bf16_dot_for(bf16_dot, rows);
    thread_local std::vector<int16_t> p_buf;  // the calling thread's; the workers take its pointer
    p_buf.assign(rows * Kp_, 0);
    Row row[kMaxRows];
    bool any_row = false;
    for (int64_t r = 0; r < rows; ++r) {
      row[r] = round_row(xs + r * lda, dot, p_buf.data() + r * Kp_);
      any_row |= row[r].ok;
    }
    for (int64_t r = 0; r < rows; ++r) out[r] = -1;
    if (!any_row) return;

    // every row's interval [lower, upper] of every logit; each row's best lower end
    thread_local std::vector<float> upper_buf;
    upper_buf.resize(rows * V);
    float* const upper = upper_buf.data();
    const int16_t* const p = p_buf.data();
    const int threads = at::get_num_threads();
    std::vector<float> best(threads * kPad * rows, -std::numeric_limits<float>::infinity());  // a line a thread
    const int64_t groups = (V + 7) / 8;
    at::parallel_for(0, groups, grain(8 * Kp_ * rows), [&](int64_t begin, int64_t end) {
      f32x8 floor8[kMaxRows];
      float floor1[kMaxRows];
      for (int64_t r = 0; r < rows; ++r) {
        floor8[r] = f32x8{} - std::numeric_limits<float>::infinity();
        floor1[r] = -std::numeric_limits<float>::infinity();
      }
      for (int64_t g = begin; g < end; ++g) {
        const int64_t i0 = g * 8;
        ask_for_group(i0);
        for (int64_t r = 0; r < rows; ++r) {
          if (!row[r].ok) continue;
          const Row& x = row[r];
          float* up = upper + r * V;
          if (i0 + 8 <= V) {
            i32x8 dots;
            dots8(i0, p + r * Kp_, dots);
            const f32x8 A = __builtin_convertvector(dots, f32x8) * load8(scale_.data() + i0) * x.t;
            const f32x8 B =
                load8(a_.data() + i0) * x.R2 + load8(b_.data() + i0) * x.X2 + load8(norm_.data() + i0) * x.D2;
            const f32x8 slack = B * (1.0f + kSlack) + kSlack * (A < 0 ? -A : A) + 1e-30f;
            const f32x8 high = A + slack, low = A - slack;
            std::memcpy(up + i0, &high, sizeof(high));
            floor8[r] = low > floor8[r] ? low : floor8[r];
            continue;
          }
          for (int64_t i = i0; i < V; ++i) {
            const float A = static_cast<float>(dot1(i, p + r * Kp_)) * scale_[i] * x.t;
            const float B = a_[i] * x.R2 + b_[i] * x.X2 + norm_[i] * x.D2;
            const float slack = B * (1.0f + kSlack) + kSlack * std::fabs(A) + 1e-30f;
            up[i] = A + slack;
            floor1[r] = std::max(floor1[r], A - slack);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int j = 0; j < 8; ++j) floor1[r] = std::max(floor1[r], floor8[r][j]);
        float& mine = best[(at::get_thread_num() * rows + r) * kPad];
        mine = std::max(mine, floor1[r]);
      }
    });
    for (int64_t r = 0; r < rows; ++r) {
      if (!row[r].ok) continue;
      float floor = -std::numeric_limits<float>::infinity();
      for (int th = 0; th < threads; ++th) floor = std::max(floor, best[(th * rows + r) * kPad]);
      out[r] = decide(xs + r * lda, upper + r * V, floor, head_w, dot ? V / 32 * 32 : 0);
    }
  }

  static constexpr int64_t kMaxRows = 8;

 private:
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef int32_t i32x8 __attribute__((vector_size(32)));
  static constexpr int kPad = 16;  // floats: 64 bytes

  // A row x = t p + r (p written out, zero past K) and the norms its bound takes; not ok where x holds a non-finite
  // value or its logits could overflow float32.
  struct Row {
    float t = 0.0f, R2 = 0.0f, X2 = 0.0f, D2 = 0.0f;
    bool ok = false;
  };

  Row round_row(const float* x, bool dot, int16_t* p) const {
    Row row;
    double absmax = 0.0, x2 = 0.0, d2 = 0.0;
    for (int64_t k = 0; k < K_; ++k) {
      if (!std::isfinite(x[k])) return row;
      absmax = std::max(absmax, std::fabs(static_cast<double>(x[k])));
      x2 += static_cast<double>(x[k]) * x[k];
      if (dot) {
        const double d = static_cast<double>(x[k]) - bf16_to_float(float_to_bf16(x[k]));
        d2 += d * d;
      }
    }
    row.t = static_cast<float>(absmax / x_max_);
    double r2 = 0.0;
    const float limit = static_cast<float>(x_max_);
    for (int64_t k = 0; k < K_ && row.t > 0.0f; ++k) {
      p[k] = static_cast<int16_t>(std::clamp(std::nearbyint(x[k] / row.t), -limit, limit));
      const double r = static_cast<double>(x[k]) - static_cast<double>(row.t) * p[k];
      r2 += r * r;
    }
    row.R2 = up(std::sqrt(r2));
    row.X2 = up(std::sqrt(x2));
    row.D2 = up(std::sqrt(d2) * (1.0 + gamma_));
    row.ok = static_cast<double>(row.X2) * max_norm_ < 1e30;  // else logits that float32 may overflow
    return row;
  }

  // The token of row x from its intervals' upper ends and the best lower end: the rows that reach it computed
  // exactly, x.w in double (exact products) with sum |x_k w_k|, a weight row at a time (the columns below
  // dot_columns from x rounded to bf16, as linear_core reads them); -1 where they do not separate.
  int64_t decide(const float* x, const float* upper, float floor, const at::Tensor& head_w,
                 int64_t dot_columns) const {
    const int64_t V = V_, K = K_;
    int64_t candidates[kMaxCandidates];
    int64_t count = 0;
    const f32x8 floors = f32x8{} + floor;
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
      const i32x8 reach = load8(upper + i) >= floors;
      if (!any(reach)) continue;
      for (int j = 0; j < 8; ++j) {
        if (!reach[j]) continue;
        if (count == kMaxCandidates) return -1;
        candidates[count++] = i + j;
      }
    }
    for (; i < V; ++i) {
      if (upper[i] < floor) continue;
      if (count == kMaxCandidates) return -1;
      candidates[count++] = i;
    }
    if (count == 0) return -1;
    const bool bf16 = head_w.scalar_type() == at::kBFloat16;
    const int64_t s0 = head_w.stride(0), s1 = head_w.stride(1);
    const uint16_t* w16 = bf16 ? static_cast<const uint16_t*>(head_w.data_ptr()) : nullptr;
    const float* w32 = bf16 ? nullptr : head_w.data_ptr<float>();
    // a head stored [in, out] has each candidate's weights a whole row apart: a cache line from memory for each
    // product, each waited for in turn unless asked for ahead (into L2: the lines are many and each read once). The
    // products are exact in double and their sums far inside the margins, so K is cut into fixed parts, one a
    // thread, their sums added in part order: every thread's misses in flight, the same token.
    const auto address = [&](int64_t c, int64_t k) -> const void* {
      const int64_t offset = candidates[c] * s0 + k * s1;
      return bf16 ? static_cast<const void*>(w16 + offset) : static_cast<const void*>(w32 + offset);
    };
    const int64_t parts = std::clamp<int64_t>(at::get_num_threads(), 1, kMaxParts);
    double part_sum[kMaxParts][kMaxCandidates], part_magnitude[kMaxParts][kMaxCandidates];
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t part = begin; part < end; ++part) {
        const int64_t k0 = K * part / parts, k1 = K * (part + 1) / parts;
        double* sum = part_sum[part];
        double* magnitude = part_magnitude[part];
        std::fill_n(sum, count, 0.0);
        std::fill_n(magnitude, count, 0.0);
        for (int64_t k = k0; k < std::min(k1, k0 + kAheadRows); ++k) {
          for (int64_t c = 0; c < count; ++c) __builtin_prefetch(address(c, k), 0, 2);
        }
        for (int64_t k = k0; k < k1; ++k) {
          const double xk = x[k], xr = bf16_to_float(float_to_bf16(x[k]));
          if (k + kAheadRows < k1) {
            for (int64_t c = 0; c < count; ++c) __builtin_prefetch(address(c, k + kAheadRows), 0, 2);
          }
          for (int64_t c = 0; c < count; ++c) {
            const int64_t offset = candidates[c] * s0 + k * s1;
            const double product = (candidates[c] < dot_columns ? xr : xk) *
                                   (bf16 ? static_cast<double>(bf16_to_float(w16[offset])) : w32[offset]);
            sum[c] += product;
            magnitude[c] += std::fabs(product);
          }
        }
      }
    });
    double sum[kMaxCandidates], magnitude[kMaxCandidates];
    for (int64_t c = 0; c < count; ++c) {
      sum[c] = part_sum[0][c];
      magnitude[c] = part_magnitude[0][c];
      for (int64_t part = 1; part < parts; ++part) {
        sum[c] += part_sum[part][c];
        magnitude[c] += part_magnitude[part][c];
      }
    }
    int64_t winner = 0;  // the first of equal values, as argmax_rows
    for (int64_t c = 1; c < count; ++c) winner = sum[c] > sum[winner] ? c : winner;
    const auto margin = [&](int64_t c) { return gamma_ * (1.0 + 1e-6) * magnitude[c] + 1e-30; };
    for (int64_t c = 0; c < count; ++c) {
      if (c != winner && !(sum[winner] - margin(winner) > sum[c] + margin(c))) return -1;
    }
    return candidates[winner];
  }

  static f32x8 load8(const float* p) {
    f32x8 v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }

  static bool any(i32x8 m) {
    int32_t acc = 0;
    for (int j = 0; j < 8; ++j) acc |= m[j];
    return acc != 0;
  }

  GreedyHead(int64_t V, int64_t K)
      : V_(V),
        K_(K),
        Kp_((K + 31) / 32 * 32),
        x_max_(std::min<int64_t>(32767, std::numeric_limits<int32_t>::max() / (127 * std::max<int64_t>(K, 1)))),
        gamma_(2.0 * K * kUnit / (1.0 - 2.0 * K * kUnit)) {}

  static constexpr double kUnit = 1.0 / 16777216.0;  // float32's unit roundoff, 2^-24
  static constexpr float kSlack = 1.0f / 262144.0f;  // 2^-18

  // the float32 at or above v
  static float up(double v) {
    float f = static_cast<float>(v);
    if (static_cast<double>(f) < v) f = std::nextafter(f, std::numeric_limits<float>::infinity());
    return f;
  }

  // q, its scales and each row's bound coefficients, from W in chunks of rows (as float32, contiguous)
  bool quantize(const at::Tensor& head_w) {
    q_.assign(V_ * Kp_, 0);
    scale_.resize(V_);
    a_.resize(V_);
    b_.resize(V_);
    norm_.resize(V_);
    constexpr int64_t kChunk = 4096;
    for (int64_t i0 = 0; i0 < V_; i0 += kChunk) {
      const at::Tensor rows = head_w.narrow(0, i0, std::min(kChunk, V_ - i0)).to(at::kFloat).contiguous();
      const float* w = rows.data_ptr<float>();
      std::atomic<bool> finite{true};
      at::parallel_for(0, rows.size(0), 64, [&](int64_t begin, int64_t end) {
        for (int64_t j = begin; j < end; ++j) {
          const float* wr = w + j * K_;
          const int64_t i = i0 + j;
          float absmax = 0.0f;
          for (int64_t k = 0; k < K_; ++k) {
            if (!std::isfinite(wr[k])) finite = false;
            absmax = std::max(absmax, std::fabs(wr[k]));
          }
          const float s = absmax / 127.0f;
          double q2 = 0.0, e2 = 0.0, w2 = 0.0;
          int8_t* qr = q_.data() + i * Kp_;
          for (int64_t k = 0; k < K_ && s > 0.0f; ++k) {
            const int q = static_cast<int>(std::clamp(std::nearbyint(wr[k] / s), -127.0f, 127.0f));
            qr[k] = static_cast<int8_t>(q);
            const double e = static_cast<double>(wr[k]) - static_cast<double>(s) * q;
            q2 += static_cast<double>(q) * q;
            e2 += e * e;
            w2 += static_cast<double>(wr[k]) * wr[k];
          }
          scale_[i] = s;
          a_[i] = up(static_cast<double>(s) * std::sqrt(q2) * (1.0 + 1e-9));
          b_[i] = up((std::sqrt(e2) + gamma_ * std::sqrt(w2)) * (1.0 + 1e-9));
          norm_[i] = up(std::sqrt(w2) * (1.0 + 1e-9));
        }
      });
      if (!finite) return false;
    }
    max_norm_ = *std::max_element(norm_.begin(), norm_.end());
    return true;
  }

  int32_t dot1(int64_t i, const int16_t* p) const {
    const int8_t* q = q_.data() + i * Kp_;
    int32_t sum = 0;
    for (int64_t k = 0; k < K_; ++k) sum += static_cast<int32_t>(q[k]) * p[k];
    return sum;
  }

  // Every line of rows i0 .. i0 + 15 asked for at once: from memory, the products' loads alone keep too few lines
  // in flight (a 32000 x 256 screen read after a cache flush in 0.47-0.70 of the time it took without, in two runs;
  // asking only for groups further ahead, 0.75-1.0).
  void ask_for_group(int64_t i0) const {
    const char* lines = reinterpret_cast<const char*>(q_.data() + i0 * Kp_);
    const int64_t bytes = std::min<int64_t>(16, V_ - i0) * Kp_;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(lines + b, 0, 3);
  }

#if defined(__AVX2__)
  // The lane sums of eight int32 vectors, out[j] = sum of acc[j]'s lanes.
  static void sum8(const __m256i* acc, i32x8& out) {
    const __m256i h01 = _mm256_hadd_epi32(acc[0], acc[1]), h23 = _mm256_hadd_epi32(acc[2], acc[3]);
    const __m256i h45 = _mm256_hadd_epi32(acc[4], acc[5]), h67 = _mm256_hadd_epi32(acc[6], acc[7]);
    const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
    const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                                          _mm256_permute2x128_si256(lo, hi, 0x31));
    std::memcpy(&out, &sums, sizeof(out));
  }
#endif

  // p.q of rows i0 .. i0 + 7 (p zero past K). The sums are exact int32s in any order: every instruction set gives the
  // same. AVX-512 takes 32 of K a step (with VNNI's vpdpwssd, the products and their sum in one instruction): a
  // bf16 32000 x 1024 head from memory, through DecodeLayers.head_argmax on 2 Zen 4 threads, 1088 -> 887 us at best
  // (six processes of each, alternating); a 32000 x 256 one in cache gained nothing (149 against 154 us: the L3).
  void dots8(int64_t i0, const int16_t* p, i32x8& out) const {
#if defined(__AVX512BW__)
    const int8_t* q = q_.data() + i0 * Kp_;
    __m512i acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_si512();
    for (int64_t k = 0; k < Kp_; k += 32) {  // Kp_ is a multiple of 32
      const __m512i pv = _mm512_loadu_si512(p + k);
      for (int j = 0; j < 8; ++j) {
        const __m512i qv =
            _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * Kp_ + k)));
#if defined(__AVX512VNNI__)
        acc[j] = _mm512_dpwssd_epi32(acc[j], qv, pv);
#else
        acc[j] = _mm512_add_epi32(acc[j], _mm512_madd_epi16(qv, pv));
#endif
      }
    }
    __m256i half[8];  // each sum's halves added, then as the AVX2 path's eight
    for (int j = 0; j < 8; ++j) {
      half[j] = _mm256_add_epi32(_mm512_castsi512_si256(acc[j]), _mm512_extracti64x4_epi64(acc[j], 1));
    }
    sum8(half, out);
#elif defined(__AVX2__)
    const int8_t* q = q_.data() + i0 * Kp_;
    __m256i acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_si256();
    for (int64_t k = 0; k < Kp_; k += 16) {
      const __m256i pv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k));
      for (int j = 0; j < 8; ++j) {
        // 16 of q widened to int16, times p's, pairs summed to int32 (each at most 2 * 127 * 32767)
        const __m256i qv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * Kp_ + k)));
        acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(qv, pv));
      }
    }
    sum8(acc, out);
#else
    for (int j = 0; j < 8; ++j) out[j] = dot1(i0 + j, p);
#endif
  }

  int64_t V_, K_, Kp_;
  int64_t x_max_;  // P: x's int16 values lie in [-P, P]
  double gamma_;  // gamma_{2K}: float32 summation's relative bound
  double max_norm_ = 0.0;
  std::vector<int8_t> q_;  // [V, Kp], zero past K
  std::vector<float> scale_, a_, b_, norm_;  // s; s |q|_2; |e|_2 + gamma |w|_2; |w|_2 (each rounded up)
};

}  // namespace sgl_cpu
