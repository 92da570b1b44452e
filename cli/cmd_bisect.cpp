// llmdiff bisect --model DIR CANDIDATE [--no-noise-floor] [--no-local]
//   [--no-diagnose] [--json] [--all] [--report FILE.md] [--html FILE.html] [--junit FILE.xml] [--sites GLOB,...]
//   [--tol GLOB=SPEC]... [--rtol X] [--atol X] [--threads N] [--layers A:B] [--against B]
// An external dump (any producer) against the ref: the candidate's own
// forward calls are replayed through the ref at the candidate's compute dtype
// and in float64; the first divergence (noise floor), the local errors
// (teacher forcing) and a diagnosis from the bug zoo. With --against B: the
// same engine's dumps of the same requests under two configurations, each
// side bisected, the sequences paired by prompt, one verdict per pair
// (docs/AGAINST.md).
#include "bisect/against.h"
#include "cli/commands.h"
#include "cli/bisect_cli.h"
#include "dumps/base/errors.h"
#include "bisect/tensor_parallel.h"
#include "dumps/contract/ranks.h"
#include "dumps/contract/sequences.h"

namespace llmdiff::cli {

struct BisectCommandOptions {
  std::string model, candidate;
  std::string source;  // full-precision checkpoint of a quantised --model
  std::string layers;  // --layers A:B: a shard (dumps/contract/layer_window.h)
  std::string against;  // --against B: the other configuration's dump (compare/against.h)
  BisectCliOptions bisect;
};

namespace {

int run_bisect(const BisectCommandOptions& o) {
  if (o.model.empty()) throw UsageError("--model is required (the HF model directory the candidate ran)");
  if (o.candidate.empty()) throw UsageError("a candidate dump is required");
  DumpFile cand(o.candidate);
  PhaseLog log(o.bisect.verbose);
  bisect::ModelOracles m(o.model, o.bisect.threads);
  m.set_memory_budget(parse_memory_budget(o.bisect.memory_budget));
  log("model loaded");
  bisect::BisectOptions opt = bisect_options(o.bisect, &log);
  opt.source = o.source;
  if (!o.layers.empty()) {
    opt.layers = parse_layer_window(o.layers, int(m.model.config.num_hidden_layers));
    if (!o.source.empty()) throw UsageError("--layers: --source compares every layer; run it without shards");
  }
  if (!o.against.empty()) {
    if (!o.source.empty()) throw UsageError("--source: not with --against (bisect each configuration with it)");
    if (!o.layers.empty()) throw UsageError("--layers: --against bisects both configurations whole");
    if (!o.bisect.junit.empty()) throw UsageError("--junit: not with --against (text, --json, --report, --html)");
    DumpFile other(o.against);
    return emit_against(bisect::bisect_against(m, cand, other, opt), o.bisect);
  }
  if (cand.manifest().extra.count(tensor_parallel_key())) {
    // Tensor parallel: judged unsharded and rank by rank (bisect/tensor_parallel.h).
    if (!o.source.empty()) throw UsageError("--source: a tensor-parallel candidate is not supported");
    if (!dump_sequences(RankView(cand, m.model.config)).empty())
      return emit_batch_bisect(bisect::bisect_tensor_parallel_batch(m, cand, opt), o.bisect);
    return emit_bisect(bisect::bisect_tensor_parallel(m, cand, opt), o.bisect);
  }
  if (!dump_sequences(cand).empty()) {
    // Several sequences: each bisected against the reference running it alone.
    if (!o.source.empty()) throw UsageError("--source: a several-sequence candidate is not supported");
    if (!o.layers.empty()) throw UsageError("--layers: bisect a several-sequence candidate whole");
    return emit_batch_bisect(bisect::bisect_batch(m, cand, opt), o.bisect);
  }
  return emit_bisect(bisect::bisect_candidate(m, cand, opt), o.bisect);
}

}  // namespace

void setup_bisect(CLI::App& app, Action& action) {
  auto o = std::make_shared<BisectCommandOptions>();
  CLI::App* sub = app.add_subcommand(
      "bisect", "Find where an external dump first diverges from the reference, which op is wrong by itself "
                "(local errors), and which bug of the zoo explains it");
  sub->add_option("--model", o->model, "HF model directory (config.json + safetensors) or GGUF file the candidate ran");
  sub->add_option("candidate", o->candidate, "the candidate's llm-dump/1 file");
  sub->add_option("--source", o->source,
                  "the full-precision checkpoint (HF directory or GGUF) a quantised --model was made from: adds a "
                  "table of how much of the divergence, layer by layer, the quantisation alone explains");
  sub->add_option("--layers", o->layers,
                  "analyse only layers A to B-1 (A:B), every run starting from the candidate's residual stream "
                  "entering layer A: a shard, one process each, joined by `llmdiff merge` (use with --json)");
  sub->add_option("--against", o->against,
                  "the same engine's dump of the same requests under another configuration (batch 1 vs N, chunk "
                  "sizes, prefix cache cold vs warm, speculative decoding, ring vs paged cache): each side bisected "
                  "with its own noise floor, sequences paired by prompt, one verdict per pair: legitimate (the first "
                  "op where they differ, the largest difference over the noise floor, greedy flips at near-ties) or a "
                  "bug in A / in B (exit 1); JSON schema llmdiff.against/1 (docs/AGAINST.md)");
  add_bisect_cli_options(*sub, o->bisect);
  sub->callback([o, &action] { action = [o] { return run_bisect(*o); }; });
}

}  // namespace llmdiff::cli
