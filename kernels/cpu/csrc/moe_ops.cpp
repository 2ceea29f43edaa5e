// The fused MoE on the CPU: float32 tokens through experts whose weights are float32, bf16 or block-FP8 (gemm.h
// widens each in registers), for decode steps and, in chunks, prefills.
//
// sum over each token's selected experts of weight * down(silu(gate(x)) * up(x)). Pairs (token, slot) are grouped
// by expert and run through both projections (below, by the weights' layout), one output row per pair; a last pass
// sums each token's k rows in slot order.
#include "common.h"
#include "gemm.h"
#include "mxfp4.h"
#include "ops.h"

#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

namespace sgl_cpu {

namespace {

using OptTensor = c10::optional<at::Tensor>;

constexpr int64_t kMoeChunk = 8;
constexpr int64_t kMklRows = 128;  // rows of one float32 expert from which MKL's GEMM runs it

// The (token, slot) pairs grouped by expert: pair order[i] for i in [starts[e], starts[e + 1]) goes to expert e.
struct Routing {
  std::vector<int64_t> starts, order;
  int64_t top_k;
  int64_t rows(int64_t e) const { return starts[e + 1] - starts[e]; }
};

// One projection of every expert, [E, N, K] stored [in, out] per expert (row k of expert e's W^T contiguous).
template <class W>
struct Experts {
  const typename W::T* data;
  int64_t expert_stride, row_stride;
  WeightScales first;        // expert 0's block scales (unscaled: none)
  int64_t scale_stride = 0;  // between experts' scales
  const typename W::T* of(int64_t e) const { return data + e * expert_stride; }
  WeightScales scales(int64_t e) const {
    WeightScales s = first;
    if (s.data != nullptr) s.data += e * scale_stride;
    return s;
  }
};

template <class W>
Experts<W> experts_of(const at::Tensor& w, const c10::optional<at::Tensor>& scale, at::IntArrayRef block) {
  const WeightScales first = weight_scales<W>(scale, w, block, 0);
  return Experts<W>{weight_data<W>(w), w.stride(0), w.stride(2), first, scale.has_value() ? scale->stride(0) : 0};
}

// Both projections for unscaled weights in any other layout: each work item runs up to kMoeChunk rows of one expert
// through both (its weights then come from cache).
template <class W>
void experts_by_row_chunks(const float* xs, int64_t x_row, const at::Tensor& w13, const at::Tensor& w2,
                           const Routing& routing, int64_t hidden, int64_t inter, float* rows) {
  const int64_t experts = static_cast<int64_t>(routing.starts.size()) - 1;
  const typename W::T *w13p = weight_data<W>(w13), *w2p = weight_data<W>(w2);
  std::vector<std::pair<int64_t, int64_t>> items;  // (expert, first position in order)
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t i = routing.starts[e]; i < routing.starts[e + 1]; i += kMoeChunk) items.emplace_back(e, i);
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> a(kMoeChunk * hidden), gate_up(kMoeChunk * 2 * inter), out(kMoeChunk * hidden);
    for (int64_t item = begin; item < end; ++item) {
      const auto [e, first] = items[item];
      const int64_t count = std::min(kMoeChunk, routing.starts[e + 1] - first);
      for (int64_t r = 0; r < count; ++r) {
        const float* src = xs + (routing.order[first + r] / routing.top_k) * x_row;
        std::copy(src, src + hidden, a.data() + r * hidden);
      }
      matmul_wt<W>(a.data(), hidden, count, w13p + e * w13.stride(0), w13.stride(1), w13.stride(2), 2 * inter,
                   hidden, gate_up.data(), 2 * inter);
      for (int64_t r = 0; r < count; ++r) silu_and_mul(gate_up.data() + r * 2 * inter, inter);
      matmul_wt<W>(gate_up.data(), 2 * inter, count, w2p + e * w2.stride(0), w2.stride(1), w2.stride(2), hidden,
                   inter, out.data(), hidden);
      for (int64_t r = 0; r < count; ++r) {
        std::copy(out.data() + r * hidden, out.data() + (r + 1) * hidden, rows + routing.order[first + r] * hidden);
      }
    }
  });
}

