// The ops one source file calls from another (the fused decode layers compose them without the dispatcher).
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace sgl_cpu {

// pointer-level cores of the ops (outputs contiguous, written in place; the ops check their operands first)
struct Rows;
class Index;
struct GdnShapes;
class Bf16Planes;
void conv_update_core(const float* xs, int64_t x_row, int64_t batch, int64_t dim, const float* w, int64_t taps,
                      float* states, const Index& slots, int64_t s_slot, int64_t s_chan, bool silu, float* o);
void check_conv_update(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& conv_states,
                       const at::Tensor& state_indices);
void gdn_gating_core(const float* a, int64_t a_row, const float* b, int64_t b_row, int64_t tokens, int64_t heads,
                     const float* A_log, const float* dt_bias, float* g, float* beta);
void delta_rule_decode_core(const Rows& qs, const Rows& ks, const Rows& vs, const float* g, int64_t g_row,
                            const float* beta, int64_t beta_row, const GdnShapes& shapes, float* states,
                            const Index& slots, int64_t s_slot, int64_t s_head, float scale, bool l2norm, float* o);
void gemma_norm_core(const Rows& xs, const Rows* residual, int64_t rows, int64_t n, const float* w, float eps, float* y,
                     float* sum);
void gated_norm_core(const Rows& os, const Rows& zs, int64_t rows, int64_t n, const float* w, float eps, float* y);
// A request's cached tokens: token t of request row r lies at offset t % page_size of page table[r * row + t /
// page_size] of the KV pool.
struct TokenTable {
  const void* data;
  bool wide;
  int64_t row;
  int64_t page_size;
  TokenTable(const at::Tensor& page_table, int64_t page_size)
      : data(page_table.data_ptr()), wide(page_table.scalar_type() == at::kLong), row(page_table.stride(0)),
        page_size(page_size) {}
  int64_t operator()(int64_t r, int64_t t) const {
    const int64_t at = r * row + t / page_size;
    const int64_t page = wide ? static_cast<const int64_t*>(data)[at] : int64_t(static_cast<const int32_t*>(data)[at]);
    return page * page_size + t % page_size;
  }
};
int64_t check_decode_attention(int64_t batch, int64_t heads, int64_t hd, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& page_table,
                               const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, int64_t page_size);
void gather_keys_values(const at::Tensor& k_cache, const at::Tensor& v_cache, const TokenTable& table, int64_t row,
                        int64_t h, int64_t len, float* keys, float* values);
void softmax_in_place(float* s, int64_t n);
void decode_attention_core(const Rows& qs, int64_t batch, int64_t heads, int64_t hd, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const TokenTable& table, const Index& rows,
                           const Index& lens, int64_t longest, float scale, float* o);
void moe_route_core(const float* logits, int64_t row, int64_t tokens, int64_t experts, const float* shared_p,
                    int64_t shared_row, int64_t top_k, bool renormalize, int64_t shared_id, float* wp, int32_t* ip);
void linear_core(const float* xs, int64_t lda, int64_t M, int64_t K, const at::Tensor& weight,
                 const c10::optional<at::Tensor>& scale, at::IntArrayRef block, int64_t bf16_dot, float* o,
                 const Bf16Planes* planes = nullptr);
void check_experts(const at::Tensor& w13, const at::Tensor& w2, int64_t hidden);
void fused_moe_core(const float* x, int64_t x_row, int64_t tokens, int64_t hidden, const at::Tensor& w13,
                    const at::Tensor& w2, const c10::optional<at::Tensor>& w13_scale,
                    const c10::optional<at::Tensor>& w2_scale, at::IntArrayRef block, const Index& ids,
                    const float* weights, int64_t w_row, int64_t w_col, int64_t top_k, int64_t bf16_dot, float* out);

// the ops (decode_ops.cpp)
at::Tensor causal_conv1d_update(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& conv_states,
                                const at::Tensor& state_indices, bool silu);
std::tuple<at::Tensor, at::Tensor> gdn_gating(const at::Tensor& A_log, const at::Tensor& a, const at::Tensor& dt_bias,
                                              const at::Tensor& b);
at::Tensor gated_delta_rule_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                   const at::Tensor& beta, const at::Tensor& ssm_states,
                                   const at::Tensor& state_indices, double scale, bool use_qk_l2norm);
std::tuple<at::Tensor, at::Tensor> gemma_rmsnorm(const at::Tensor& x_in, const at::Tensor& weight, double eps,
                                                 const c10::optional<at::Tensor>& residual_in);
at::Tensor gated_rmsnorm(const at::Tensor& o_in, const at::Tensor& z_in, const at::Tensor& weight, double eps);
at::Tensor argmax_rows(const at::Tensor& logits);
void argmax_rows_into(const at::Tensor& logits, int64_t* out);  // [B] int64 at out
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, double scale, int64_t page_size);
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& router_logits, const c10::optional<at::Tensor>& shared,
                                             int64_t top_k, bool renormalize, int64_t shared_id);

// prefill_ops.cpp
std::vector<int64_t> request_bounds(const at::Tensor& cu_seqlens, int64_t batch, int64_t tokens);
void extend_attention_core(const Rows& qs, int64_t heads, int64_t hd, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const TokenTable& table, const Index& rows, const Index& prefix,
                           const int64_t* bounds, int64_t batch, float scale, float* o);
std::vector<int64_t> check_extend_attention(int64_t tokens, int64_t heads, int64_t hd, const at::Tensor& k_cache,
                                            const at::Tensor& v_cache, const at::Tensor& page_table,
                                            const at::Tensor& req_pool_indices, const at::Tensor& prefix_lens,
                                            const at::Tensor& extend_lens, int64_t page_size);
void delta_rule_prefill_core(const Rows& qs, const Rows& ks, const Rows& vs, const float* gp, int64_t g_row,
                             const float* bp, int64_t b_row, const GdnShapes& shapes, float* states, const Index& slots,
                             int64_t s_slot, int64_t s_head, const int64_t* bounds, int64_t batch, float sc,
                             bool use_qk_l2norm, float* o);
void conv_prefill_core(const float* xs, int64_t x_row, int64_t tokens, int64_t dim, const float* w, int64_t taps,
                       float* states, const Index& slots, int64_t s_slot, int64_t s_chan, int64_t s_tap,
                       const int64_t* bounds, int64_t batch, bool silu, float* o);
at::Tensor gated_delta_rule_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                    const at::Tensor& beta, const at::Tensor& ssm_states,
                                    const at::Tensor& state_indices, const at::Tensor& cu_seqlens, double scale,
                                    bool use_qk_l2norm);
at::Tensor causal_conv1d_prefill(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& conv_states,
                                 const at::Tensor& state_indices, const at::Tensor& cu_seqlens, bool silu);
// linear_ops.cpp, moe_ops.cpp
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                       at::IntArrayRef block, int64_t bf16_dot);

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids, const c10::optional<at::Tensor>& w13_scale,
                     const c10::optional<at::Tensor>& w2_scale, at::IntArrayRef block, int64_t bf16_dot);

}  // namespace sgl_cpu
