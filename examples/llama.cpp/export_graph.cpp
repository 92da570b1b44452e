// Exports llama.cpp's graph tensors, as its eval callback sees them, for
// `llmdiff import --mapping llama.cpp` (docs/IMPORT.md): one safetensors file
// per llama_decode call, each F32/F16 node under its ggml name (the k-th
// repeat of a name in one graph as NAME#k), shapes as ggml's ne[] (fastest
// dimension first), values in logical order. Built against a llama.cpp
// checkout (its C API of 2025) and the project's C writer:
//
//   cmake -S llama.cpp -B llama.cpp/build -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
//   cmake --build llama.cpp/build --target llama -j
//   c++ -std=c++17 -O2 -I llama.cpp/include -I llama.cpp/ggml/include -I writers/c \
//       examples/llama.cpp/export_graph.cpp llama.cpp/build/src/libllama.a \
//       $(find llama.cpp/build/ggml -name 'libggml*.a') -fopenmp -lpthread -o export_graph
//   ./export_graph MODEL.gguf --tokens 1,5,77 --decode 3 --out-dir lc
//   llmdiff import --model HF_DIR --mapping llama.cpp --tokens "$(cat lc/tokens)" --out lc.safetensors lc/step*.safetensors
//   llmdiff bisect --model HF_DIR lc.safetensors
//
// --all-outputs marks every token as an output (the last layer computed for
// every row; without it only the last token's rows, imported as row
// subsets). --flash-attn turns flash attention on. --cache-type f16 keeps
// llama.cpp's default float16 KV cache (declare it on import with
// --precision kv_cache=f16); the default here is f32.
#define LLMDUMP_IMPLEMENTATION
#include "llmdump.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

namespace {

struct Export {
  llmdump_writer* w = nullptr;         // the file of the current llama_decode call
  std::map<std::string, int> repeats;  // names seen in this call
};

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "export_graph: %s\n", msg.c_str());
  std::exit(2);
}

// Every F32/F16 node, values in logical order (views follow their strides).
bool export_node(ggml_tensor* t, bool ask, void* user) {
  if (ask) return true;  // yes, every node
  auto* ex = static_cast<Export*>(user);
  if (!ex->w || (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16)) return true;
  std::vector<uint8_t> raw(ggml_nbytes(t));
  ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
  std::vector<float> v;
  v.reserve(size_t(ggml_nelements(t)));
  for (int64_t i3 = 0; i3 < t->ne[3]; ++i3)
    for (int64_t i2 = 0; i2 < t->ne[2]; ++i2)
      for (int64_t i1 = 0; i1 < t->ne[1]; ++i1)
        for (int64_t i0 = 0; i0 < t->ne[0]; ++i0) {
          const uint8_t* p = raw.data() + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
          float x;
          if (t->type == GGML_TYPE_F32) {
            std::memcpy(&x, p, 4);
          } else {
            ggml_fp16_t h;
            std::memcpy(&h, p, 2);
            x = ggml_fp16_to_fp32(h);
          }
          v.push_back(x);
        }
  std::string name = ggml_get_name(t);
  if (const int k = ex->repeats[name]++) name += "#" + std::to_string(k);
  const int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
  if (llmdump_add_f32(ex->w, name.c_str(), 4, ne, v.data()) != 0) std::fprintf(stderr, "%s\n", llmdump_error(ex->w));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_path, tokens_arg, out_dir = ".", cache_type = "f32";
  int decode = 0;
  bool all_outputs = false, flash_attn = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die(a + " needs a value");
      return argv[++i];
    };
    if (a == "--tokens") tokens_arg = value();
    else if (a == "--decode") decode = std::atoi(value().c_str());
    else if (a == "--out-dir") out_dir = value();
    else if (a == "--cache-type") cache_type = value();
    else if (a == "--all-outputs") all_outputs = true;
    else if (a == "--flash-attn") flash_attn = true;
    else if (model_path.empty()) model_path = a;
    else die("unexpected argument " + a);
  }
  if (model_path.empty() || tokens_arg.empty())
    die("usage: export_graph MODEL.gguf --tokens 1,2,3 [--decode N] [--out-dir DIR] [--all-outputs] [--flash-attn] "
        "[--cache-type f32|f16]");
  std::vector<llama_token> tokens;
  for (std::stringstream ss(tokens_arg); ss.good();) {
    std::string t;
    std::getline(ss, t, ',');
    tokens.push_back(llama_token(std::stol(t)));
  }

  llama_backend_init();
  llama_model* model = llama_model_load_from_file(model_path.c_str(), llama_model_default_params());
  if (!model) die("cannot load " + model_path);
  Export ex;
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 512;
  cp.n_batch = cp.n_ubatch = 512;
  cp.cb_eval = export_node;
  cp.cb_eval_user_data = &ex;
  cp.flash_attn = flash_attn;
  cp.type_k = cp.type_v = cache_type == "f16" ? GGML_TYPE_F16 : GGML_TYPE_F32;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) die("cannot create a context");
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

  std::string all_tokens;  // the import's --tokens: each call's ids, calls separated by ';'
  int pos = 0;
  for (int step = 0; step <= decode; ++step) {
    llama_batch batch = llama_batch_init(int32_t(tokens.size()), 0, 1);
    for (size_t k = 0; k < tokens.size(); ++k) {
      batch.token[k] = tokens[k];
      batch.pos[k] = pos + int(k);
      batch.n_seq_id[k] = 1;
      batch.seq_id[k][0] = 0;
      batch.logits[k] = all_outputs || k + 1 == tokens.size();
    }
    batch.n_tokens = int32_t(tokens.size());
    llmdump_manifest m = {};
    m.producer = "llama.cpp graph export";
    m.steps = 1;
    char err[512];
    const std::string path = out_dir + "/step" + std::to_string(step) + ".safetensors";
    ex.w = llmdump_open(path.c_str(), &m, err, sizeof err);
    if (!ex.w) die(err);
    ex.repeats.clear();
    if (llama_decode(ctx, batch) != 0) die("llama_decode failed at step " + std::to_string(step));
    if (llmdump_finish(ex.w) != 0) die(llmdump_error(ex.w));
    llmdump_free(ex.w);
    ex.w = nullptr;
    for (size_t k = 0; k < tokens.size(); ++k) all_tokens += (k ? "," : (step ? ";" : "")) + std::to_string(tokens[k]);
    const float* logits = llama_get_logits_ith(ctx, -1);
    int best = 0;
    for (int v = 1; v < n_vocab; ++v)
      if (logits[v] > logits[best]) best = v;
    pos += int(tokens.size());
    llama_batch_free(batch);
    tokens = {llama_token(best)};
  }
  std::ofstream(out_dir + "/tokens") << all_tokens << "\n";
  std::printf("%s: %d forward calls; tokens %s (also in %s/tokens)\n", out_dir.c_str(), decode + 1, all_tokens.c_str(),
              out_dir.c_str());
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