// Float32 experts of many rows (a prefill's) go to MKL's GEMM, one expert at a time (faster at the mid shape than
// every expert in the work items, and no slower at H 512); not when batch invariant (gemm.h).
void experts_through_mkl(const std::vector<int64_t>& big, const Routing& routing, const float* in, int64_t lda,
                         int64_t depth, const Experts<F32Weight>& w, int64_t width, float* out) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  for (int64_t e : big) {
    const int64_t first = routing.starts[e], count = routing.rows(e);
    at::Tensor a = at::from_blob(const_cast<float*>(in + first * lda), {count, depth}, {lda, 1}, options);
    at::Tensor b = at::from_blob(const_cast<float*>(w.of(e)), {depth, width}, {w.row_stride, 1}, options);
    at::Tensor c = at::from_blob(out + first * width, {count, width}, {width, 1}, options);
    at::mm_out(c, a, b);
  }
}

// c[n0:n1] = a W[:, n0:n1] for one row a of a bf16 weight through vdpbf16ps (`pairs`: a as bf16 pairs), reading
// whole weight rows in order (gemm.h's one_row_long_run_dp; each column's sum in the order of the column-block
// kernels, so the same values); false, computing nothing, for other weights and paths (widened, such runs were no
// faster on AVX2) or columns the long runs do not take.
template <class W>
bool one_row_expert_run(const uint32_t* pairs, int64_t depth, const typename W::T* wp, int64_t ldw, int64_t n0,
                        int64_t n1, int64_t bf16_dot, float* c) {
  if constexpr (std::is_same_v<W, Bf16Weight> && kHaveDpbf16) {
    if (pairs == nullptr || !bf16_dot_for(bf16_dot, 1) || (n1 - n0) % 128 != 0) return false;
    one_row_long_run_dp(pairs, (depth + 1) / 2, wp + n0, ldw, depth, n1 - n0, c + n0);
    return true;
  }
  return false;
}

// Asks for columns [n0, n1) of expert e's `depth` weight rows into L2 (locality 2: x86's prefetcht1), a line at a time.
template <class W>
void prefetch_expert_block(const Experts<W>& w, int64_t e, int64_t n0, int64_t n1, int64_t depth) {
  constexpr int64_t kSize = sizeof(typename W::T);
  const char* base = reinterpret_cast<const char*>(w.of(e) + n0);
  for (int64_t k = 0; k < depth; ++k) {
    for (int64_t b = 0; b < (n1 - n0) * kSize; b += 64) __builtin_prefetch(base + k * w.row_stride * kSize + b, 0, 2);
  }
}

