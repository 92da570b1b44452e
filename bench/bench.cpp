// The harness of `llmdiff bench` (bench/bench.h).
#include "bench/bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/compute_probe.h"
#include "bench/serving.h"
#include "bench/support.h"
#include "bisect/engines.h"
#include "bisect/pipeline.h"
#include "compare/compare.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"
#include "dumps/formats/gguf.h"
#include "dumps/base/blas_core.h"
#include "dumps/zoo/bugs.h"
#include "dumps/base/threads.h"
#include "dumps/model/weights.h"
#include "impl/batch_engine.h"
#include "impl/impl_engine.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"

namespace llmdiff::bench {


namespace {

using bisect::EngineOptions;
using bisect::make_engine;
using bisect::make_manifest;
using nlohmann::json;

// What the figures depend on besides the code: the CPU, and the BLAS kernels
// libtorch's float32/float64 products run on (dumps/base/blas_core.h).
void print_machine() {
  const std::string cpu = cpu_name(), blas = blas_config();
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  std::printf("cpu: %s; BLAS: %s%s%s\n", cpu.empty() ? "unknown" : cpu.c_str(),
              blas.empty() ? "not OpenBLAS" : blas.c_str(), forced && *forced ? ", OPENBLAS_CORETYPE=" : "",
              forced && *forced ? forced : "");
  const std::string note = forced_blas_core_note();
  if (!note.empty()) std::printf("note: %s\n", note.c_str());
}


// What the parent knows of the checkpoint without running it.
struct ModelFacts {
  ModelConfig config;
  DType storage = DType::F32;
  std::string storage_label;       // "BF16", or a GGUF file's types ("GGUF Q4_K x37, F32 x9")
  uint64_t weight_bytes = 0;       // distinct weights as stored
  uint64_t params = 0;             // distinct weight elements
  uint64_t decode_params = 0;      // weight elements one decode token reads (one embedding row)
  uint64_t decode_bytes = 0;       // the same weights' stored bytes (ggml blocks as stored)
  double prefill_flops = 0;        // useful work of one prefill: matmuls, attention, last-row logits
  double token_matmul_flops = 0;   // one token through every layer's products (a MoE layer's active experts)
  double token_head_flops = 0;     // one token's logits
  double attention_pair_flops = 0; // one query attending to one key, every layer and head
};

ModelFacts model_facts(const std::string& dir, int prompt) {
  const Model m = Model::load(dir);
  const ModelWeights& w = *m.weights;
  const ModelConfig& c = m.config;
  ModelFacts f;
  f.config = c;
  f.storage = w.storage_dtype();
  f.storage_label = dtype_name(f.storage);
  if (w.is_gguf()) {
    std::map<std::string, int> types;
    for (const GgufTensorInfo& t : w.gguf()->tensors()) ++types[ggml_type_name(uint32_t(t.type))];
    f.storage_label = "GGUF";
    for (const auto& [name, n] : types)
      f.storage_label += (f.storage_label == "GGUF" ? " " : ", ") + name + " x" + std::to_string(n);
  }
  f.weight_bytes = w.total_bytes();
  // Weight elements a token multiplies with: every projection, but of a MoE
  // layer only the router, K experts and the shared expert.
  uint64_t layer_params = 0, layer_matmul = 0, layer_active = 0, layer_active_bytes = 0;
  for (const auto& L : w.layers) {
    uint64_t all = 0, experts = 0, all_bytes = 0, expert_bytes = 0;
    for (const WeightView* v : L.views())
      if (*v && v->shape.size() == 2) all += uint64_t(v->numel()), all_bytes += uint64_t(v->bytes());
    for (const MlpWeights& e : L.experts) {
      experts += uint64_t(e.gate.numel() + e.up.numel() + e.down.numel());
      expert_bytes += uint64_t(e.gate.bytes() + e.up.bytes() + e.down.bytes());
    }
    auto active_of = [&](uint64_t whole, uint64_t in_experts) {
      return L.experts.empty() ? whole : whole - in_experts + in_experts / L.experts.size() * uint64_t(c.moe.top_k);
    };
    const uint64_t active = active_of(all, experts);
    layer_matmul += active;
    layer_active += active;
    layer_active_bytes += active_of(all_bytes, expert_bytes);
    for (const WeightView* v : L.views())
      if (*v) layer_params += uint64_t(v->numel());
  }
  const uint64_t embed = uint64_t(w.embed.numel()), head = uint64_t(w.lm_head.numel());
  const uint64_t D = uint64_t(c.hidden_size);
  f.params = layer_params + uint64_t(w.final_norm.numel()) + embed + (w.lm_head_tied ? 0 : head);
  // A decode token reads the active weights (norms and biases are noise next to them).
  f.decode_params = layer_active + uint64_t(w.final_norm.numel()) + head + (w.lm_head_tied ? 0 : D);
  f.decode_bytes = layer_active_bytes + uint64_t(w.final_norm.bytes()) + uint64_t(w.lm_head.bytes()) +
                   (w.lm_head_tied ? 0 : uint64_t(w.embed.row_bytes()));
  const double T = prompt;
  f.token_matmul_flops = 2.0 * double(layer_matmul);
  f.token_head_flops = 2.0 * double(head);
  f.attention_pair_flops = double(c.num_hidden_layers) * 2.0 * double(c.num_attention_heads) *
                           double(c.mla.enabled ? c.mla.qk_head_dim() + c.mla.v_head_dim : 2 * c.head_dim);
  f.prefill_flops = T * f.token_matmul_flops + f.attention_pair_flops * T * (T + 1) / 2.0 + f.token_head_flops;
  return f;
}

// The products of one pass of the bisection over `prompt` tokens then
// `decode` one-token calls, as the reference runs and the local recompute
// make them: every row through every layer and the head (the passes record
// the logits of every row), each query against its causal keys.
double pass_flops(const ModelFacts& f, int prompt, int decode) {
  const double P = prompt, rows = double(prompt) + double(decode);
  double pairs = P * (P + 1) / 2.0;
  for (int i = 1; i <= decode; ++i) pairs += P + i;
  return rows * (f.token_matmul_flops + f.token_head_flops) + f.attention_pair_flops * pairs;
}

size_t compute_dtype_size(ComputeDType d) {
  switch (d) {
    case ComputeDType::Float32: return 4;
    case ComputeDType::BFloat16:
    case ComputeDType::Float16: return 2;
    case ComputeDType::Float64: return 8;
  }
  return 4;
}

// The child's work: load, then `repeats` times prefill + greedy decode with
// nothing observed. Returns a JSON object.
std::string bench_engine(const BenchOptions& o, const std::string& engine_name, ComputeDType ref_dtype) {
  const int64_t base_rss = proc_status_bytes("VmRSS");
  const auto t_load = std::chrono::steady_clock::now();
  const Model model = Model::load(o.model);
  EngineOptions eo;
  eo.dtype = engine_name == "ref" ? compute_dtype_name(ref_dtype) : "";
  if (engine_name == "impl") eo.mla = o.mla;
  eo.threads = o.threads;
  eo.max_seq = int64_t(o.prompt) + o.decode + 1;
  // The impl as `dump` builds it: the checkpoint resident when it fits the
  // memory budget, else streamed layer by layer.
  const bisect::WeightPolicy policy = bisect::weight_policy(model, 0);
  if (engine_name == "impl") eo.release_weights = policy.stream;
  const std::unique_ptr<Engine> engine = make_engine(engine_name, model, eo);
  const double load_s = seconds_since(t_load);
  const std::vector<int64_t> prompt = bench_prompt(model.config.vocab_size, o.prompt, o.seed);
  NullObserver nobs;
  json prefill_tok_s = json::array(), decode_ms = json::array(), generated;
  for (int r = 0; r < o.repeats; ++r) {
    engine->reset();
    auto t0 = std::chrono::steady_clock::now();
    std::vector<float> logits = engine->forward(prompt, 0, nobs);
    const double prefill_s = seconds_since(t0);
    prefill_tok_s.push_back(double(o.prompt) / prefill_s);
    std::vector<int64_t> gen{argmax_first(logits)};
    t0 = std::chrono::steady_clock::now();
    for (int d = 1; d <= o.decode; ++d) {
      logits = engine->forward({gen.back()}, d, nobs);
      gen.push_back(argmax_first(logits));
    }
    if (o.decode > 0) decode_ms.push_back(seconds_since(t0) * 1e3 / o.decode);
    generated = gen;
  }
  return json{{"engine", engine_name},
              {"pid", int64_t(::getpid())},
              {"producer", engine->producer()},
              {"weights", engine_name == "impl" ? policy.str() : "converted once, kept"},
              {"dtype", engine->dtype_name()},
              {"load_s", load_s},
              {"prefill_tok_s", prefill_tok_s},
              {"decode_ms_per_token", decode_ms},
              {"generated", generated},
              {"base_rss_bytes", base_rss},
              {"hwm_rss_bytes", proc_status_bytes("VmHWM")}}
      .dump();
}

// The impl's continuous-batching engine serving n sequences of o.prompt
// tokens (each its own prompt) that all arrive at once, then o.decode decode
// calls each: the first iteration is the packed prefill of all of them, the
// others decode one token of every sequence. Best of o.repeats.
std::string bench_batch(const BenchOptions& o, int n) {
  const Model model = Model::load(o.model);
  std::vector<impl::BatchRequest> requests(static_cast<size_t>(n));
  for (int b = 0; b < n; ++b) {
    requests[size_t(b)].prompt = bench_prompt(model.config.vocab_size, o.prompt, o.seed + uint64_t(b));
    requests[size_t(b)].decode = o.decode;
  }
  impl::BatchEngineOptions bo;
  bo.threads = o.threads;
  impl::BatchEngine engine(model, bo);
  NullObserver nobs;
  double best_prefill = 0, best_decode = 0, best_iter_ms = 1e300;
  for (int r = 0; r < o.repeats; ++r) {
    const impl::BatchOutcome out = engine.run(requests, nobs);
    best_prefill = std::max(best_prefill, double(out.iteration_rows.front()) / out.iteration_seconds.front());
    double s = 0;
    int64_t rows = 0;
    for (size_t i = 1; i < out.iteration_seconds.size(); ++i) s += out.iteration_seconds[i], rows += out.iteration_rows[i];
    if (rows > 0) {
      best_decode = std::max(best_decode, double(rows) / s);
      best_iter_ms = std::min(best_iter_ms, s * 1e3 / double(out.iteration_seconds.size() - 1));
    }
  }
  // Batch invariance: sequence 0 served in this batch against the same
  // sequence alone (the single-sequence impl), next_logits step by step,
  // max |difference| over max |logit|.
  json invariance;
  if (n > 1) {
    MemoryDump batch_logits("batch");
    batch_logits.set_filter({"seq0.step*.next_logits", "seq0.generated"});
    engine.run(requests, batch_logits);
    impl::ImplOptions io;
    io.threads = o.threads;
    const std::unique_ptr<Engine> alone = impl::make_impl_engine(model, io);
    const std::vector<int64_t> gen = batch_logits.get("seq0.generated").i;
    double prefill = 0, decode = 0;
    for (int step = 0; step <= o.decode; ++step) {
      const std::vector<float> a =
          alone->forward(step == 0 ? requests[0].prompt : std::vector<int64_t>{gen[size_t(step - 1)]}, step, nobs);
      const std::vector<float> b = batch_logits.get(step_name(step, Site::NextLogits).insert(0, "seq0.")).f;
      double diff = 0, scale = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        diff = std::max(diff, std::fabs(double(a[i]) - b[i]));
        scale = std::max(scale, std::fabs(double(a[i])));
      }
      (step == 0 ? prefill : decode) = std::max(step == 0 ? prefill : decode, diff / std::max(scale, 1e-30));
    }
    invariance = {{"prefill_max_rel", prefill}, {"decode_max_rel", decode}};
  }
  return json{{"sequences", n},
              {"invariance", invariance},
              {"producer", engine.producer()},
              {"prefill_tok_s", best_prefill},
              {"decode_tok_s", best_decode},
              {"decode_ms_per_iteration", o.decode > 0 ? best_iter_ms : 0.0}}
      .dump();
}

// The read-bandwidth probe, run in a child so that its buffer never counts in
// this process (whose children inherit its memory high-water mark).
BandwidthResult probe_bandwidth(const BenchOptions& o, int passes) {
  const ChildOutcome out = run_in_child([&] {
    const BandwidthResult r = measure_read_bandwidth(o.threads, size_t(o.bandwidth_mib) << 20, passes);
    return json{{"all_gbs", r.all_gbs}, {"buffer_bytes", r.buffer_bytes}, {"threads", r.threads}}.dump();
  });
  if (!out.ok) throw IoError("bandwidth probe", out.failure);
  const json j = json::parse(out.output);
  BandwidthResult r;
  r.all_gbs = j["all_gbs"].get<std::vector<double>>();
  r.buffer_bytes = j["buffer_bytes"].get<size_t>();
  r.threads = j["threads"].get<int>();
  r.best_gbs = *std::max_element(r.all_gbs.begin(), r.all_gbs.end());
  return r;
}

// Bytes a dump's tensors take in the file (floats F32, integers I64).
uint64_t dump_bytes(const TensorSource& d) {
  uint64_t total = 0;
  for (const auto& n : d.names()) {
    const TensorData t = d.get(n);
    total += uint64_t(t.numel()) * (t.is_int ? 8u : 4u);
  }
  return total;
}

// The child's work for --e2e: what `llmdiff run` does, piece by piece and
// timed: each engine runs the scenario recording every site in memory, the
// dumps are written, then diffed from memory and again from the files.
std::string bench_e2e(const BenchOptions& o, ComputeDType ref_dtype, const std::string& dir) {
  const Model model = Model::load(o.model);
  const Scenario sc = make_scenario(bench_prompt(model.config.vocab_size, o.prompt, o.seed), {}, o.e2e_decode);
  json j = {{"prompt", o.prompt}, {"decode", o.e2e_decode}, {"steps", int(sc.steps.size()) + sc.decode}};
  std::map<std::string, std::unique_ptr<MemoryDump>> dumps;
  for (const std::string which : {"ref", "impl"}) {
    EngineOptions eo;
    eo.dtype = which == "ref" ? compute_dtype_name(ref_dtype) : "";
    if (which == "impl") eo.mla = o.mla;
    eo.threads = o.threads;
    eo.max_seq = int64_t(o.prompt) + o.e2e_decode + 1;
    auto t0 = std::chrono::steady_clock::now();
    const std::unique_ptr<Engine> engine = make_engine(which, model, eo);
    const double load_s = seconds_since(t0);
    auto dump = std::make_unique<MemoryDump>(which);
    dump->mutable_manifest() = make_manifest(*engine, model, o.model, sc);
    t0 = std::chrono::steady_clock::now();
    run_scenario(*engine, sc, *dump);
    const double run_s = seconds_since(t0);
    const std::string path = dir + "/" + which + ".safetensors";
    t0 = std::chrono::steady_clock::now();
    dump->save(path);
    const double save_s = seconds_since(t0);
    j[which] = {{"dtype", engine->dtype_name()},
                {"load_s", load_s},
                {"run_s", run_s},
                {"tensors", dump->names().size()},
                {"dump_bytes", dump_bytes(*dump)},
                {"save_s", save_s},
                {"file_bytes", std::filesystem::file_size(path)}};
    dumps[which] = std::move(dump);
  }
  const double compared_bytes =
      double(j["ref"]["dump_bytes"].get<uint64_t>() + j["impl"]["dump_bytes"].get<uint64_t>());

  auto t0 = std::chrono::steady_clock::now();
  const compare::DiffResult mem = compare::compare_dumps(*dumps["ref"], *dumps["impl"]);
  const double mem_s = seconds_since(t0);
  dumps.clear();
  t0 = std::chrono::steady_clock::now();
  const DumpFile ref_file(dir + "/ref.safetensors"), impl_file(dir + "/impl.safetensors");
  const compare::DiffResult files = compare::compare_dumps(ref_file, impl_file);
  const double files_s = seconds_since(t0);

  j["diff_memory"] = {{"seconds", mem_s}, {"gbs", compared_bytes / mem_s * 1e-9}};
  j["diff_files"] = {{"seconds", files_s}, {"gbs", compared_bytes / files_s * 1e-9}};
  j["compared"] = files.tensors.size();
  j["failing"] = files.failing();
  j["only_in_ref"] = files.only_in_ref.size();
  j["only_in_impl"] = files.only_in_cand.size();
  j["first_divergence"] = files.first() ? files.first()->name : "";
  j["diff_dtype"] = compute_dtype_name(files.dtype);
  if (mem.failing() != files.failing()) j["note"] = "in-memory and file diffs disagree";
  return j.dump();
}

// The seconds of a pipeline run's four passes (one phase when they run in
// lanes, else one phase each).
double passes_seconds(const json& phases) {
  double s = 0;
  for (const auto& p : phases) {
    const std::string what = p["phase"];
    if (what.rfind("clean run of the hypothesis engine", 0) == 0 || what.rfind("reference run in", 0) == 0 ||
        what.rfind("local recompute of the candidate", 0) == 0)
      s += p["seconds"].get<double>();
  }
  return s;
}

// The child's work for --e2e, second part, and for --bisect: the pipeline of
// `llmdiff run` with its defaults (float64 noise floor, local errors,
// diagnosis), phase by phase, over an impl candidate with the bugs `inject`
// (none: the clean impl), after the plain impl forward of the same scenario
// (nothing recorded) that the pipeline's cost is measured against.
std::string bench_run_pipeline(const BenchOptions& o, const std::vector<std::string>& inject) {
  bisect::ModelOracles m(o.model, o.threads);
  const Scenario sc = make_scenario(bench_prompt(m.model.config.vocab_size, o.prompt, o.seed), {}, o.e2e_decode);
  EngineOptions eo;
  eo.threads = o.threads;
  eo.max_seq = int64_t(o.prompt) + o.e2e_decode + 1;
  eo.release_weights = bisect::weight_policy(m.model, 0).stream;  // as `run` holds the checkpoint
  eo.mla = o.mla;
  double plain_s = 0;
  {
    auto engine = make_engine("impl", m.model, eo);
    NullObserver none;
    const auto t0 = std::chrono::steady_clock::now();
    run_scenario(*engine, sc, none);
    plain_s = seconds_since(t0);
  }
  const auto start = std::chrono::steady_clock::now();
  json phases = json::array();
  double last = 0;
  auto phase = [&](const std::string& what) {
    const double now = seconds_since(start);
    phases.push_back({{"phase", what}, {"seconds", now - last}});
    last = now;
  };
  eo.inject = inject;
  const std::unique_ptr<MemoryDump> cand = bisect::run_impl_candidate(m, sc, eo);
  phase(inject.empty() ? "candidate run (impl)" : "candidate run (impl --inject " + inject.front() + ")");
  const double candidate_s = seconds_since(start);
  bisect::BisectOptions bo;
  bo.progress = phase;
  const compare::BisectResult r = bisect::bisect_impl_candidate(m, *cand, !inject.empty(), bo);
  const double total = seconds_since(start);
  json j = {{"seconds", total},
            {"bisect_seconds", total - candidate_s},
            {"plain_forward_seconds", plain_s},
            {"phases", phases},
            {"compared", r.global.tensors.size()},
            {"diverging", r.global.failing()},
            {"local_sites", r.local.sites.size()},
            {"local_failing", r.local.failing()},
            {"localised_at", r.localised_at().value_or("")},
            {"diagnosis", compare::named_bug(r.finding) ? compare::named_bug(r.finding)->str() : ""},
            {"exit_code", r.exit_code()}};
  j["passes_seconds"] = passes_seconds(phases);
  if (!inject.empty()) j["injected"] = inject.front();
  return j.dump();
}

// The compute floor of a bisection's four passes (the float64 truth, the
// candidate's float64 local recompute, the reference at float32 and the
// clean impl run, bisect/schedule.cpp): their products at the best rate the
// probe of the passes' shape measured (the impl's own kernels counted at the
// BLAS's float32 rate: a lower bound).
std::string bisect_compute(const BenchOptions& o, const ModelFacts& f) {
  const ModelConfig& c = f.config;
  const int64_t m = int64_t(o.prompt) + o.e2e_decode, k = c.hidden_size;
  const int64_t n = c.intermediate_size > 0 ? c.intermediate_size : c.hidden_size;
  const ComputeProbe p = measure_products(m, k, n, o.threads);
  const double F = pass_flops(f, o.prompt, o.e2e_decode);
  auto rate = [](const GemmRate& r) {
    return json{{"one_thread", r.one}, {"one_product", r.one_product}, {"side_by_side", r.side_by_side}};
  };
  return json{{"shape", {m, k, n}},
              {"threads", p.threads},
              {"float32_gflops", rate(p.f32)},
              {"float64_gflops", rate(p.f64)},
              {"pass_flops", F},
              {"floor_seconds", 2 * F / (p.f64.best() * 1e9) + 2 * F / (p.f32.best() * 1e9)}}
      .dump();
}

void print_compute(const json& c) {
  if (c.contains("error")) {
    std::printf("\nproducts' throughput: error: %s\n", c["error"].get<std::string>().c_str());
    return;
  }
  const auto shape = c["shape"].get<std::vector<int64_t>>();
  const int threads = c["threads"].get<int>();
  std::printf("\nproducts of the passes' shape ([%lld, %lld] x [%lld, %lld]^T, libtorch on the BLAS above), GFLOP/s:\n",
              (long long)shape[0], (long long)shape[1], (long long)shape[2], (long long)shape[1]);
  for (const char* dt : {"float32", "float64"}) {
    const json& r = c[std::string(dt) + "_gflops"];
    std::printf("  %-8s %7.1f on one thread, %7.1f on %d in one product, %7.1f as %d products side by side (one thread "
                "each)\n",
                dt, r["one_thread"].get<double>(), r["one_product"].get<double>(), threads,
                r["side_by_side"].get<double>(), threads);
  }
  std::printf("compute floor of the four passes (the float64 truth and local recompute, the float32 reference and clean "
              "run; %.3f TFLOP each) at the best of these rates: %.2f s\n",
              c["pass_flops"].get<double>() * 1e-12, c["floor_seconds"].get<double>());
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

void print_engine_table(const json& rows) {
  std::printf("%-6s %-9s %7s | %8s %8s %8s %8s | %8s %8s %8s %8s %5s | %8s %7s\n", "", "", "", "prefill", "tok/s", "",
              "GFLOP/s", "decode", "ms/token", "", "bound", "of", "peak RSS", "x");
  std::printf("%-6s %-9s %7s | %8s %8s %8s %8s | %8s %8s %8s %8s %5s | %8s %7s\n", "engine", "compute", "load s", "best",
              "median", "worst", "best", "best", "median", "worst", "ms/token", "bound", "GB", "weights");
  for (const auto& row : rows) {
    const std::string name = row["engine"];
    if (row.contains("error")) {
      std::printf("%-6s error: %s\n", name.c_str(), row["error"].get<std::string>().c_str());
      continue;
    }
    const json& p = row["prefill"];
    std::string dbest = "-", dmed = "-", dworst = "-", frac = "-";
    if (row.contains("decode")) {
      dbest = fmt("%.1f", row["decode"]["best_ms"].get<double>());
      dmed = fmt("%.1f", row["decode"]["median_ms"].get<double>());
      dworst = fmt("%.1f", row["decode"]["worst_ms"].get<double>());
      frac = fmt("%.0f%%", 100.0 * row["decode"]["fraction_of_bound"].get<double>());
    }
    std::printf("%-6s %-9s %7.2f | %8.1f %8.1f %8.1f %8.1f | %8s %8s %8s %8.1f %5s | %8.2f %7.2f\n", name.c_str(),
                row["dtype"].get<std::string>().c_str(), row["load_s"].get<double>(), p["best_tok_s"].get<double>(),
                p["median_tok_s"].get<double>(), p["worst_tok_s"].get<double>(), p["best_gflops"].get<double>(),
                dbest.c_str(), dmed.c_str(), dworst.c_str(), row["decode_bound_ms"].get<double>(), frac.c_str(),
                double(row["peak_rss_bytes"].get<int64_t>()) * 1e-9, row["peak_rss_over_weights"].get<double>());
  }
  std::printf("bound: weight bytes one decode token reads (as the engine holds them) / the read bandwidth probed "
              "just before and after that engine (best of the two); GFLOP/s counts matmuls, causal attention and "
              "last-row logits.\n");
  for (const json& row : rows)
    if (row.contains("weights") && row.contains("engine"))
      std::printf("%s weights: %s (as `llmdiff dump` holds them)\n", row["engine"].get<std::string>().c_str(),
                  row["weights"].get<std::string>().c_str());
  if (rows.size() == 2 && !rows[0].contains("error") && !rows[1].contains("error")) {
    const auto a = rows[0]["generated"].get<std::vector<int64_t>>(), b = rows[1]["generated"].get<std::vector<int64_t>>();
    size_t same = 0;
    while (same < a.size() && same < b.size() && a[same] == b[same]) ++same;
    if (same < a.size() || same < b.size())
      std::printf("greedy tokens: the engines agree on the first %zu of %zu (%s %lld vs %s %lld next); "
                  "`llmdiff run` shows where they part.\n",
                  same, std::max(a.size(), b.size()), rows[0]["engine"].get<std::string>().c_str(),
                  same < a.size() ? (long long)a[same] : -1LL, rows[1]["engine"].get<std::string>().c_str(),
                  same < b.size() ? (long long)b[same] : -1LL);
    else
      std::printf("greedy tokens: the engines agree on all %zu.\n", a.size());
  }
}

// One pipeline run of --e2e or --bisect: its phases, total, peak RSS and verdict.
void print_pipeline(const json& r, const std::string& title) {
  std::printf("\n%s\n", title.c_str());
  if (r.contains("error")) {
    std::printf("  error: %s\n", r["error"].get<std::string>().c_str());
    return;
  }
  int width = 40;
  for (const auto& p : r["phases"]) width = std::max(width, int(p["phase"].get<std::string>().size()));
  for (const auto& p : r["phases"])
    std::printf("  %-*s %7.2f s\n", width, p["phase"].get<std::string>().c_str(), p["seconds"].get<double>());
  const double total = r["seconds"].get<double>(), plain = r["plain_forward_seconds"].get<double>();
  std::printf("  total %.2f s (%.1fx the plain impl forward of the same calls, %.2f s), peak RSS %.2f GB\n", total,
              plain > 0 ? total / plain : 0.0, plain, double(r["peak_rss_bytes"].get<int64_t>()) * 1e-9);
  // What `llmdiff bisect` of a candidate dump does: every phase after the candidate's own run.
  if (r.contains("bisect_seconds"))
    std::printf("  the bisect alone (every phase after the candidate's run) %.2f s\n", r["bisect_seconds"].get<double>());
  std::printf("  %zu names compared, %zu diverging; %zu local sites, %zu failing; exit code %d\n",
              r["compared"].get<size_t>(), r["diverging"].get<size_t>(), r["local_sites"].get<size_t>(),
              r["local_failing"].get<size_t>(), r["exit_code"].get<int>());
  if (!r["localised_at"].get<std::string>().empty())
    std::printf("  localised at %s; diagnosis: %s\n", r["localised_at"].get<std::string>().c_str(),
                r["diagnosis"].get<std::string>().empty() ? "no bug of the zoo fits"
                                                          : r["diagnosis"].get<std::string>().c_str());
}

// The bugs `--bisect all` times: every zoo bug that changes this model's
// forward pass in a single sequence (not the sampler's, the batch's, the
// serving features' or the ranks' bugs, nor those acting only on padding).
std::vector<std::string> model_bugs(const ModelConfig& c) {
  std::vector<std::string> out;
  for (const zoo::BugInfo& info : zoo::all_bugs())
    if (info.acts_on_model() && !info.needs_padding && info.feature == zoo::Feature::None &&
        zoo::bug_inapplicable_reason(info.bug, c).empty())
      out.push_back(info.name);
  return out;
}

// `--bisect all`: one row per bug, as `llmdiff bisect` of its candidate.
void print_bisect_table(const json& rows, const BenchOptions& o) {
  std::printf("\n`llmdiff run --inject BUG` for every bug of the zoo this model has (bisect of a candidate with the "
              "bug), prompt %d + %d decode steps; bisect = every phase after the candidate's own run, of which "
              "passes = the four passes:\n",
              o.prompt, o.e2e_decode);
  std::printf("  %-26s %9s %9s %9s %9s  %-40s %s\n", "bug", "total s", "bisect s", "passes s", "peak GB",
              "localised at", "named");
  int named = 0;
  double worst = 0;
  for (const json& r : rows) {
    const std::string bug = r["injected"].get<std::string>();
    if (r.contains("error")) {
      std::printf("  %-26s error: %s\n", bug.c_str(), r["error"].get<std::string>().c_str());
      continue;
    }
    const std::string diag = r["diagnosis"].get<std::string>();
    const bool right = diag == bug || diag.rfind(bug + "=", 0) == 0;
    named += right;
    worst = std::max(worst, r["bisect_seconds"].get<double>());
    std::printf("  %-26s %9.2f %9.2f %9.2f %9.2f  %-40s %s\n", bug.c_str(), r["seconds"].get<double>(),
                r["bisect_seconds"].get<double>(), r["passes_seconds"].get<double>(),
                double(r["peak_rss_bytes"].get<int64_t>()) * 1e-9,
                r["localised_at"].get<std::string>().c_str(),
                right ? "yes" : (diag.empty() ? "no (no bug of the zoo fits)" : ("no: " + diag).c_str()));
  }
  std::printf("  %d of %zu named; the longest bisect %.2f s\n", named, rows.size(), worst);
}

void print_batch(const json& rows, const BenchOptions& o) {
  std::printf("\nimpl continuous batching: each sequence %d prompt + %d decode tokens, all arriving at once (the "
              "first iteration prefills them packed, each later one decodes a token of every sequence):\n",
              o.prompt, o.decode);
  std::printf("  sequences  prefill tok/s  decode tok/s  decode ms/iteration  peak RSS\n");
  for (const json& r : rows) {
    if (r.contains("error")) {
      std::printf("  %9d  failed: %s\n", r["sequences"].get<int>(), r["error"].get<std::string>().c_str());
      continue;
    }
    std::printf("  %9d  %13.1f  %12.1f  %19.2f  %5.2f GB\n", r["sequences"].get<int>(), r["prefill_tok_s"].get<double>(),
                r["decode_tok_s"].get<double>(), r["decode_ms_per_iteration"].get<double>(),
                double(r["peak_rss_bytes"].get<int64_t>()) * 1e-9);
  }
  for (const json& r : rows)
    if (r.contains("invariance") && r["invariance"].is_object())
      std::printf("batch invariance: seq0 served with %d others vs alone, next_logits max |diff| / max |logit|: "
                  "prefill %.2g, decode steps %.2g\n",
                  r["sequences"].get<int>() - 1, r["invariance"]["prefill_max_rel"].get<double>(),
                  r["invariance"]["decode_max_rel"].get<double>());
}

void print_e2e(const json& e) {
  std::printf("\nend to end (`llmdiff run` equivalent: prompt %d + %d decode steps, every site, both engines):\n",
              e["prompt"].get<int>(), e["decode"].get<int>());
  if (e.contains("error")) {
    std::printf("  error: %s\n", e["error"].get<std::string>().c_str());
    return;
  }
  for (const std::string which : {"ref", "impl"}) {
    const json& r = e[which];
    std::printf("  %-5s %-9s load %6.2f s  run %7.2f s  dump %5zu tensors %7.3f GB  write %6.2f s\n", which.c_str(),
                r["dtype"].get<std::string>().c_str(), r["load_s"].get<double>(), r["run_s"].get<double>(),
                r["tensors"].get<size_t>(), double(r["dump_bytes"].get<uint64_t>()) * 1e-9, r["save_s"].get<double>());
  }
  std::printf("  diff  in memory %.2f s (%.2f GB/s), from files %.2f s (%.2f GB/s); %zu names compared at %s "
              "tolerances, %zu failing%s%s\n",
              e["diff_memory"]["seconds"].get<double>(), e["diff_memory"]["gbs"].get<double>(),
              e["diff_files"]["seconds"].get<double>(), e["diff_files"]["gbs"].get<double>(),
              e["compared"].get<size_t>(), e["diff_dtype"].get<std::string>().c_str(), e["failing"].get<size_t>(),
              e["first_divergence"].get<std::string>().empty() ? "" : ", first ",
              e["first_divergence"].get<std::string>().c_str());
  std::printf("  peak RSS %.2f GB\n", double(e["peak_rss_bytes"].get<int64_t>()) * 1e-9);
  if (e.contains("run"))
    print_pipeline(e["run"], "`llmdiff run` with its defaults (float64 noise floor, local errors, diagnosis), same forward calls:");
}

}  // namespace

int run_bench(const BenchOptions& o) {
  if (o.model.empty()) throw UsageError("bench: --model DIR is required");
  if (o.prompt < 1) throw UsageError("bench: --prompt must be at least 1");
  if (o.decode < 0) throw UsageError("bench: --decode must not be negative");
  if (o.repeats < 1) throw UsageError("bench: --repeats must be at least 1");
  if (o.bandwidth_mib < 1) throw UsageError("bench: --bandwidth-mib must be at least 1");
  if (o.e2e_decode < 0) throw UsageError("bench: --e2e-decode must not be negative");
  std::vector<std::string> engines = o.engines;
  if (engines == std::vector<std::string>{"none"}) engines.clear();
  if (o.serving == 1 || o.serving < 0)
    throw UsageError("bench: --serving needs at least 2 requests (they share the first half of the prompt)");
  if (o.serving > 0 && o.prompt < 2) throw UsageError("bench: --serving needs a --prompt of at least 2 tokens");
  if (engines.empty() && !o.e2e && o.bisect.empty() && o.batch == 0 && o.serving == 0)
    throw UsageError("bench: --engines lists no engine (use ref, impl or ref,impl)");
  if (!o.bisect.empty() && o.bisect != "all") zoo::parse_bug(o.bisect);  // an unknown bug: a usage error first
  for (const auto& e : engines)
    if (e != "ref" && e != "impl") throw UsageError("bench: unknown engine '" + e + "' (use ref, impl or none)");

  const ModelFacts facts = model_facts(o.model, o.prompt);
  const ModelConfig& c = facts.config;
  const int longest = o.prompt + std::max(o.decode, o.e2e ? o.e2e_decode : 0);
  if (longest > c.max_position_embeddings)
    throw UsageError("bench: prompt + decode tokens exceed max_position_embeddings " +
                     std::to_string(c.max_position_embeddings));
  const ComputeDType ref_dtype = o.ref_dtype.empty() ? c.default_dtype() : parse_compute_dtype(o.ref_dtype);

  // The machine's bandwidth varies with what else runs on it: probe it before
  // and after the engines and keep the best pass.
  if (!o.json_out) std::fprintf(stderr, "bench: measuring read bandwidth ...\n");
  BandwidthResult bw = probe_bandwidth(o, 5);

  // Each engine in its own child, so that its peak RSS is its own. The
  // bandwidth is probed again between engines: each engine's bound uses the
  // probes just before and after it (a shared machine's bandwidth drifts).
  json rows = json::array();
  std::vector<double> probe_best{bw.best_gbs};  // [engines + 1]: before each engine, then after the last
  bool failed = false;
  for (const auto& e : engines) {
    if (!rows.empty()) {
      const BandwidthResult between = probe_bandwidth(o, 5);
      bw.all_gbs.insert(bw.all_gbs.end(), between.all_gbs.begin(), between.all_gbs.end());
      bw.best_gbs = std::max(bw.best_gbs, between.best_gbs);
      probe_best.push_back(between.best_gbs);
    }
    if (!o.json_out) std::fprintf(stderr, "bench: timing %s ...\n", e.c_str());
    const ChildOutcome out = run_in_child([&] { return bench_engine(o, e, ref_dtype); });
    json row;
    if (out.ok) {
      row = json::parse(out.output);
    } else {
      row = {{"engine", e}, {"error", out.failure}};
      failed = true;
    }
    row["peak_rss_bytes"] = out.maxrss_bytes;
    rows.push_back(row);
  }

  json e2e;
  if (o.e2e) {
    if (!o.json_out) std::fprintf(stderr, "bench: end-to-end run ...\n");
    namespace fs = std::filesystem;
    const bool temporary = o.e2e_dir.empty();
    const std::string dir = temporary ? (fs::temp_directory_path() / ("llmdiff-bench-" + std::to_string(::getpid()))).string()
                                      : o.e2e_dir;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw IoError(dir, "cannot create directory: " + ec.message());
    const ChildOutcome out = run_in_child([&] { return bench_e2e(o, ref_dtype, dir); });
    if (temporary) fs::remove_all(dir, ec);
    if (out.ok) {
      e2e = json::parse(out.output);
    } else {
      e2e = {{"prompt", o.prompt}, {"decode", o.e2e_decode}, {"error", out.failure}};
      failed = true;
    }
    e2e["peak_rss_bytes"] = out.maxrss_bytes;
    if (!o.json_out) std::fprintf(stderr, "bench: llmdiff run with its defaults ...\n");
    const ChildOutcome full = run_in_child([&] { return bench_run_pipeline(o, {}); });
    json run = full.ok ? json::parse(full.output) : json{{"error", full.failure}};
    if (!full.ok) failed = true;
    run["peak_rss_bytes"] = full.maxrss_bytes;
    e2e["run"] = run;
  }

  json bis, compute;
  const std::vector<std::string> bisected = o.bisect == "all" ? model_bugs(c) : std::vector<std::string>{o.bisect};
  if (!o.bisect.empty()) {
    json rows = json::array();
    for (const std::string& bug : bisected) {
      if (!o.json_out) std::fprintf(stderr, "bench: bisect of an impl candidate with %s ...\n", bug.c_str());
      const ChildOutcome out = run_in_child([&] { return bench_run_pipeline(o, {bug}); });
      json row = out.ok ? json::parse(out.output) : json{{"injected", bug}, {"error", out.failure}};
      if (!out.ok) failed = true;
      row["peak_rss_bytes"] = out.maxrss_bytes;
      rows.push_back(row);
    }
    bis = o.bisect == "all" ? rows : rows[0];
    if (!o.json_out) std::fprintf(stderr, "bench: measuring the products' throughput ...\n");
    const ChildOutcome out = run_in_child([&] { return bisect_compute(o, facts); });
    compute = out.ok ? json::parse(out.output) : json{{"error", out.failure}};
    if (!out.ok) failed = true;
  }

  json batch = json::array();
  if (o.batch > 0) {
    for (const int n : std::vector<int>{1, o.batch}) {
      if (n == 1 && o.batch == 1 && !batch.empty()) break;
      if (!o.json_out) std::fprintf(stderr, "bench: continuous batching, %d sequence%s ...\n", n, n == 1 ? "" : "s");
      const ChildOutcome out = run_in_child([&] { return bench_batch(o, n); });
      json row = out.ok ? json::parse(out.output) : json{{"sequences", n}, {"error", out.failure}};
      if (!out.ok) failed = true;
      row["peak_rss_bytes"] = out.maxrss_bytes;
      batch.push_back(row);
    }
  }

  json serving;
  if (o.serving > 0) serving = bench_serving(o, &failed);

  if (!o.json_out) std::fprintf(stderr, "bench: measuring read bandwidth again ...\n");
  const BandwidthResult after = probe_bandwidth(o, 5);
  bw.all_gbs.insert(bw.all_gbs.end(), after.all_gbs.begin(), after.all_gbs.end());
  bw.best_gbs = std::max(bw.best_gbs, after.best_gbs);
  probe_best.push_back(after.best_gbs);
  for (size_t i = 0; i < rows.size(); ++i) {
    json& row = rows[i];
    const double engine_gbs = std::max(probe_best[i], probe_best[i + 1]);
    row["peak_rss_over_weights"] = double(row["peak_rss_bytes"].get<int64_t>()) / double(facts.weight_bytes);
    if (row.contains("error")) continue;
    // Weights as the engine reads them: the impl reads them as stored from
    // the mmap (ggml blocks included); the ref holds them in its compute dtype.
    const double bytes = row["engine"] == "impl" ? double(facts.decode_bytes)
                                                  : double(facts.decode_params) * double(compute_dtype_size(ref_dtype));
    const double bound_ms = bytes / (engine_gbs * 1e9) * 1e3;
    row["bandwidth_gbs"] = engine_gbs;
    row["decode_bytes_per_token"] = bytes;
    row["decode_bound_ms"] = bound_ms;
    const Stat ps = stat_of(row["prefill_tok_s"].get<std::vector<double>>());
    row["prefill"] = {{"best_tok_s", ps.max}, {"median_tok_s", ps.median}, {"worst_tok_s", ps.min},
                      {"best_gflops", facts.prefill_flops * ps.max / o.prompt * 1e-9}};
    const std::vector<double> dm = row["decode_ms_per_token"].get<std::vector<double>>();
    if (!dm.empty()) {
      const Stat ds = stat_of(dm);
      row["decode"] = {{"best_ms", ds.min},
                       {"median_ms", ds.median},
                       {"worst_ms", ds.max},
                       {"fraction_of_bound", bound_ms / ds.min}};
    }
  }

  if (o.json_out) {
    json j = {{"model", o.model},
              {"model_type", c.model_type},
              {"layers", c.num_hidden_layers},
              {"hidden_size", c.hidden_size},
              {"intermediate_size", c.intermediate_size},
              {"vocab_size", c.vocab_size},
              {"storage_dtype", dtype_name(facts.storage)},
              {"storage", facts.storage_label},
              {"parameters", facts.params},
              {"weight_bytes", facts.weight_bytes},
              {"prompt", o.prompt},
              {"decode", o.decode},
              {"repeats", o.repeats},
              {"threads", bw.threads},
              {"cpu", cpu_name()},
              {"blas", blas_config()},
              {"blas_note", forced_blas_core_note()},
              {"bandwidth", {{"best_gbs", bw.best_gbs}, {"all_gbs", bw.all_gbs}, {"buffer_bytes", bw.buffer_bytes}}},
              {"engines", rows}};
    if (o.e2e) j["e2e"] = e2e;
    if (!o.bisect.empty()) j["bisect"] = bis;
    if (!o.bisect.empty()) j["bisect_compute"] = compute;
    if (o.batch > 0) j["batch"] = batch;
    if (o.serving > 0) j["serving"] = serving;
    std::printf("%s\n", j.dump(2).c_str());
    return failed ? 2 : 0;
  }

  std::printf("model %s: %s, %lld layers, hidden %lld, intermediate %lld, heads %lld/%lld, vocab %lld%s\n",
              o.model.c_str(), c.model_type.c_str(), (long long)c.num_hidden_layers, (long long)c.hidden_size,
              (long long)c.intermediate_size, (long long)c.num_attention_heads, (long long)c.num_key_value_heads,
              (long long)c.vocab_size, c.tie_word_embeddings ? ", tied" : "");
  std::printf("weights: %.3f B parameters, %.2f GB %s\n", double(facts.params) * 1e-9, double(facts.weight_bytes) * 1e-9,
              facts.storage_label.c_str());
  print_machine();
  if (!rows.empty())
    std::printf("run: prompt %d tokens, decode %d tokens, %d repeat%s, %d thread%s\n", o.prompt, o.decode,
                o.repeats, o.repeats == 1 ? "" : "s", bw.threads, bw.threads == 1 ? "" : "s");
  std::printf("read bandwidth: %.1f GB/s (best of %zu passes over %zu MiB before, between and after the engines, %d "
              "thread%s)\n",
              bw.best_gbs,
              bw.all_gbs.size(), bw.buffer_bytes >> 20, bw.threads, bw.threads == 1 ? "" : "s");
  if (!rows.empty()) {
    std::printf("\n");
    print_engine_table(rows);
  }
  if (o.e2e) print_e2e(e2e);
  if (o.batch > 0) print_batch(batch, o);
  if (o.serving > 0) print_serving(serving);
  if (o.bisect == "all") print_bisect_table(bis, o);
  if (!o.bisect.empty() && o.bisect != "all")
    print_pipeline(bis, "`llmdiff run --inject " + o.bisect + "` (bisect of a candidate with the bug: noise floor, local "
                        "errors, diagnosis), prompt " + std::to_string(o.prompt) + " + " + std::to_string(o.e2e_decode) +
                        " decode steps:");
  if (!o.bisect.empty()) print_compute(compute);
  return failed ? 2 : 0;
}


}  // namespace llmdiff::bench
