// llmdiff bench --serving N (bench/serving.h).
#include "bench/serving.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/support.h"
#include "dumps/contract/observer.h"
#include "dumps/model/weights.h"
#include "impl/batch_engine.h"

namespace llmdiff::bench {

namespace {

using nlohmann::json;

// The features' settings: the engine's defaults where it has them.
constexpr int64_t kBlockSize = 16;
constexpr int kSpecK = 4, kDraftLayers = 1, kRanks = 2;
constexpr int64_t kBucket = 16;
// Request 0's prompt is computed at iteration 0, the others' at 1: every
// later iteration decodes.
constexpr size_t kFirstDecodeIteration = 2;

struct Configuration {
  std::string name;     // the JSON's "configuration"
  std::string setting;  // the same as `llmdiff dump --batch` flags
  std::function<void(impl::BatchEngineOptions&)> apply;
};

std::vector<Configuration> configurations() {
  const std::string k = std::to_string(kSpecK);
  return {
      {"baseline", "", [](impl::BatchEngineOptions&) {}},
      {"prefix-cache", "--prefix-cache", [](impl::BatchEngineOptions& b) { b.prefix_cache = true; }},
      {"spec-ngram", "--speculative ngram --spec-k " + k,
       [](impl::BatchEngineOptions& b) {
         b.speculative = "ngram";
         b.spec_k = kSpecK;
       }},
      {"spec-draft", "--speculative draft --spec-k " + k + " --draft-layers " + std::to_string(kDraftLayers),
       [](impl::BatchEngineOptions& b) {
         b.speculative = "draft";
         b.spec_k = kSpecK;
         b.draft_layers = kDraftLayers;
       }},
      {"bucket", "--bucket " + std::to_string(kBucket), [](impl::BatchEngineOptions& b) { b.bucket = kBucket; }},
      {"tp2", "--tp " + std::to_string(kRanks), [](impl::BatchEngineOptions& b) { b.tensor_parallel = kRanks; }},
  };
}

// N requests: the shared first half of the prompt (seed), each its own
// second half (seed + 1 + b).
std::vector<impl::BatchRequest> serving_requests(const BenchOptions& o, int64_t vocab) {
  const int shared = o.prompt / 2;
  const std::vector<int64_t> prefix = bench_prompt(vocab, shared, o.seed);
  std::vector<impl::BatchRequest> requests(size_t(o.serving));
  for (int b = 0; b < o.serving; ++b) {
    impl::BatchRequest& r = requests[size_t(b)];
    r.prompt = prefix;
    const std::vector<int64_t> own = bench_prompt(vocab, o.prompt - shared, o.seed + 1 + uint64_t(b));
    r.prompt.insert(r.prompt.end(), own.begin(), own.end());
    r.join = b == 0 ? 0 : 1;
    r.decode = o.decode;
  }
  return requests;
}

double ratio(double num, double den) { return den > 0 ? num / den : 0.0; }

// The child's work: the requests served `repeats` times under one
// configuration, nothing observed; best wall time, prefill time and decode
// speed, the features' counts (the same every run: each starts from an
// empty pool).
std::string serve_configuration(const BenchOptions& o, const Configuration& c) {
  const Model model = Model::load(o.model);
  const std::vector<impl::BatchRequest> requests = serving_requests(o, model.config.vocab_size);
  impl::BatchEngineOptions bo;
  bo.threads = o.threads;
  bo.block_size = kBlockSize;
  c.apply(bo);
  impl::BatchEngine engine(model, bo);
  NullObserver nobs;
  double wall = 1e300, prefill = 1e300, decode_tok_s = 0, decode_s = 0;
  impl::BatchOutcome out;
  int64_t decode_tokens = 0;
  for (int r = 0; r < o.repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    out = engine.run(requests, nobs);
    wall = std::min(wall, seconds_since(t0));
    double p = 0, d = 0;
    decode_tokens = 0;
    for (size_t i = 0; i < out.iteration_seconds.size(); ++i) {
      if (i < kFirstDecodeIteration) {
        p += out.iteration_seconds[i];
      } else {
        d += out.iteration_seconds[i];
        decode_tokens += out.iteration_generated[i];
      }
    }
    prefill = std::min(prefill, p);
    if (d > 0 && decode_tokens / d > decode_tok_s) decode_tok_s = decode_tokens / d, decode_s = d;
  }
  int64_t generated = 0;
  for (const auto& g : out.generated) generated += int64_t(g.size());
  const int64_t real_rows = out.rows - out.padded_rows;
  return json{{"configuration", c.name},
              {"setting", c.setting},
              {"producer", engine.producer()},
              {"wall_s", wall},
              {"prefill_s", prefill},
              {"decode_s", decode_s},
              {"decode_tokens", decode_tokens},
              {"decode_tok_s", decode_tok_s},
              {"generated_tokens", generated},
              {"iterations", out.iterations},
              {"prompt_tokens", out.prompt_tokens},
              {"prefix_hit_tokens", out.prefix_hit_tokens},
              {"hit_rate", ratio(double(out.prefix_hit_tokens), double(out.prompt_tokens))},
              {"drafts_proposed", out.drafts_proposed},
              {"drafts_accepted", out.drafts_accepted},
              {"acceptance", out.drafts_proposed > 0 ? json(double(out.drafts_accepted) / double(out.drafts_proposed))
                                                     : json(nullptr)},
              {"rows", out.rows},
              {"padded_rows", out.padded_rows},
              {"padding_overhead", ratio(double(out.padded_rows), double(real_rows))},
              {"generated", out.generated}}
      .dump();
}

}  // namespace

json bench_serving(const BenchOptions& o, bool* failed) {
  json rows = json::array();
  for (const Configuration& c : configurations()) {
    if (!o.json_out) std::fprintf(stderr, "bench: serving %d requests, %s ...\n", o.serving, c.name.c_str());
    const ChildOutcome out = run_in_child([&] { return serve_configuration(o, c); });
    json row = out.ok ? json::parse(out.output)
                      : json{{"configuration", c.name}, {"setting", c.setting}, {"error", out.failure}};
    if (!out.ok) *failed = true;
    row["peak_rss_bytes"] = out.maxrss_bytes;
    rows.push_back(row);
  }
  // Each configuration against the baseline (the first row).
  const json base = rows[0];
  for (json& r : rows) {
    if (r.contains("error") || base.contains("error")) continue;
    const double wall = r["wall_s"].get<double>(), base_wall = base["wall_s"].get<double>();
    r["wall_over_baseline"] = ratio(wall, base_wall);
    r["time_saved_s"] = base_wall - wall;
    r["decode_speedup"] = ratio(r["decode_tok_s"].get<double>(), base["decode_tok_s"].get<double>());
    r["same_tokens_as_baseline"] = r["generated"] == base["generated"];
  }
  for (json& r : rows) r.erase("generated");
  return json{{"requests", o.serving},
              {"prompt", o.prompt},
              {"shared_prefix", o.prompt / 2},
              {"decode", o.decode},
              {"block_size", kBlockSize},
              {"repeats", o.repeats},
              {"decode_from_iteration", kFirstDecodeIteration},
              {"configurations", rows}};
}

void print_serving(const json& s) {
  std::printf(
      "\nimpl serving features: %d requests of %d prompt tokens (the first %d shared by all) + %d decode "
      "tokens; request 0 at iteration 0, the others at 1 (after it computed the shared prefix); blocks of "
      "%lld; best of %d:\n",
      s["requests"].get<int>(), s["prompt"].get<int>(), s["shared_prefix"].get<int>(), s["decode"].get<int>(),
      (long long)s["block_size"].get<int64_t>(), s["repeats"].get<int>());
  std::printf("  %-13s %-47s %8s %8s %8s %9s %12s %8s  %-32s %6s %8s\n", "configuration", "setting", "wall s",
              "vs base", "saved s", "prefill s", "decode tok/s", "speedup", "the feature", "tokens", "peak RSS");
  for (const json& r : s["configurations"]) {
    const std::string name = r["configuration"], setting = r["setting"];
    if (r.contains("error")) {
      std::printf("  %-13s %-47s failed: %s\n", name.c_str(), setting.c_str(), r["error"].get<std::string>().c_str());
      continue;
    }
    char vs[32] = "-", saved[32] = "-", feature[64] = "-", same[8] = "-";
    if (r.contains("wall_over_baseline") && name != "baseline") {
      std::snprintf(vs, sizeof vs, "%.2fx", r["wall_over_baseline"].get<double>());
      std::snprintf(saved, sizeof saved, "%+.3f", r["time_saved_s"].get<double>());
      std::snprintf(same, sizeof same, "%s", r["same_tokens_as_baseline"].get<bool>() ? "same" : "differ");
    }
    if (r["prefix_hit_tokens"].get<int64_t>() > 0 || name == "prefix-cache") {
      std::snprintf(feature, sizeof feature, "hit %.1f%% (%lld of %lld tokens)", 100 * r["hit_rate"].get<double>(),
                    (long long)r["prefix_hit_tokens"].get<int64_t>(), (long long)r["prompt_tokens"].get<int64_t>());
    } else if (r["drafts_proposed"].get<int64_t>() > 0 || name.rfind("spec-", 0) == 0) {
      const double acc = r["acceptance"].is_null() ? 0.0 : r["acceptance"].get<double>();
      std::snprintf(feature, sizeof feature, "accepted %.1f%% (%lld of %lld drafts)", 100 * acc,
                    (long long)r["drafts_accepted"].get<int64_t>(), (long long)r["drafts_proposed"].get<int64_t>());
    } else if (r["padded_rows"].get<int64_t>() > 0 || name == "bucket") {
      std::snprintf(feature, sizeof feature, "padding %.1f%% (%lld rows)", 100 * r["padding_overhead"].get<double>(),
                    (long long)r["padded_rows"].get<int64_t>());
    }
    std::printf("  %-13s %-47s %8.3f %8s %8s %9.3f %12.1f %7.2fx  %-32s %6s %5.2f GB\n", name.c_str(),
                setting.empty() ? "-" : setting.c_str(), r["wall_s"].get<double>(), vs, saved,
                r["prefill_s"].get<double>(), r["decode_tok_s"].get<double>(), r.value("decode_speedup", 0.0), feature,
                same, double(r["peak_rss_bytes"].get<int64_t>()) * 1e-9);
  }
  std::printf(
      "wall s: serving every request, best of the repeats; vs base, saved s: against the baseline's; prefill s: "
      "iterations 0 and 1 (every prompt); decode tok/s: tokens generated per second from iteration %lld on "
      "(every sequence decoding; drafting included); speedup: of decode tok/s; hit: prompt tokens served "
      "from the prefix cache; accepted: drafts kept of those verified; padding: rows of no sequence over "
      "the real rows; tokens: the generated tokens against the baseline's (greedy).\n",
      (long long)s["decode_from_iteration"].get<int64_t>());
}

}  // namespace llmdiff::bench