// One projection of the experts in `hit` as work items (expert, column block); the last block of each expert takes
// the columns left over. Experts of one or two rows (decode at small batches) read each weight once: 128-column
// blocks read long runs of each weight row (32-column ones ran the batch-1 MoE slower), and through vdpbf16ps a
// thread's blocks of a one-row expert are read together, each weight row whole (from memory ~10% faster for the
// batch-1 MoE of 32 experts, H 512, I 128: the thread's bytes are one stream, not two passes over halves of the
// rows); more rows reuse each block's weights from cache, and a thread asks for its next item's block while it runs
// one (a prefill's experts come from memory or L3: the 128-token MoE of 32 experts, H 512, I 128 ran 7% faster on
// AVX2); those items are taken as the threads free up (common.h's parallel_items: their costs differ with the
// experts' rows, and fixed halves left one thread waiting on the other). Widened one- or two-row experts, at least
// one for each thread, skip the blocks: each thread takes whole experts and reads their weight rows whole, one after
// another (gemm.h's rows_add_weight_rows: one stream of the expert's bytes in address order, from memory 1.8-2.1x
// the blocks' speed, the same values); experts of more rows in the same call (8 tokens, top 4 of 32: ~2-3 of the
// ~20 experts hit) then take the blocks. Before, one such expert sent every expert to the blocks (the MoE of 8
// tokens, 32 experts top 4, bf16, cold: AVX2 0.59 -> 0.44 ms, AVX-512 0.35 -> 0.33 ms a layer). `pairs`: the rows
// as bf16 pairs, for the experts that take vdpbf16ps (bf16 weights, gemm.h's bf16_dot_for), else null.
template <class W>
void project_experts(const std::vector<int64_t>& hit, const Routing& routing, const float* in, int64_t lda,
                     int64_t depth, const Experts<W>& w, int64_t width, float* out, const Bf16Pairs* pairs,
                     int64_t bf16_dot) {
  if constexpr (!W::kScaled) {
    if (pairs == nullptr && width % 16 == 0 && width <= kRowRunColumns) {
      std::vector<int64_t> few, rest;  // experts of one or two rows, and the others
      for (int64_t e : hit) (routing.rows(e) <= 2 ? few : rest).push_back(e);
      if (static_cast<int64_t>(few.size()) >= at::get_num_threads()) {
        at::parallel_for(0, static_cast<int64_t>(few.size()), 1, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const int64_t e = few[i], first = routing.starts[e];
            float* c = out + first * width;
            std::fill(c, c + routing.rows(e) * width, 0.0f);
            rows_add_weight_rows<W>(in + first * lda, lda, routing.rows(e), w.of(e), w.row_stride, depth, width, c,
                                    width);
          }
        });
        if (!rest.empty()) project_experts<W>(rest, routing, in, lda, depth, w, width, out, pairs, bf16_dot);
        return;
      }
    }
  }
  int64_t most_rows = 0;
  for (int64_t e : hit) most_rows = std::max(most_rows, routing.rows(e));
  const bool wide = most_rows <= 2;
  const int64_t hits = static_cast<int64_t>(hit.size());
  // one-row experts through vdpbf16ps: 256-column blocks (512 B runs of each weight row) where that leaves work
  // for every thread several times over
  const bool longer = pairs != nullptr && wide && hits * (width / 256) >= 4 * at::get_num_threads();
  const int64_t block = longer ? 256 : (wide ? 128 : 64), blocks = std::max<int64_t>(1, width / block);
  const auto block_end = [&](int64_t j) { return j + 1 == blocks ? width : (j + 1) * block; };  // the last: the rest
  // items [begin, end) of one thread; `next`: the item it runs after them (its block asked for early), or -1
  const auto body = [&](int64_t begin, int64_t end, int64_t next) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = hit[item / blocks], j = item % blocks, first = routing.starts[e], count = routing.rows(e);
      const int64_t n0 = j * block, n1 = block_end(j);
      const float* a = in + first * lda;
      float* c = out + first * width;
      const WeightScales scales = w.scales(e);
      if (next >= 0) {
        const int64_t next_j = next % blocks;
        prefetch_expert_block(w, hit[next / blocks], next_j * block, block_end(next_j), depth);
      }
      // this thread's later blocks of a one-row expert join this one: one pass over whole weight rows
      const int64_t last_j = std::min(end, item - j + blocks) - 1 - (item - j);  // this thread's last block of e
      if (wide && count == 1 && last_j > j) {
        if (one_row_expert_run<W>(pairs == nullptr ? nullptr : pairs->row(first), depth, w.of(e), w.row_stride, n0,
                                  block_end(last_j), bf16_dot, c)) {
          item += last_j - j;
          continue;
        }
      }
      if constexpr (std::is_same_v<W, Bf16Weight> && kHaveDpbf16) {
        const bool dot = pairs != nullptr && bf16_dot_for(bf16_dot, count);
        if (dot && count == 1 && n1 - n0 == 256) {
          one_row_times_columns_dp<8>(pairs->row(first), pairs->pairs, w.of(e) + n0, w.row_stride, depth, c + n0);
          continue;
        }
        if (dot && count == 1 && n1 - n0 == 128) {
          one_row_times_columns_dp<4>(pairs->row(first), pairs->pairs, w.of(e) + n0, w.row_stride, depth, c + n0);
          continue;
        }
        if (dot) {
          rows_times_weight_columns_dp(*pairs, first, a, lda, count, w.of(e), w.row_stride, depth, n0, n1, c, width);
          continue;
        }
      }
      if (wide && count == 1 && n1 - n0 == 128) {  // in passes of kWideVectors (two on AVX2: measured faster)
        for (int64_t v = 0; v < 8; v += kWideVectors) {
          one_row_times_columns<W, kWideVectors>(a, w.of(e) + n0 + 16 * v, w.row_stride, depth, c + n0 + 16 * v,
                                                 scales.columns(n0));
        }
      } else if (wide) {
        rows_times_weight_columns<W, kWideVectors>(a, lda, count, w.of(e), w.row_stride, depth, n0, n1, c, width,
                                                   scales);
      } else {
        rows_times_weight_columns<W, kWideVectors / 2>(a, lda, count, w.of(e), w.row_stride, depth, n0, n1, c, width,
                                                       scales);
      }
    }
  };
  if (!wide) {  // items of unequal cost (the experts' rows), taken as the threads free up
    parallel_items(hits * blocks, 1, [&](int64_t item, int64_t next) { body(item, item + 1, next); });
    return;
  }
  at::parallel_for(0, hits * blocks, 1, [&](int64_t begin, int64_t end) { body(begin, end, -1); });
}

