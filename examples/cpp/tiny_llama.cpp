// A tiny Llama engine in plain C++17, instrumented with the C writer
// writers/c/llmdump.h (docs/COOKBOOK.md). Reads an HF Llama checkpoint
// (config.json + model.safetensors, float32 or bfloat16), runs a prompt and
// greedy decode steps with a KV cache, and writes every intermediate under
// llm-dump/1's canonical names:
//
//   c++ -std=c++17 -O2 -I writers/c examples/cpp/tiny_llama.cpp -o tiny_llama
//   ./tiny_llama tests/golden/llama-gqa --tokens 1,2,3,4,5 --decode 3 --out cpp.safetensors
//   build/llmdiff bisect --model tests/golden/llama-gqa cpp.safetensors
//
// --bug rope-interleaved rotates adjacent pairs instead of HF's halves.
#define LLMDUMP_IMPLEMENTATION
#include "llmdump.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

using Vec = std::vector<float>;

[[noreturn]] static void die(const std::string& msg) {
  std::fprintf(stderr, "tiny_llama: %s\n", msg.c_str());
  std::exit(2);
}

static std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) die("cannot open " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// name -> (shape, float32 values): F32 and BF16 tensors of a safetensors file.
struct Tensor {
  std::vector<int64_t> shape;
  Vec v;
};
static std::map<std::string, Tensor> load_safetensors(const std::string& path) {
  const std::string raw = read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  const nlohmann::json header = nlohmann::json::parse(raw.substr(8, n));
  std::map<std::string, Tensor> out;
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") continue;
    Tensor t;
    t.shape = e["shape"].get<std::vector<int64_t>>();
    const size_t a = e["data_offsets"][0], b = e["data_offsets"][1];
    const char* p = raw.data() + 8 + n + a;
    const std::string dtype = e["dtype"];
    if (dtype == "F32") {
      t.v.resize((b - a) / 4);
      std::memcpy(t.v.data(), p, b - a);
    } else if (dtype == "BF16") {
      t.v.resize((b - a) / 2);
      for (size_t i = 0; i < t.v.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        t.v[i] = llmdump_bf16_to_f32(h);
      }
    } else {
      die(path + ": tensor " + name + ": dtype " + dtype + " not supported");
    }
    out[name] = std::move(t);
  }
  return out;
}

// y[T, out] = x[T, in] · W[out, in]ᵀ
static Vec matmul(const Vec& x, const Tensor& w, int64_t T) {
  const int64_t out = w.shape[0], in = w.shape[1];
  Vec y(size_t(T * out));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o) {
      float s = 0;
      for (int64_t i = 0; i < in; ++i) s += x[size_t(t * in + i)] * w.v[size_t(o * in + i)];
      y[size_t(t * out + o)] = s;
    }
  return y;
}

static Vec rmsnorm(const Vec& x, const Tensor& w, int64_t T, float eps) {
  const int64_t D = w.shape[0];
  Vec y(x.size());
  for (int64_t t = 0; t < T; ++t) {
    float ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += x[size_t(t * D + i)] * x[size_t(t * D + i)];
    const float r = 1.0f / std::sqrt(ss / float(D) + eps);
    for (int64_t i = 0; i < D; ++i) y[size_t(t * D + i)] = x[size_t(t * D + i)] * r * w.v[size_t(i)];
  }
  return y;
}

struct Engine {
  nlohmann::json cfg;
  std::string config_text;
  int64_t D, F, L, Hq, Hkv, Dh, V;
  float eps, theta;
  bool rope_bug = false;
  std::map<std::string, Tensor> w;
  std::vector<Vec> k_cache, v_cache;  // per layer [Hkv, S, Dh], grown per call
  int64_t S = 0;

  explicit Engine(const std::string& dir) {
    config_text = read_file(dir + "/config.json");
    cfg = nlohmann::json::parse(config_text);
    D = cfg["hidden_size"];
    F = cfg["intermediate_size"];
    L = cfg["num_hidden_layers"];
    Hq = cfg["num_attention_heads"];
    Hkv = cfg.value("num_key_value_heads", Hq);
    Dh = cfg.contains("head_dim") && !cfg["head_dim"].is_null() ? cfg["head_dim"].get<int64_t>() : D / Hq;
    V = cfg["vocab_size"];
    eps = cfg.value("rms_norm_eps", 1e-6f);
    theta = cfg.value("rope_theta", 10000.0f);
    w = load_safetensors(dir + "/model.safetensors");
    k_cache.assign(size_t(L), Vec());
    v_cache.assign(size_t(L), Vec());
  }
  const Tensor& W(const std::string& name) {
    auto it = w.find(name);
    if (it == w.end()) die("model.safetensors: missing tensor " + name);
    return it->second;
  }

