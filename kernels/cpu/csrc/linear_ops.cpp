// Linear layers of float32 rows on the CPU, with float32, bf16 or block-FP8 weights (gemm.h widens each in
// registers): every projection and the LM head of a decode step, and a prefill's when its weights are 16- or 8-bit.
#include "bf16_planes.h"
#include "common.h"
#include "gemm.h"
#include "mxfp4.h"
#include "ops.h"

#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include <type_traits>

namespace sgl_cpu {

namespace {

// Rows of a prefill run in panels of this many, so that a panel of activations stays in L2 while every column
// block of the weight passes over it.
constexpr int64_t kPanelRows = 256;

// Rows a thread takes at least when a narrow weight's rows are split over the threads.
constexpr int64_t kNarrowRows = 16;

// y = x W^T for one row x (rounded to bf16) and bf16 W [N, K] stored [in, out] through vdpbf16ps: each thread's
// share of the columns (whole blocks of 256, or of 128 where that leaves too few blocks for the threads) read as
// long runs of each weight row (gemm.h's one_row_long_run_dp: 8-16% faster from memory than its blocks one after
// another, the same values), the last N % 32 columns widened.
#if defined(__AVX512BF16__)
void one_row_bf16_dp(const float* xs, int64_t K, const uint16_t* w, int64_t ldw, int64_t N, float* o) {
  Bf16Pairs pairs;
  to_bf16_pairs(xs, K, 1, K, pairs);
  const bool wide = N >= 256 * 2 * at::get_num_threads();
  const int64_t width = wide ? 256 : 128, blocks = N / width;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {  // a thread's blocks, read as long runs
    const int64_t n0 = begin * width;
    one_row_long_run_dp(pairs.row(0), pairs.pairs, w + n0, ldw, K, (end - begin) * width, o + n0);
  });
  rows_times_weight_columns_dp(pairs, 0, xs, K, 1, w, ldw, K, blocks * width, N, o, N);
}
#else
void one_row_bf16_dp(const float*, int64_t, const uint16_t*, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "vdpbf16ps is not available on this CPU");
}
#endif

// One row through an unscaled weight of kSplitKColumns columns or more (every projection but gates and routers):
// each thread takes a range of K, reading its weight rows whole, in address order (a copy's pattern), into its own
// float32 sums of every column, which are added at the end. Column blocks, whose rows are a whole row apart, read
// memory at ~20 GB/s on this project's AMD EPYC; a thread's range of whole rows at 23-38 (a 512 x 512 bf16 weight
// 1.3-1.7x as fast, an LM head of 32000 columns 1.3-1.45x; docs/performance.md). More rows through such a weight
// take the same parts of K, each part's sums in k order and the parts added in order: a row's values do not depend
// on how many rows came with it (a speculative verify step computes what a decode step does) up to kSplitKRows
// rows, and for weights of kWideSplitKColumns or more at every row count. Above kSplitKRows, narrower weights take
// the column blocks (a prefill's: the 32 x 128-token prefill at the mid shape ran 10% slower on AVX2 in panels
// through the parts). Batch invariant (no split: the parts follow the threads): the column blocks.
constexpr int64_t kSplitKColumns = 128;
constexpr int64_t kWideSplitKColumns = 3072;
constexpr int64_t kSplitKRows = 64;
// A narrower weight (a router's: 16 to 127 columns) of this many elements or more takes the same path (at the big
// bench shape's float32 64 x 1024 router, from memory, through the op on 2 Zen 4 threads: 27-35 -> 16-18 us, its
// weight rows read whole; a 64 x 512 one read in cache, below this, took 4.0-4.3 us as column blocks and 5.1-7.5 so).
constexpr int64_t kNarrowSplitKElements = 64 * 1024;

int64_t split_k_parts(int64_t K) { return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), K / 64)); }