// Both projections of every expert hit, for weights stored [in, out] (w13 [H, 2I] and w2 [I, H] row-major per
// expert): the pairs' token rows are copied in expert order, then each work item runs one expert's rows through one
// block of output columns (register-blocked, the block's weights in cache), so the threads share every expert even
// when a few tokens hit a few experts (decode at batch 1: 5 experts on 2 threads).
template <class W>
void experts_input_major(const float* xs, int64_t x_row, const Experts<W>& w13, const Experts<W>& w2,
                         const Routing& routing, int64_t hidden, int64_t inter, int64_t bf16_dot, float* rows) {
  const int64_t pairs = static_cast<int64_t>(routing.order.size());
  const int64_t experts = static_cast<int64_t>(routing.starts.size()) - 1;
  thread_local std::vector<float> gathered_buffer, gate_up_buffer, out_buffer;  // the calling thread's, reused
  float* gathered = mxfp4::aligned(gathered_buffer, pairs * hidden);
  float* gate_up = mxfp4::aligned(gate_up_buffer, pairs * 2 * inter);
  float* expert_out = mxfp4::aligned(out_buffer, pairs * hidden);
  at::parallel_for(0, pairs, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = xs + (routing.order[i] / routing.top_k) * x_row;
      std::copy(src, src + hidden, gathered + i * hidden);
    }
  });
  std::vector<int64_t> hit, big;
  for (int64_t e = 0; e < experts; ++e) {
    const bool mkl = std::is_same_v<W, F32Weight> && routing.rows(e) >= kMklRows && !batch_invariant();
    if (mkl) {
      big.push_back(e);
    } else if (routing.rows(e) > 0) {
      hit.push_back(e);
    }
  }
  Bf16Pairs in_pairs, mid_pairs;
  bool dp = false;  // whether any expert takes vdpbf16ps
  if constexpr (std::is_same_v<W, Bf16Weight>) {
    for (int64_t e : hit) dp = dp || bf16_dot_for(bf16_dot, routing.rows(e));
  }
  if (dp) to_bf16_pairs(gathered, hidden, pairs, hidden, in_pairs);
  if constexpr (std::is_same_v<W, F32Weight>) {
    experts_through_mkl(big, routing, gathered, hidden, hidden, w13, 2 * inter, gate_up);
  }
  project_experts<W>(hit, routing, gathered, hidden, hidden, w13, 2 * inter, gate_up,
                     dp ? &in_pairs : nullptr, bf16_dot);
  at::parallel_for(0, pairs, grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) silu_and_mul(gate_up + i * 2 * inter, inter);
  });
  if (dp) to_bf16_pairs(gate_up, 2 * inter, pairs, inter, mid_pairs);
  if constexpr (std::is_same_v<W, F32Weight>) {  // the gate half
    experts_through_mkl(big, routing, gate_up, 2 * inter, inter, w2, hidden, expert_out);
  }
  project_experts<W>(hit, routing, gate_up, 2 * inter, inter, w2, hidden, expert_out,
                     dp ? &mid_pairs : nullptr, bf16_dot);
  at::parallel_for(0, pairs, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::copy(expert_out + i * hidden, expert_out + (i + 1) * hidden,
                rows + routing.order[i] * hidden);
    }
  });
}