  // [T, H*Dh] rows -> RoPE'd head-major [H, T, Dh] for positions P..P+T-1.
  Vec rope(const Vec& x, int64_t T, int64_t H, int64_t P) {
    Vec out(size_t(H * T * Dh));
    const int64_t half = Dh / 2;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const float* src = &x[size_t(t * H * Dh + h * Dh)];
        float* dst = &out[size_t((h * T + t) * Dh)];
        for (int64_t i = 0; i < half; ++i) {
          const float inv_freq = 1.0f / std::pow(theta, float(2 * i) / float(Dh));
          const float f = float(P + t) * inv_freq, c = std::cos(f), s = std::sin(f);
          const int64_t a = rope_bug ? 2 * i : i, b = rope_bug ? 2 * i + 1 : i + half;  // the bug: adjacent pairs
          dst[a] = src[a] * c - src[b] * s;
          dst[b] = src[b] * c + src[a] * s;
        }
      }
    return out;
  }

  // Appends this call's [H, T, Dh] to a cache [H, S, Dh].
  void append(Vec& cache, const Vec& x, int64_t T) {
    Vec grown(size_t(Hkv * (S + T) * Dh));
    for (int64_t h = 0; h < Hkv; ++h) {
      std::copy(cache.begin() + h * S * Dh, cache.begin() + (h + 1) * S * Dh, grown.begin() + h * (S + T) * Dh);
      std::copy(x.begin() + h * T * Dh, x.begin() + (h + 1) * T * Dh, grown.begin() + (h * (S + T) + S) * Dh);
    }
    cache = std::move(grown);
  }

  Vec forward(const std::vector<int64_t>& tokens, int step, llmdump_writer* dump) {
    const int64_t T = int64_t(tokens.size()), P = S, St = P + T;
    char name[256];
    auto rec = [&](const char* site, std::vector<int64_t> shape, const Vec& v) {
      llmdump_step_name(name, sizeof name, step, site);
      if (llmdump_add_f32(dump, name, int(shape.size()), shape.data(), v.data()) != 0) die(llmdump_error(dump));
    };
    auto rec_l = [&](int64_t l, const char* site, std::vector<int64_t> shape, const Vec& v) {
      llmdump_layer_name(name, sizeof name, step, int(l), site);
      if (llmdump_add_f32(dump, name, int(shape.size()), shape.data(), v.data()) != 0) die(llmdump_error(dump));
    };
    std::vector<int64_t> positions(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) positions[size_t(t)] = P + t;
    int64_t n = T;
    llmdump_step_name(name, sizeof name, step, "tokens");
    llmdump_add_i64(dump, name, 1, &n, tokens.data());
    llmdump_step_name(name, sizeof name, step, "positions");
    llmdump_add_i64(dump, name, 1, &n, positions.data());
    const Tensor& emb = W("model.embed_tokens.weight");
    Vec x(size_t(T * D));
    for (int64_t t = 0; t < T; ++t)
      std::copy(emb.v.begin() + tokens[size_t(t)] * D, emb.v.begin() + (tokens[size_t(t)] + 1) * D, x.begin() + t * D);
    rec("embed", {T, D}, x);
    for (int64_t l = 0; l < L; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      Vec h = rmsnorm(x, W(p + "input_layernorm.weight"), T, eps);
      rec_l(l, "attn_norm", {T, D}, h);
      const Vec q = matmul(h, W(p + "self_attn.q_proj.weight"), T);  // [T, Hq*Dh]
      const Vec k = matmul(h, W(p + "self_attn.k_proj.weight"), T);  // [T, Hkv*Dh]
      const Vec v = matmul(h, W(p + "self_attn.v_proj.weight"), T);
      rec_l(l, "attn.q", {T, Hq * Dh}, q);
      rec_l(l, "attn.k", {T, Hkv * Dh}, k);
      rec_l(l, "attn.v", {T, Hkv * Dh}, v);
      const Vec q_rope = rope(q, T, Hq, P), k_rope = rope(k, T, Hkv, P);
      rec_l(l, "attn.q_rope", {Hq, T, Dh}, q_rope);
      rec_l(l, "attn.k_rope", {Hkv, T, Dh}, k_rope);
      Vec v_hm(size_t(Hkv * T * Dh));
      for (int64_t hh = 0; hh < Hkv; ++hh)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t d = 0; d < Dh; ++d) v_hm[size_t((hh * T + t) * Dh + d)] = v[size_t(t * Hkv * Dh + hh * Dh + d)];
      append(k_cache[size_t(l)], k_rope, T);
      append(v_cache[size_t(l)], v_hm, T);
      rec_l(l, "attn.k_cache", {Hkv, St, Dh}, k_cache[size_t(l)]);
      rec_l(l, "attn.v_cache", {Hkv, St, Dh}, v_cache[size_t(l)]);
      // Attention: query head hq reads kv head hq / (Hq / Hkv); causal over positions.
      Vec scores(size_t(Hq * T * St)), probs(size_t(Hq * T * St), 0.f), ctx(size_t(T * Hq * Dh), 0.f);
      const float scale = 1.0f / std::sqrt(float(Dh));
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const int64_t kv = hq / (Hq / Hkv);
        for (int64_t t = 0; t < T; ++t) {
          float* srow = &scores[size_t((hq * T + t) * St)];
          float* prow = &probs[size_t((hq * T + t) * St)];
          float mx = -INFINITY;
          for (int64_t s = 0; s < St; ++s) {
            float dot = 0;
            for (int64_t d = 0; d < Dh; ++d)
              dot += q_rope[size_t((hq * T + t) * Dh + d)] * k_cache[size_t(l)][size_t((kv * St + s) * Dh + d)];
            srow[s] = dot * scale;
            if (s <= P + t) mx = std::max(mx, srow[s]);
          }
          float sum = 0;
          for (int64_t s = 0; s <= P + t; ++s) sum += prow[s] = std::exp(srow[s] - mx);
          for (int64_t s = 0; s <= P + t; ++s) prow[s] /= sum;
          for (int64_t s = 0; s <= P + t; ++s)
            for (int64_t d = 0; d < Dh; ++d)
              ctx[size_t(t * Hq * Dh + hq * Dh + d)] += prow[s] * v_cache[size_t(l)][size_t((kv * St + s) * Dh + d)];
        }
      }
      rec_l(l, "attn.scores", {Hq, T, St}, scores);
      rec_l(l, "attn.probs", {Hq, T, St}, probs);
      rec_l(l, "attn.ctx", {T, Hq * Dh}, ctx);
      const Vec out = matmul(ctx, W(p + "self_attn.o_proj.weight"), T);
      rec_l(l, "attn.out", {T, D}, out);
      for (size_t i = 0; i < x.size(); ++i) x[i] += out[i];
      rec_l(l, "attn_residual", {T, D}, x);
      h = rmsnorm(x, W(p + "post_attention_layernorm.weight"), T, eps);
      rec_l(l, "mlp_norm", {T, D}, h);
      const Vec gate = matmul(h, W(p + "mlp.gate_proj.weight"), T), up = matmul(h, W(p + "mlp.up_proj.weight"), T);
      Vec act(gate.size());
      for (size_t i = 0; i < act.size(); ++i) act[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
      const Vec down = matmul(act, W(p + "mlp.down_proj.weight"), T);
      rec_l(l, "mlp.gate", {T, F}, gate);
      rec_l(l, "mlp.up", {T, F}, up);
      rec_l(l, "mlp.act", {T, F}, act);
      rec_l(l, "mlp.down", {T, D}, down);
      for (size_t i = 0; i < x.size(); ++i) x[i] += down[i];
      rec_l(l, "out", {T, D}, x);
    }
    S = St;
    const Vec h = rmsnorm(x, W("model.norm.weight"), T, eps);
    rec("final_norm", {T, D}, h);
    const Vec logits = matmul(h, w.count("lm_head.weight") ? W("lm_head.weight") : emb, T);
    rec("logits", {T, V}, logits);
    const Vec last(logits.end() - V, logits.end());
    rec("next_logits", {V}, last);
    return last;
  }
};