// Weights of fewer elements than this run one row's parts of K on the calling thread, one after another (the same
// sums): split over two Zen 3 threads, a bf16 256 x 512 weight (a mid shape's out_proj) took 14.9 us against 9.7 on
// one, and 768 x 256 17.0 against 15.8; 2048 x 256 31.8 against 39.6 (through the op, less its ~6 us dispatch;
// docs/performance.md). Not a router (narrower than kSplitKColumns, here from kNarrowSplitKElements on): read once a
// step, after the rest of its layer, it comes from memory, where one thread reads at half the pair's speed (a Xeon,
// the big shape's float32 64 x 1024 router cold: 31.7 us on one thread, 21-25 on two; in cache 9 against 8-11).
constexpr int64_t kSplitKSerialElements = 256 * 1024;

// `planes`: the weight's 12-bit copy (bf16_planes.h; bf16 weights only), read for the columns it holds in place of the
// bf16 weight: the same sums.
template <class W>
void one_row_split_k(const float* x, int64_t K, const typename W::T* w, int64_t ldw, int64_t N, float* o,
                     const Bf16Planes* planes = nullptr) {
  const int64_t parts = split_k_parts(K);
  const int64_t n16 = N - N % 16;
  thread_local std::vector<float> sums;
  if (static_cast<int64_t>(sums.size()) < parts * n16) sums.resize(parts * n16);
  float* partial = sums.data();
  const bool serial = N >= kSplitKColumns && N * K < kSplitKSerialElements;
  at::parallel_for(0, parts, serial ? parts : 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t k0 = K * p / parts, k1 = K * (p + 1) / parts;
      std::fill_n(partial + p * n16, n16, 0.0f);  // by the thread that sums into them
      const int64_t packed = planes != nullptr ? planes->columns() : 0;  // at most n16
      if (packed > 0) planes->add_rows(x + k0, k0, k1, partial + p * n16);
      if (packed < n16) {
        one_row_add_long_run<W>(x + k0, w + k0 * ldw + packed, ldw, k1 - k0, n16 - packed, partial + p * n16 + packed);
      }
    }
  });
  at::parallel_for(0, n16 / 16, serial ? n16 / 16 : 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin * 16; j < end * 16; j += 16) {
      vec16 total = load16(partial + j);
      for (int64_t p = 1; p < parts; ++p) total += load16(partial + p * n16 + j);
      store16(o + j, total);
    }
  });
  rows_times_weight_columns<W>(x, K, 1, w, ldw, K, n16, N, o, N, WeightScales{});  // the last N % 16 columns
}

// Rows of a panel at a time through the parts of K (each part's sums of every column kept until they are added).
// A row's values do not depend on it. 128 rather than 32: a 128-token prefill through a 512x3072 bf16 weight ran
// 13-16% faster widened (AVX2 2.49 -> 2.16 ms, AVX-512 2.2-2.5 -> 2.0 ms; each weight block widened once a panel).
constexpr int64_t kSplitKPanelRows = 128;

// M > 1 rows through a wide unscaled weight (more than kFewRows, or a weight of at most kRowRunColumns columns: below),
// as one_row_split_k computes one: per panel of rows, part 0 of K into o, every later part into its own sums, added
// to o in order; the last N % 16 columns over all of K.
template <class W>
void rows_split_k(const float* xs, int64_t lda, int64_t M, int64_t K, const typename W::T* w, int64_t ldw, int64_t N,
                  float* o) {
  const int64_t parts = split_k_parts(K), n16 = N - N % 16, blocks = n16 / 16;
  // every later part's sums are written before they are read: not zeroed (16 MB: 128 rows, 32000 columns, 2 parts)
  const std::unique_ptr<float[]> later(new float[(parts - 1) * std::min(M, kSplitKPanelRows) * n16]);
  for (int64_t m0 = 0; m0 < M; m0 += kSplitKPanelRows) {
    const int64_t rows = std::min(kSplitKPanelRows, M - m0);
    const float* panel = xs + m0 * lda;
    float* out = o + m0 * N;
    const auto run = [&](int64_t begin, int64_t end) {
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t k0 = K * p / parts, k1 = K * (p + 1) / parts;
        float* sums = p == 0 ? out : later.get() + (p - 1) * rows * n16;
        const int64_t ld = p == 0 ? N : n16;
        rows_times_weight_columns<W>(panel + k0, lda, rows, w + k0 * ldw, ldw, k1 - k0, begin * 16, end * 16, sums, ld,
                                     WeightScales{});
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = begin * 16; j < end * 16; j += 16) {
          vec16 total = load16(out + r * N + j);
          for (int64_t p = 1; p < parts; ++p) total += load16(later.get() + ((p - 1) * rows + r) * n16 + j);
          store16(out + r * N + j, total);
        }
      }
    };
    constexpr int64_t kItem = 4;  // blocks of 16 columns a work item
    parallel_items((blocks + kItem - 1) / kItem, grain(rows * K * 16 * kItem / 4),
                   [&](int64_t i, int64_t) { run(i * kItem, std::min(blocks, (i + 1) * kItem)); });
  }
  rows_times_weight_columns<W>(xs, lda, M, w, ldw, K, n16, N, o, N, WeightScales{});  // the last N % 16 columns
}