// One projection of the MXFP4 experts in `hit` ([E, width, depth / 2] with their scales) as work items (expert,
// column block), each expert's rows (rearranged, mxfp4.h) through its block: one or two rows in 128-column blocks
// (long runs of weight rows read once), more in blocks of four of mxfp4.h's widened blocks.
void project_mxfp4_experts(const std::vector<int64_t>& hit, const Routing& routing, const float* in, int64_t lda,
                           const at::Tensor& w, const at::Tensor& scales, int64_t width, float* out) {
  int64_t most_rows = 0;
  for (int64_t e : hit) most_rows = std::max(most_rows, routing.rows(e));
  const int64_t block = most_rows <= 2 ? 128 : 4 * mxfp4::kBlockColumns;
  const int64_t blocks = (width + block - 1) / block, hits = static_cast<int64_t>(hit.size());
  const auto item = [&](int64_t i) {
    const int64_t e = hit[i / blocks], n0 = (i % blocks) * block, first = routing.starts[e];
    mxfp4::rows_times_columns(in + first * lda, lda, routing.rows(e), mxfp4::matrix_of(w, scales, e), n0,
                              std::min(width, n0 + block), out + first * width, width);
  };
  if (most_rows > 2) {  // items of unequal cost, taken as the threads free up (as project_experts)
    parallel_items(hits * blocks, 1, [&](int64_t i, int64_t) { item(i); });
    return;
  }
  at::parallel_for(0, hits * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) item(i);
  });
}

// Both projections of every expert hit, for MXFP4 experts (w13 [E, 2I, H / 2], w2 [E, H, I / 2] and their e8m0
// scales, as the checkpoint stores them): the pairs' token rows gathered in expert order (rearranged for the
// weights), each expert's rows through its blocks of output columns, silu(gate) * up rearranged, the same for w2.
void experts_mxfp4(const float* xs, int64_t x_row, const at::Tensor& w13, const at::Tensor& w13_s,
                   const at::Tensor& w2, const at::Tensor& w2_s, const Routing& routing, int64_t hidden,
                   int64_t inter, float* rows) {
  const int64_t pairs = static_cast<int64_t>(routing.order.size());
  const int64_t experts = static_cast<int64_t>(routing.starts.size()) - 1;
  const int64_t h_pad = (hidden + mxfp4::kGroup - 1) / mxfp4::kGroup * mxfp4::kGroup;
  const int64_t i_pad = (inter + mxfp4::kGroup - 1) / mxfp4::kGroup * mxfp4::kGroup;
  // the calling thread's scratch, reused from call to call (allocated afresh, with their page faults, the four took
  // 2-7 us of a ~310 us big-shape decode layer)
  thread_local std::vector<float> gate_up_buffer, out_buffer, gathered_buffer, mid_buffer;
  float* gate_up = mxfp4::aligned(gate_up_buffer, pairs * 2 * inter);
  float* expert_out = mxfp4::aligned(out_buffer, pairs * hidden);
  float* gathered = mxfp4::aligned(gathered_buffer, pairs * h_pad);
  float* mid = mxfp4::aligned(mid_buffer, pairs * i_pad);
  at::parallel_for(0, pairs, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = xs + (routing.order[i] / routing.top_k) * x_row;
      mxfp4::rearrange_row(src, hidden, gathered + i * h_pad);
    }
  });
  std::vector<int64_t> hit;
  for (int64_t e = 0; e < experts; ++e) {
    if (routing.rows(e) > 0) hit.push_back(e);
  }
  project_mxfp4_experts(hit, routing, gathered, h_pad, w13, w13_s, 2 * inter, gate_up);
  at::parallel_for(0, pairs, grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      silu_and_mul(gate_up + i * 2 * inter, inter);
      mxfp4::rearrange_row(gate_up + i * 2 * inter, inter, mid + i * i_pad);
    }
  });
  project_mxfp4_experts(hit, routing, mid, i_pad, w2, w2_s, hidden, expert_out);
  at::parallel_for(0, pairs, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::copy(expert_out + i * hidden, expert_out + (i + 1) * hidden,
                rows + routing.order[i] * hidden);
    }
  });
}

