// llmdiff dump --engine ref|impl --model DIR (--tokens 1,2,3 | --replay DUMP)
//   [--decode N] [--chunks 4,3] [--dtype D] [--threads N] [--inject BUG]... [--mla naive|absorbed]
//   [--sites GLOB,...] --out FILE
// llmdiff dump --engine impl --model DIR --batch 'PROMPT[@JOIN][:DECODE];...' [--block-size B]
//   [--num-blocks N] [--chunk C] [--inject BUG]... [--precision ...] [--mla naive|absorbed] --out FILE
// --tp R (impl, also with --batch): tensor parallelism over R ranks, each rank's names under rank{r}.
// Runs a scenario through one engine and streams every canonical
// intermediate into an llm-dump/1 file.
#include <fmt/core.h>

#include "cli/commands.h"
#include "cli/common.h"
#include "dumps/base/errors.h"
#include "dumps/contract/ranks.h"
#include "dumps/zoo/bugs.h"
#include "impl/batch_engine.h"
#include "synth/synth.h"

namespace llmdiff::cli {

struct DumpOptions {
  std::string engine = "ref";
  std::string model, sites, out;
  std::string sample;  // sampling parameters (SamplingParams::parse)
  int64_t left_pad = 0, pad_token = 0;  // a row of a left-padded batch (Scenario::left_pad)
  ScenarioCliOptions scenario;
  EngineOptions engine_opts;
  bool list_bugs = false;
  // The continuous-batching engine (impl/batch_engine.h).
  std::string batch;  // requests: "PROMPT[@JOIN][:DECODE];..."
  bool prefix_cache = false;  // serving features of the continuous-batching engine
  std::string speculative;
  int spec_k = 4;
  int draft_layers = 1;
  int64_t bucket = 0;
  std::string memory_budget;  // a checkpoint larger than this streams; empty: half the memory available
  int64_t block_size = 16, num_blocks = 0, chunk = 0;
};

namespace {

int list_bugs() {
  for (const auto& b : zoo::all_bugs()) fmt::print("{:<34} {}\n", b.name, b.description);
  return 0;
}

// Several sequences through the continuous-batching engine: each under
// seq{b}., the engine's iterations and its paged cache's bookkeeping.
int64_t memory_budget(const DumpOptions& o) { return parse_memory_budget(o.memory_budget); }

int run_batch_dump(const DumpOptions& o, const Model& model) {
  if (o.engine != "impl")
    throw UsageError("--batch runs the impl's continuous-batching engine (--engine impl); the reference runs each "
                     "sequence alone when bisect judges a batch");
  if (!o.scenario.tokens.empty() || !o.scenario.replay.empty() || !o.scenario.chunks.empty() || o.left_pad > 0)
    throw UsageError("--batch gives the requests itself: no --tokens, --replay, --chunks or --left-pad with it");
  impl::BatchEngineOptions bo;
  bo.threads = o.engine_opts.threads;
  bo.block_size = o.block_size;
  bo.num_blocks = o.num_blocks;
  bo.chunk = o.chunk;
  bo.release_weights = bisect::weight_policy(model, memory_budget(o)).stream;
  bo.prefix_cache = o.prefix_cache;
  bo.speculative = o.speculative;
  bo.spec_k = o.spec_k;
  bo.draft_layers = o.draft_layers;
  bo.bucket = o.bucket;
  bo.mla = impl::parse_mla_form(o.engine_opts.mla);
  bo.precision = PrecisionProfile::parse(o.engine_opts.precision);
  bo.tensor_parallel = o.engine_opts.tensor_parallel;
  if (o.engine_opts.kv_ring > 0) throw UsageError("--batch serves the sequences from a paged KV cache: no --kv-ring");
  for (const std::string& b : o.engine_opts.inject) bo.bugs.push_back(zoo::parse_bug(b));
  if (!o.sample.empty()) bo.sampling = SamplingParams::parse(o.sample);
  const std::vector<impl::BatchRequest> requests = impl::parse_batch_requests(o.batch, o.scenario.decode);
  impl::BatchEngine engine(model, bo);
  DumpWriter writer(o.out);
  if (!o.sites.empty()) writer.set_filter(split_list(o.sites));
  Scenario sc;
  sc.name = "batch";
  RankZeroNames ranked(writer);  // tensor parallel: the replicated names under rank0.
  const impl::BatchOutcome run = engine.run(requests, bo.tensor_parallel > 1 ? static_cast<Observer&>(ranked) : writer);
  writer.mutable_manifest() = make_manifest(engine.producer(), "float32", model, o.model, sc);
  if (bo.tensor_parallel > 1)
    writer.mutable_manifest().extra[tensor_parallel_key()] = tensor_parallel_json(bo.tensor_parallel);
  writer.mutable_manifest().steps = run.iterations;
  writer.mutable_manifest().extra["kv_cache"] = engine.kv_cache_json(requests);
  if (!bo.precision.empty()) writer.mutable_manifest().extra["precision"] = bo.precision.json();
  if (!engine.speculative_json().empty()) writer.mutable_manifest().extra["speculative"] = engine.speculative_json();
  if (bo.sampling) {  // each sequence's own parameters (its own seed)
    writer.mutable_manifest().scenario = "batch-sample";
    for (size_t b = 0; b < requests.size(); ++b)
      set_manifest_sampling(writer.mutable_manifest(), impl::sampling_for(bo, int(b)), int(b));
  }
  writer.finish();
  fmt::print("wrote {} (impl continuous batching{}, {} sequences, {} engine iterations, {} token rows)\n", o.out,
             bo.tensor_parallel > 1 ? " over " + std::to_string(bo.tensor_parallel) + " ranks" : "", requests.size(),
             run.iterations, run.rows);
  return 0;
}

int run_dump(const DumpOptions& o) {
  if (o.list_bugs) return list_bugs();
  if (o.model.empty()) throw UsageError("--model is required");
  if (o.out.empty()) throw UsageError("--out is required");
  Model model = Model::load(o.model);
  if (!o.batch.empty()) return run_batch_dump(o, model);
  Scenario sc = o.scenario.scenario();
  sc.left_pad = o.left_pad;
  sc.pad_token = o.pad_token;
  std::vector<zoo::BugSpec> bugs;
  for (const std::string& b : o.engine_opts.inject) bugs.push_back(zoo::parse_bug(b));
  sc.sampler_faults = zoo::sampler_faults(bugs);
  if (!o.sample.empty()) {
    sc.sampling = SamplingParams::parse(o.sample);
    sc.sampling->validate();
    if (sc.sampling->do_sample) sc.name = "sample";
  } else if (sc.sampler_faults.any()) {
    throw UsageError("the sampler's bugs act only when the run samples: add --sample");
  }
  EngineOptions eo = o.engine_opts;
  // The checkpoint resident when it fits the memory budget, else streamed
  // layer by layer (about one layer resident).
  eo.release_weights = bisect::weight_policy(model, memory_budget(o)).stream;
  auto engine = make_engine(o.engine, model, eo);
  DumpWriter writer(o.out);
  if (!o.sites.empty()) writer.set_filter(split_list(o.sites));
  writer.mutable_manifest() = make_manifest(*engine, model, o.model, sc);
  if (sc.sampling) set_manifest_sampling(writer.mutable_manifest(), *sc.sampling);
  const int ranks = eo.tensor_parallel;
  if (ranks > 1) writer.mutable_manifest().extra[tensor_parallel_key()] = tensor_parallel_json(ranks);
  RankZeroNames ranked(writer);  // tensor parallel: the replicated names under rank0.
  std::vector<int64_t> generated = run_scenario(*engine, sc, ranks > 1 ? static_cast<Observer&>(ranked) : writer);
  writer.finish();
  std::string gen;
  for (int64_t t : generated) gen += (gen.empty() ? "" : ",") + std::to_string(t);
  fmt::print("wrote {} ({} engine{}, {}, {} forward calls; {} tokens {})\n", o.out, o.engine,
             ranks > 1 ? " over " + std::to_string(ranks) + " ranks" : "", engine->dtype_name(),
             sc.steps.size() + size_t(sc.decode), sc.sampling ? "sampled" : "greedy", gen);
  return 0;
}

}  // namespace

void setup_dump(CLI::App& app, Action& action) {
  auto o = std::make_shared<DumpOptions>();
  CLI::App* sub = app.add_subcommand("dump", "Run a model through the ref or impl engine and write every "
                                             "canonical intermediate to an llm-dump/1 file");
  sub->add_option("--engine", o->engine, "ref (libtorch, HF numerics) or impl (plain C++)")
      ->check(CLI::IsMember({"ref", "impl"}));
  sub->add_option("--model", o->model, "HF model directory (config.json + safetensors) or GGUF file");
  add_scenario_options(*sub, o->scenario);
  sub->add_option("--dtype", o->engine_opts.dtype, "ref compute dtype: float32, bfloat16, float16, float64 "
                                                   "(default: the checkpoint's torch_dtype)");
  sub->add_option("--threads", o->engine_opts.threads, "threads (default: all cores)")->check(CLI::NonNegativeNumber);
  sub->add_option("--max-seq", o->engine_opts.max_seq, "impl KV cache capacity (default: max_position_embeddings)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--inject", o->engine_opts.inject, "impl: switch on a bug of the zoo (repeatable; see --list-bugs)");
  sub->add_option("--mla", o->engine_opts.mla,
                  "impl, multi-head latent attention (deepseek_v3): naive (kv_b_proj expands the latent, full K/V "
                  "cached, HF's form; default) or absorbed (kv_b_proj folded into q and ctx, only the latent and "
                  "k_pe cached)")
      ->check(CLI::IsMember({"naive", "absorbed"}));
  sub->add_option("--kv-ring", o->engine_opts.kv_ring,
                  "impl: a ring-buffer KV cache of this many positions (position p in slot p mod C, as engines "
                  "with a fixed MaxSeqLen keep it); once a call's positions exceed it, attention reads only the last "
                  "C and the cache sites hold the ring's slots. The manifest says kv_cache ring")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--precision", o->engine_opts.precision,
                  "impl: roundings made on purpose, KEY=VALUE,...: kv_cache=f16|bf16 (a 16-bit KV cache), "
                  "matmul_input=f16|bf16|q8_0|q8_k (every matmul input rounded so) or ggml (as llama.cpp's CPU "
                  "backend: 16-bit inputs for 16-bit weights, 8-bit blocks for quantised ones); written to the "
                  "manifest (key precision)");
  sub->add_option("--tp", o->engine_opts.tensor_parallel,
                  "impl: tensor parallelism over this many ranks in one process (also with --batch): each rank "
                  "computes its shard (its query and kv heads, its columns of every MLP) and the ranks' partial "
                  "sums are all-reduced after o_proj and the MLP; writes rank{r}.* and the manifest key "
                  "tensor_parallel (default 1: none)")
      ->check(CLI::PositiveNumber);
  sub->add_option("--sample", o->sample,
                  "draw the tokens with HF's logits processors instead of the argmax, e.g. "
                  "temperature=0.7,top_k=40,top_p=0.9,min_p=0.05,repetition_penalty=1.3,seed=1 (HF generate's "
                  "names and defaults; written to the manifest key sampling, each step's sample.* recorded)");
  sub->add_option("--batch", o->batch,
                  "impl: serve several sequences with the continuous-batching engine (packed rows, paged KV cache), "
                  "requests 'PROMPT[@JOIN][:DECODE];...', e.g. '1,2,3,4@0:3;5,6@2' (JOIN: the engine iteration it "
                  "arrives at, default 0; DECODE: its decode calls, default --decode); writes seq{b}.*, iter{N}.* "
                  "and kv.*; --inject, --precision and --mla act here too");
  sub->add_flag("--prefix-cache", o->prefix_cache,
                "--batch: a prefix cache: a request whose prompt begins with blocks another computed is given them "
                "(kv.cached_prefix, kv.block_source)");
  sub->add_option("--speculative", o->speculative,
                  "--batch: speculative decoding (greedy) with this proposer: ngram (the continuation of the "
                  "sequence's latest n-gram seen before) or draft (the checkpoint's first --draft-layers layers); "
                  "spec.draft and spec.accepted recorded")
      ->check(CLI::IsMember({"ngram", "draft"}));
  sub->add_option("--spec-k", o->spec_k, "--speculative: drafts per verify call (default 4)")->check(CLI::PositiveNumber);
  sub->add_option("--draft-layers", o->draft_layers, "--speculative draft: the draft model's layers (default 1)")
      ->check(CLI::PositiveNumber);
  sub->add_option("--bucket", o->bucket,
                  "--batch: pad each engine call's rows to a multiple of this (a captured graph's bucket; "
                  "iter{N}.padded_rows recorded)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--memory-budget", o->memory_budget,
      "impl: a checkpoint larger than this (e.g. 8GB) is streamed layer by layer, one layer's pages resident at a "
      "time; a smaller one stays resident (default: half the memory available when the command starts)");
  sub->add_option("--block-size", o->block_size, "--batch: positions per KV block (default 16)")
      ->check(CLI::PositiveNumber);
  sub->add_option("--num-blocks", o->num_blocks, "--batch: blocks in the KV pool (default: enough for all at once)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--chunk", o->chunk, "--batch: prompt tokens per sequence per iteration (chunked prefill beside "
                                       "the decodes; default: the whole prompt)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--left-pad", o->left_pad,
                  "ref: run the prompt as a row of HF's left-padded batched generate, behind this many pad tokens "
                  "(masked as keys, at position 1, the prompt from position 0); the dump is the sequence's own, "
                  "padding stripped")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--pad-token", o->pad_token, "--left-pad: the pad token id (default 0)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--sites", o->sites, "record only names matching these globs, comma separated "
                                       "(e.g. 'step*.layers.*.out,step*.logits')");
  sub->add_option("--out", o->out, "output dump file");
  sub->add_flag("--list-bugs", o->list_bugs, "list the bugs --inject knows and exit");
  sub->callback([o, &action] { action = [o] { return run_dump(*o); }; });
}

}  // namespace llmdiff::cli