// A few rows through a weight that one row reads split over K (one_row_split_k) take the same parts of K the same
// way: each thread streams its part's weight rows into its own sums of every row (in runs of kFewRowsSums / rows
// columns, which stay in L1), each weight vector widened once for all the rows. Rows of a weight wider than
// kRowRunColumns four at a time, for 2 to kFewRows rows; of a narrower weight, two rows only, one weight row at a
// time (one stream, as one row reads it: four runs of such short rows at a time did not stream, and 3-8 rows ran no
// faster, on AVX2 up to 30% slower, than the column blocks). Before, the threads took blocks of 16 columns through
// every part (rows_split_k), reading rows a whole weight row apart at half one row's speed. Each part's sums are in
// k order and the parts are added in order: what one row and rows_split_k compute, bitwise. Two rows through bf16
// weights of 512 x 512 to 256 x 2048 from memory 1.7-2.4x as fast, 2-8 through a 512 x 3088 one 1.0-2.3x; decode
// at 2, 4 and 8 requests at the 120M shape faster in one process (docs/performance.md). The sums' rows are padded by
// 16 floats, so that no two of them are a multiple of 4 KB apart (x86 stalls a load behind a store 4 KB away).
constexpr int64_t kFewRows = 8;
constexpr int64_t kFewRowsSums = 8192;  // floats

template <class W, int TM>
void few_rows_split_k(const float* xs, int64_t lda, int64_t K, const typename W::T* w, int64_t ldw, int64_t N,
                      float* o) {
  const int64_t parts = split_k_parts(K), n16 = N - N % 16;
  const int64_t ld = n16 + 16;
  const int64_t run = kFewRowsSums / TM / 16 * 16;  // columns of one pass over a part's weight rows
  thread_local std::vector<float> sums;
  sums.resize(parts * TM * ld);
  float* partial = sums.data();
  // two rows of a weight whose rows are short take them one at a time (one_row_split_k's order: one stream)
  const bool one_at_a_time = TM == 2 && n16 <= kRowRunColumns;
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t k0 = K * p / parts, k1 = K * (p + 1) / parts;
      float* c = partial + p * TM * ld;
      std::fill(c, c + TM * ld, 0.0f);
      for (int64_t j = 0; j < n16; j += run) {
        const float* a = xs + k0;
        const typename W::T* wj = w + k0 * ldw + j;
        const int64_t width = std::min(run, n16 - j);
        if (one_at_a_time) {
          rows_add_weight_rows<W>(a, lda, TM, wj, ldw, k1 - k0, width, c + j, ld);
        } else {
          few_rows_add_long_runs<W, TM>(a, lda, wj, ldw, k1 - k0, width, c + j, ld);
        }
      }
    }
  });
  const int64_t blocks = n16 / 16;
  at::parallel_for(0, TM * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / blocks, j = i % blocks * 16;
      vec16 total = load16(partial + t * ld + j);
      for (int64_t p = 1; p < parts; ++p) total += load16(partial + (p * TM + t) * ld + j);
      store16(o + t * N + j, total);
    }
  });
  rows_times_weight_columns<W>(xs, lda, TM, w, ldw, K, n16, N, o, N, WeightScales{});  // the last N % 16 columns
}

