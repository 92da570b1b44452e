// Test support: a canonical dump re-laid as llama.cpp's graph shows it to an
// eval callback (docs/IMPORT.md): one safetensors file per forward call,
// ggml node names ("Qcur-0", the k-th repeat of a name as "NAME#k"), shapes as
// ggml's ne[] (fastest dimension first), q/k channels in the order GGUF's
// converter gives llama's permuted q/k rows, the K and V caches as attention
// reads them (n_kv cells padded past S with junk, V transposed), q.k without
// the softmax's scale, and optionally the last layer's feed-forward and the
// output for the last token only (llama.cpp's output-row pruning).
#pragma once
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "dumps/import/import_ops.h"
#include "dumps/formats/safetensors.h"

namespace llmdiff::testing {

struct LlamaCppExport {
  bool prune_output_rows = false;  // last layer's ffn, result_norm/output: last token only
  bool v_cont = false;             // V cache stored untransposed: v_cont-N (and a permuted view of another layout)
  bool flash_attn = false;         // __fattn__-N instead of kq / kq_soft_max; V read untransposed
  bool early_2025 = false;  // llm_build_kqv's names: k-N, v-N, kq_soft_max_ext-N, kqv_merged_cont-N, kqv_out-N = o_proj
  int64_t pad = 32;                // n_kv = S rounded up to this
};

namespace detail {

inline TensorData rows_last(const TensorData& t) {  // [T, X] -> [1, X]
  return import::slice(t, 0, t.shape[0] - 1, t.shape[0]);
}

// [.., S, ..] padded along `axis` to n with `junk`.
inline TensorData pad_axis(const TensorData& t, int axis, int64_t n, float junk) {
  Shape s = t.shape;
  const int64_t have = s[size_t(axis)];
  s[size_t(axis)] = n;
  TensorData o;
  o.shape = s;
  int64_t outer = 1, inner = 1;
  for (int k = 0; k < axis; ++k) outer *= t.shape[size_t(k)];
  for (size_t k = size_t(axis) + 1; k < t.shape.size(); ++k) inner *= t.shape[k];
  o.f.assign(size_t(numel(s)), junk);
  for (int64_t a = 0; a < outer; ++a)
    std::copy(t.f.begin() + a * have * inner, t.f.begin() + (a + 1) * have * inner, o.f.begin() + a * n * inner);
  return o;
}

}  // namespace detail

// Writes one file per step of `dump` to `dir`/step{N}.safetensors; returns the paths.
inline std::vector<std::string> write_llama_cpp_export(const TensorSource& dump, const ModelConfig& cfg,
                                                       const std::string& dir, const LlamaCppExport& o = {}) {
  using detail::pad_axis;
  const bool permuted_qk = cfg.model_type == "llama" || cfg.model_type == "mistral" || cfg.model_type == "mixtral";
  const int64_t Dh = cfg.head_dim, L = cfg.num_hidden_layers;
  std::vector<std::string> paths;
  int64_t past = 0;
  for (int step = 0; step < dump.num_steps(); ++step) {
    const std::string path = dir + "/step" + std::to_string(step) + ".safetensors";
    SafetensorsWriter w(path);
    std::map<std::string, int> seen;
    // A node: `t` laid out row-major, written under ggml's ne[] (its shape reversed).
    auto node = [&](const std::string& name, const TensorData& t) {
      const int k = seen[name]++;
      Shape ne(t.shape.rbegin(), t.shape.rend());
      w.add_f32(k == 0 ? name : name + "#" + std::to_string(k), ne, t.f.data());
    };
    auto get = [&](const std::string& site) { return dump.get("step" + std::to_string(step) + "." + site); };
    auto qk = [&](const TensorData& t) { return permuted_qk ? import::interleave(t, Dh) : t; };
    const int64_t T = int64_t(get("tokens").i.size()), S = past + T;
    const int64_t n_kv = (S + o.pad - 1) / o.pad * o.pad;
    node("inp_embd", get("embed"));
    for (int64_t l = 0; l < L; ++l) {
      const std::string n = std::to_string(l), p = "layers." + n + ".";
      const bool last = l == L - 1 && o.prune_output_rows;
      auto rows = [&](const TensorData& t) { return last ? detail::rows_last(t) : t; };
      node("norm-" + n, get(p + "attn_norm"));  // the RMSNorm before its weight: ignored by the mapping
      node("attn_norm-" + n, get(p + "attn_norm"));
      for (const char* x : {"q", "k"}) {
        const std::string X = x[0] == 'q' ? "Q" : "K";
        const TensorData proj = get(p + "attn." + x);  // [T, H*Dh]
        node(X + "cur-" + n, qk(proj));
        node(X + "cur-" + n + " (reshaped)", qk(proj));
        if (cfg.qk_norm) node(X + "cur_normed-" + n, get(p + "attn." + x + "_norm"));
        node(X + "cur-" + n, qk(import::permute(get(p + "attn." + x + "_rope"), {1, 0, 2})));  // [T, H, Dh]
      }
      node("Vcur-" + n, get(p + "attn.v"));
      node("Vcur-" + n, get(p + "attn.v"));  // the reshape, renamed by the later cb(Vcur)
      const TensorData kc = pad_axis(get(p + "attn.k_cache"), 1, n_kv, 1e3f);  // [Hkv, n_kv, Dh]
      if (o.early_2025) {
        const TensorData vc = pad_axis(get(p + "attn.v_cache"), 1, n_kv, -1e3f);
        node("k-" + n, qk(kc));
        node("kq-" + n, pad_axis(import::scale(get(p + "attn.scores"), 1.0 / cfg.attn_scaling()), 2, n_kv, 7.f));
        node("kq_soft_max_ext-" + n, pad_axis(get(p + "attn.probs"), 2, n_kv, 0.f));
        node("v-" + n, import::permute(vc, {0, 2, 1}));  // [Hkv, Dh, n_kv]: V stored transposed
        node("kqv_merged_cont-" + n, get(p + "attn.ctx"));
        node("kqv_out-" + n, get(p + "attn.out"));
      } else {
      node("cache_k_l" + n + " (view)", kc);
      node("cache_k_l" + n + " (view)", kc);
      node("cache_k_l" + n + " (view) (permuted)", qk(kc));
      const TensorData vc = pad_axis(get(p + "attn.v_cache"), 1, n_kv, -1e3f);  // [Hkv, n_kv, Dh]
      if (o.flash_attn) {
        node("cache_v_l" + n + " (view)", vc);
        node("cache_v_l" + n + " (view) (permuted)", vc);
        node("__fattn__-" + n, get(p + "attn.ctx"));  // [T, Hq, Dh] as ne [Dh, Hq, T]: the same values
        node("kqv_out-" + n, get(p + "attn.ctx"));
      } else if (o.v_cont) {
        node("cache_v_l" + n + " (view) (permuted)", vc);
        node("v_cont-" + n, import::permute(vc, {0, 2, 1}));
      } else {
        node("cache_v_l" + n + " (view) (permuted)", import::permute(vc, {0, 2, 1}));  // [Hkv, Dh, n_kv]
      }
      if (!o.flash_attn) {
        node("kq-" + n, pad_axis(import::scale(get(p + "attn.scores"), 1.0 / cfg.attn_scaling()), 2, n_kv, 7.f));
        node("kq_soft_max-" + n, pad_axis(get(p + "attn.probs"), 2, n_kv, 0.f));
        node("kqv_out-" + n, get(p + "attn.ctx"));
      }
      if (cfg.model_type == "llama") node("attn_out-" + n, get(p + "attn.out"));
      }
      node("ffn_inp-" + n, rows(get(p + "attn_residual")));
      node("norm-" + n, rows(get(p + "mlp_norm")));
      node("ffn_norm-" + n, rows(get(p + "mlp_norm")));
      node("ffn_gate-" + n, rows(get(p + "mlp.gate")));
      node("ffn_up-" + n, rows(get(p + "mlp.up")));
      node("ffn_swiglu-" + n, rows(get(p + "mlp.act")));
      node("ffn_out-" + n, rows(get(p + "mlp.down")));
      node("l_out-" + n, rows(get(p + "out")));
    }
    const bool prune = o.prune_output_rows;
    node("norm", prune ? detail::rows_last(get("final_norm")) : get("final_norm"));
    node("result_norm", prune ? detail::rows_last(get("final_norm")) : get("final_norm"));
    node("result_output", prune ? detail::rows_last(get("logits")) : get("logits"));
    w.finish();
    paths.push_back(path);
    past = S;
  }
  return paths;
}

// Each step's tokens as `import --tokens` takes them: "1,2,3;4;5".
inline std::string tokens_argument(const TensorSource& dump) {
  std::string out;
  for (const auto& step : dump.step_tokens()) {
    if (!out.empty()) out += ";";
    for (size_t k = 0; k < step.size(); ++k) out += (k ? "," : "") + std::to_string(step[k]);
  }
  return out;
}

}  // namespace llmdiff::testing