Routing group_by_expert(const Index& ids, int64_t pairs, int64_t top_k, int64_t experts) {
  check_slots(ids, pairs, experts, "topk_ids");
  Routing routing{std::vector<int64_t>(experts + 1, 0), std::vector<int64_t>(pairs), top_k};
  for (int64_t p = 0; p < pairs; ++p) ++routing.starts[ids[p] + 1];
  for (int64_t e = 0; e < experts; ++e) routing.starts[e + 1] += routing.starts[e];
  std::vector<int64_t> fill(routing.starts.begin(), routing.starts.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) routing.order[fill[ids[p]]++] = p;
  return routing;
}

// out[t] = sum over slots of weight[t, slot] * rows[t * top_k + slot], in slot order.
void weighted_sum(const float* rows, int64_t tokens, const float* wts, int64_t w_row, int64_t w_col, int64_t top_k,
                  int64_t hidden, float* res) {
  at::parallel_for(0, tokens, grain(hidden * top_k), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = res + t * hidden;
      const float w0 = wts[t * w_row];
      const float* r0 = rows + t * top_k * hidden;
#pragma omp simd
      for (int64_t j = 0; j < hidden; ++j) o[j] = r0[j] * w0;
      for (int64_t slot = 1; slot < top_k; ++slot) {
        const float w = wts[t * w_row + slot * w_col];
        const float* r = rows + (t * top_k + slot) * hidden;
#pragma omp simd
        for (int64_t j = 0; j < hidden; ++j) o[j] += r[j] * w;
      }
    }
  });
}

}  // namespace

void check_experts(const at::Tensor& w13, const at::Tensor& w2, int64_t hidden) {
  TORCH_CHECK(w13.device().is_cpu() && w13.dim() == 3 && w2.device().is_cpu() && w2.dim() == 3 &&
                  w2.scalar_type() == w13.scalar_type(),
              "w13 [E, 2I, H] and w2 [E, H, I] must be CPU tensors of one dtype, got ", w13.scalar_type(), " ",
              w13.sizes(), " and ", w2.scalar_type(), " ", w2.sizes());
  const int64_t packing = w13.scalar_type() == at::kByte ? 2 : 1;  // MXFP4: two weights a byte
  const int64_t inter = packing * w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * inter && packing * w13.size(2) == hidden && w2.size(0) == w13.size(0) &&
                  w2.size(1) == hidden,
              "w13 [E, 2I, H] and w2 [E, H, I] do not match x [T, ", hidden, "]: w13 ", w13.sizes(), ", w2 ",
              w2.sizes(), packing == 2 ? " (MXFP4: the last dimension halved)" : "");
}