template <class W>
void few_rows_split_k(const float* xs, int64_t lda, int64_t M, int64_t K, const typename W::T* w, int64_t ldw,
                      int64_t N, float* o) {
  static_assert(kFewRows == 8, "one case a row count");
  switch (M) {
    case 2: return few_rows_split_k<W, 2>(xs, lda, K, w, ldw, N, o);
    case 3: return few_rows_split_k<W, 3>(xs, lda, K, w, ldw, N, o);
    case 4: return few_rows_split_k<W, 4>(xs, lda, K, w, ldw, N, o);
    case 5: return few_rows_split_k<W, 5>(xs, lda, K, w, ldw, N, o);
    case 6: return few_rows_split_k<W, 6>(xs, lda, K, w, ldw, N, o);
    case 7: return few_rows_split_k<W, 7>(xs, lda, K, w, ldw, N, o);
    default: return few_rows_split_k<W, 8>(xs, lda, K, w, ldw, N, o);
  }
}

// y = x W^T for W [N, K] stored [in, out] (row k of W^T contiguous, ldw apart).
template <class W>
void linear_in_out(const float* xs, int64_t lda, int64_t M, int64_t K, const typename W::T* w, int64_t ldw, int64_t N,
                   const WeightScales& sc, int64_t bf16_dot, float* o, const Bf16Planes* planes = nullptr) {
  int64_t n = 0;
  // One row of a narrower or scaled weight (or batch invariant) reads each weight once, from memory: blocks of 512
  // columns (128 where that leaves too few blocks for the threads, or the weight has 128-column scale blocks) stream
  // runs of 4 weight rows at a time; register-blocked 32-column blocks, reading short runs far apart, fell below MKL
  // (docs/performance.md).
  const bool dot = std::is_same_v<W, Bf16Weight> && bf16_dot_for(bf16_dot, M);
  if constexpr (!W::kScaled) {
    if ((N >= kWideSplitKColumns || (N >= kSplitKColumns && M <= kSplitKRows) ||
         (N >= 16 && N * K >= kNarrowSplitKElements && M <= kSplitKRows)) && K >= 128 && !dot &&
        !batch_invariant()) {
      if (M == 1) return one_row_split_k<W>(xs, K, w, ldw, N, o, planes);
      if (N > kRowRunColumns ? M <= kFewRows : M == 2) return few_rows_split_k<W>(xs, lda, M, K, w, ldw, N, o);
      return rows_split_k<W>(xs, lda, M, K, w, ldw, N, o);
    }
  }
  if constexpr (std::is_same_v<W, Bf16Weight> && kHaveDpbf16) {
    if (M == 1 && dot) return one_row_bf16_dp(xs, K, w, ldw, N, o);
  }
  if (M == 1) {
    // (on AVX2 and NEON half as wide: the one-row tile keeps 4 weight rows' products in flight per vector)
    constexpr int kRowVectors = (std::is_same_v<W, F32Weight> ? 32 : 16) / (kVec16Registers >= 32 ? 1 : 2);
    const bool wide = !W::kScaled && N >= 16 * kRowVectors * 2 * at::get_num_threads();
    const int64_t width = wide ? 16 * kRowVectors : 128, blocks = N / width;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t n0 = blk * width;
        if (wide) {
          one_row_times_columns<W, kRowVectors>(xs, w + n0, ldw, K, o + n0, sc.columns(n0));
        } else {
          one_row_times_columns<W, 8>(xs, w + n0, ldw, K, o + n0, sc.columns(n0));
        }
      }
    });
    n = blocks * width;
  }
  const int64_t first_block = n / 32, blocks = N / 32;
  // A narrow weight (a router's, a gate's: fewer blocks of 32 columns than the threads) through many rows: the
  // threads take rows instead of blocks (each row's values are the same either way).
  const bool narrow = M >= 2 * kNarrowRows && blocks - first_block < at::get_num_threads();
  if (narrow && !dot) {
    at::parallel_for(0, M, kNarrowRows, [&](int64_t r0, int64_t r1) {
      rows_times_weight_columns<W>(xs + r0 * lda, lda, r1 - r0, w, ldw, K, n, N, o + r0 * N, N, sc);
    });
    return;
  }
  if constexpr (std::is_same_v<W, Bf16Weight>) {
    if (dot && M > 1) {
      Bf16Pairs pairs;
      to_bf16_pairs(xs, lda, M, K, pairs);
      if (narrow) {
        at::parallel_for(0, M, kNarrowRows, [&](int64_t r0, int64_t r1) {
          rows_times_weight_columns_dp(pairs, r0, xs + r0 * lda, lda, r1 - r0, w, ldw, K, n, N, o + r0 * N, N);
        });
        return;
      }
      for (int64_t m0 = 0; m0 < M; m0 += kPanelRows) {
        const int64_t rows = std::min(kPanelRows, M - m0);
        at::parallel_for(first_block, blocks, grain(rows * K * 32 / 8), [&](int64_t begin, int64_t end) {
          for (int64_t blk = begin; blk < end; ++blk) {
            all_rows_times_32_columns_dp(pairs, m0, rows, w + blk * 32, ldw, K, o + m0 * N + blk * 32, N);
          }
        });
      }
      rows_times_weight_columns<W>(xs, lda, M, w, ldw, K, blocks * 32, N, o, N, sc);  // the last N % 32 columns
      return;
    }
  }
  for (int64_t m0 = 0; m0 < M; m0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, M - m0);
    const float* panel = xs + m0 * lda;
    parallel_items(blocks - first_block, grain(rows * K * 32 / 4), [&](int64_t i, int64_t next) {
      const int64_t blk = first_block + i;
      all_rows_times_32_columns<W>(panel, lda, rows, w + blk * 32, ldw, K, o + m0 * N + blk * 32, N,
                                   sc.columns(blk * 32), next >= 0 ? w + (first_block + next) * 32 : nullptr);
    });
  }
  rows_times_weight_columns<W>(xs, lda, M, w, ldw, K, blocks * 32, N, o, N, sc);  // the last N % 32 columns
}

