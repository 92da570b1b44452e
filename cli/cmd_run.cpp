// llmdiff run --model DIR (--tokens 1,2,3 | --replay DUMP) [--decode N]
//   [--chunks 4,3] [--inject BUG]... [--out FILE] [bisect options]
// The ref against the impl in one process: the impl (with --inject, a buggy
// impl) is the candidate; its forward calls are replayed through the ref and
// the run ends with the bisection and, on a divergence, a diagnosis.
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/bisect_cli.h"
#include "dumps/base/errors.h"

namespace llmdiff::cli {

struct RunOptions {
  std::string model, out;
  ScenarioCliOptions scenario;
  std::vector<std::string> inject;
  std::string precision;
  int64_t max_seq = 0;
  BisectCliOptions bisect;
};

namespace {

int run_run(const RunOptions& o) {
  if (o.model.empty()) throw UsageError("--model is required");
  Scenario sc = o.scenario.scenario();
  PhaseLog log(o.bisect.verbose);
  bisect::ModelOracles m(o.model, o.bisect.threads);
  m.set_memory_budget(parse_memory_budget(o.bisect.memory_budget));
  log("model loaded");
  EngineOptions eo;
  eo.threads = o.bisect.threads;
  eo.max_seq = o.max_seq;
  eo.inject = o.inject;
  eo.precision = o.precision;
  // --sites: the impl records only those names (unrecorded sites cost nothing);
  // a glob without a step prefix applies to every step, as in the comparison.
  std::vector<std::string> record;
  for (const auto& g : split_list(o.bisect.sites)) {
    record.push_back(g);
    if (g.compare(0, 4, "step") != 0) record.push_back("step*." + g);
  }
  if (!record.empty()) {
    // The forward calls themselves are always kept: the ref replays them.
    for (const char* g : {"step*.tokens", "step*.positions", "generated"}) record.push_back(g);
  }
  std::unique_ptr<MemoryDump> cand = bisect::run_impl_candidate(m, sc, eo, record);
  log("candidate run (impl)");
  if (!o.out.empty()) cand->save(o.out);
  compare::BisectResult r = bisect::bisect_impl_candidate(m, *cand, !o.inject.empty(), bisect_options(o.bisect, &log));
  return emit_bisect(r, o.bisect);
}

}  // namespace

void setup_run(CLI::App& app, Action& action) {
  auto o = std::make_shared<RunOptions>();
  CLI::App* sub = app.add_subcommand(
      "run", "Run the impl (optionally with zoo bugs) against the ref in one process: first divergence, local "
             "errors and diagnosis");
  sub->add_option("--model", o->model, "HF model directory (config.json + safetensors) or GGUF file");
  add_scenario_options(*sub, o->scenario);
  sub->add_option("--inject", o->inject, "switch on a bug of the zoo in the impl (repeatable; see dump --list-bugs)");
  sub->add_option("--max-seq", o->max_seq, "impl KV cache capacity (default: max_position_embeddings)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--precision", o->precision,
                  "roundings the impl makes made on purpose, KEY=VALUE,...: kv_cache=f16|bf16 (a 16-bit KV cache), "
                  "matmul_input=f16|bf16|q8_0|q8_k (every matmul input rounded so) or ggml (as llama.cpp's CPU "
                  "backend: 16-bit inputs for 16-bit weights, 8-bit blocks for quantised ones); written to the "
                  "manifest (key precision)");
  sub->add_option("--out", o->out, "also save the impl's dump (the candidate) to this file");
  add_bisect_cli_options(*sub, o->bisect);
  sub->callback([o, &action] { action = [o] { return run_run(*o); }; });
}

}  // namespace llmdiff::cli