// The fused MoE into out [T, H] (contiguous) of x's rows (x_row apart), each token's top_k (expert id, weight)
// pairs from ids [T * top_k] and weights (w_row, w_col apart); experts as check_experts accepts them.
void fused_moe_core(const float* x, int64_t x_row, int64_t tokens, int64_t hidden, const at::Tensor& w13,
                    const at::Tensor& w2, const OptTensor& w13_scale, const OptTensor& w2_scale, at::IntArrayRef block,
                    const Index& ids, const float* weights, int64_t w_row, int64_t w_col, int64_t top_k,
                    int64_t bf16_dot, float* out) {
  const int64_t experts = w13.size(0), inter = w13.size(1) / 2;
  const Routing routing = group_by_expert(ids, tokens * top_k, top_k, experts);
  // each pair's expert output, at token * top_k + slot (every row written before it is read: not zeroed)
  thread_local std::vector<float> pair_buffer;  // the calling thread's, reused
  float* const pair_rows = mxfp4::aligned(pair_buffer, tokens * top_k * hidden);
  if (w13.scalar_type() == at::kByte) {
    mxfp4::check_pair(w13, w13_scale, "w13");
    mxfp4::check_pair(w2, w2_scale, "w2");
    experts_mxfp4(x, x_row, w13, *w13_scale, w2, *w2_scale, routing, hidden, inter, pair_rows);
    return weighted_sum(pair_rows, tokens, weights, w_row, w_col, top_k, hidden, out);
  }
  const bool input_major = w13.stride(1) == 1 && w2.stride(1) == 1;
  visit_weight_type(w13, "w13", [&](auto type) {
    using W = decltype(type);
    if (input_major) {
      experts_input_major<W>(x, x_row, experts_of<W>(w13, w13_scale, block), experts_of<W>(w2, w2_scale, block),
                             routing, hidden, inter, bf16_dot, pair_rows);
    } else if constexpr (W::kScaled) {
      TORCH_CHECK(false, "FP8 experts must be stored [in, out] (model_executor/weight_layout.py)");
    } else {
      experts_by_row_chunks<W>(x, x_row, w13, w2, routing, hidden, inter, pair_rows);
    }
  });
  weighted_sum(pair_rows, tokens, weights, w_row, w_col, top_k, hidden, out);
}

// x [T, H] float32; w13 [E, 2I, H] and w2 [E, H, I] float32, bf16 or FP8 (with w13_scale, w2_scale for `block`),
// in the same dtype, or MXFP4 (uint8 [E, 2I, H / 2] and [E, H, I / 2], their e8m0 scales uint8 [E, 2I, ceil(H / 32)]
// and [E, H, ceil(I / 32)] as w13_scale and w2_scale); topk_weights [T, k] float32, topk_ids [T, k]. Returns [T, H].
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids, const OptTensor& w13_scale, const OptTensor& w2_scale,
                     at::IntArrayRef block, int64_t bf16_dot) {
  check_float(x, "x", 2);
  check_float(topk_weights, "topk_weights", 2);
  const int64_t tokens = x.size(0), hidden = x.size(1);
  check_experts(w13, w2, hidden);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_weights.sizes() == topk_ids.sizes(),
              "topk_ids and topk_weights must both be [", tokens, ", k], got ", topk_ids.sizes(), " and ",
              topk_weights.sizes());
  TORCH_CHECK(topk_ids.is_contiguous(), "topk_ids must be contiguous");
  at::Tensor result = at::empty({tokens, hidden}, x.options());
  fused_moe_core(x.data_ptr<float>(), x.stride(0), tokens, hidden, w13, w2, w13_scale, w2_scale, block,
                 Index(topk_ids.view({-1}), "topk_ids"), topk_weights.data_ptr<float>(), topk_weights.stride(0),
                 topk_weights.stride(1), topk_ids.size(1), bf16_dot, result.data_ptr<float>());
  return result;
}

}  // namespace sgl_cpu

TORCH_LIBRARY_FRAGMENT(sglang_lite_cpu, m) {
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, Tensor? w13_scale, "
        "Tensor? w2_scale, int[] block, int bf16_dot) -> Tensor");
}

TORCH_LIBRARY_IMPL(sglang_lite_cpu, CPU, m) { m.impl("fused_moe", &sgl_cpu::fused_moe); }