// y = x W^T for W [N, K] stored [out, in] (a tied LM head is the embedding): dot products along K.
template <class W>
void linear_out_in(const float* xs, int64_t lda, int64_t M, int64_t K, const typename W::T* w, int64_t wn, int64_t N,
                   float* o) {
  at::parallel_for(0, (N + 63) / 64, grain(M * K * 64 / 4), [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * 64, width = std::min<int64_t>(64, N - n0);
      matmul_wt<W>(xs, lda, M, w + n0 * wn, wn, 1, width, K, o + n0, N);
    }
  });
}

}  // namespace

// y = x W^T into out [M, N] (contiguous) for x's rows (lda apart) and W as linear_rows takes it.
void linear_core(const float* xs, int64_t lda, int64_t M, int64_t K, const at::Tensor& weight,
                 const c10::optional<at::Tensor>& scale, at::IntArrayRef block, int64_t bf16_dot, float* o,
                 const Bf16Planes* planes) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "weight must be a CPU matrix, got ", weight.sizes());
  const int64_t N = weight.size(0);
  if (weight.scalar_type() == at::kByte) {  // MXFP4 [N, K / 2], its scale the e8m0 scales
    mxfp4::check_pair(weight, scale, "weight");
    TORCH_CHECK(2 * weight.size(1) == K, "the MXFP4 weight must be [N, ", K, " / 2], got ", weight.sizes());
    return mxfp4::linear(xs, lda, M, mxfp4::matrix_of(weight, *scale), N, o);
  }
  TORCH_CHECK(weight.size(1) == K, "weight must be [N, ", K, "], got ", weight.sizes());
  TORCH_CHECK(weight.stride(0) == 1 || weight.stride(1) == 1, "weight must be contiguous along one of its "
              "dimensions, got strides ", weight.strides());
  visit_weight_type(weight, "weight", [&](auto type) {
    using W = decltype(type);
    const WeightScales scales = weight_scales<W>(scale, weight, block);
    if (weight.stride(0) != 1 || N == 1) {
      if constexpr (W::kScaled) {
        TORCH_CHECK(false, "FP8 weights must be stored [in, out] (model_executor/weight_layout.py)");
      } else {
        linear_out_in<W>(xs, lda, M, K, weight_data<W>(weight), weight.stride(0), N, o);
      }
      return;
    }
    const bool planes_fit = std::is_same_v<W, Bf16Weight> && planes != nullptr && planes->rows() == K &&
                            planes->columns() <= N / 16 * 16;
    linear_in_out<W>(xs, lda, M, K, weight_data<W>(weight), weight.stride(1), N, scales, bf16_dot, o,
                     planes_fit ? planes : nullptr);
  });
}