int main(int argc, char** argv) {
  std::string model, tokens_arg, out, bug;
  int decode = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die(a + " needs a value");
      return argv[++i];
    };
    if (a == "--tokens") tokens_arg = value();
    else if (a == "--decode") decode = std::atoi(value().c_str());
    else if (a == "--out") out = value();
    else if (a == "--bug") bug = value();
    else if (model.empty()) model = a;
    else die("unexpected argument " + a);
  }
  if (model.empty() || tokens_arg.empty() || out.empty())
    die("usage: tiny_llama MODEL_DIR --tokens 1,2,3 [--decode N] --out DUMP [--bug rope-interleaved]");
  Engine e(model);
  if (!bug.empty() && bug != "rope-interleaved") die("unknown bug " + bug);
  e.rope_bug = bug == "rope-interleaved";
  std::vector<int64_t> tokens;
  for (std::stringstream ss(tokens_arg); ss.good();) {
    std::string t;
    std::getline(ss, t, ',');
    tokens.push_back(std::stoll(t));
  }
  const std::string model_name = model.substr(model.find_last_of('/', model.size() - 2) + 1);
  llmdump_manifest m = {};
  m.producer = "tiny_llama.cpp";
  m.model = model_name.c_str();
  m.config = e.config_text.c_str();
  m.scenario = decode ? "decode" : "prefill";
  m.dtype = "float32";
  m.steps = 1 + decode;
  char err[512];
  llmdump_writer* dump = llmdump_open(out.c_str(), &m, err, sizeof err);
  if (!dump) die(err);
  std::vector<int64_t> generated;
  for (int step = 0; step <= decode; ++step) {
    const Vec logits = e.forward(tokens, step, dump);
    const int64_t next = int64_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    generated.push_back(next);
    tokens = {next};
  }
  int64_t n = int64_t(generated.size());
  if (llmdump_add_i64(dump, "generated", 1, &n, generated.data()) != 0 || llmdump_finish(dump) != 0)
    die(llmdump_error(dump));
  llmdump_free(dump);
  std::printf("%s: %d forward calls\n", out.c_str(), 1 + decode);
  return 0;
}