// y = x W^T for x [M, K] float32 and W [N, K] float32, bf16 or FP8 (with its block scales), stored [in, out]
// (weight_layout's layout: each thread takes blocks of 32 output columns and runs every row of a panel through them
// while the block's weights stay in cache) or [out, in] (unscaled weights only); or MXFP4, uint8 [N, K / 2] with its
// e8m0 scales uint8 [N, ceil(K / 32)] as `scale` (mxfp4.h), read as the checkpoint stores it. MKL packs the whole
// weight for every call, which at a few rows keeps it far below the GEMM peak; it takes no 16- or 8-bit weights.
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                       at::IntArrayRef block, int64_t bf16_dot) {
  check_float(x, "x", 2);
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  linear_core(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), weight, scale, block, bf16_dot,
              out.data_ptr<float>());
  return out;
}

// linear_rows of a bf16 weight stored [in, out] through its 12-bit planes (bf16_planes.h), built for the call: the
// same values, bitwise (where they cannot be built, through the weight alone).
at::Tensor bf16_planes_linear(const at::Tensor& x, const at::Tensor& weight, int64_t bf16_dot) {
  check_float(x, "x", 2);
  const std::shared_ptr<const Bf16Planes> planes = Bf16Planes::of_weight(weight);
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  linear_core(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), weight, c10::nullopt, {}, bf16_dot,
              out.data_ptr<float>(), planes.get());
  return out;
}

// The bytes a weight's planes keep, or -1 where they are not built for it.
int64_t bf16_planes_bytes(const at::Tensor& weight) {
  const std::shared_ptr<const Bf16Planes> planes = Bf16Planes::of_weight(weight);
  return planes != nullptr ? planes->bytes() : -1;
}

}  // namespace sgl_cpu

TORCH_LIBRARY_FRAGMENT(sglang_lite_cpu, m) {
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? scale, int[] block, int bf16_dot) -> Tensor");
  m.def("bf16_planes_linear(Tensor x, Tensor weight, int bf16_dot) -> Tensor", &sgl_cpu::bf16_planes_linear);
  m.def("bf16_planes_bytes(Tensor weight) -> int", &sgl_cpu::bf16_planes_bytes);
  m.def("bf16_planes_pay() -> bool", []() { return sgl_cpu::Bf16Planes::kPays; });
  m.def("has_dpbf16() -> bool", []() { return sgl_cpu::kHaveDpbf16; });
  m.def("isa() -> str", []() { return std::string(sgl_cpu::kIsa); });
  m.def("bf16_dot_speed() -> float", []() { return sgl_cpu::bf16_dot_speed(); });
  m.def("bf16_dot_for(int mode, int rows) -> bool",
        [](int64_t mode, int64_t rows) { return sgl_cpu::bf16_dot_for(mode, rows); });
  m.def("set_batch_invariant(bool on) -> ()", [](bool on) { sgl_cpu::batch_invariant_flag().store(on); });
}

TORCH_LIBRARY_IMPL(sglang_lite_cpu, CPU, m) { m.impl("linear_rows", &sgl_cpu::linear_rows); }
