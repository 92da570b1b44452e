// llmdiff bench --model DIR [--prompt N] [--decode N] [--repeats N] [--engines ref,impl|none] [--e2e]
//   [--bisect BUG] [--batch N] [--serving N] [--json]: the flags of the harness in bench/bench.h.
#include "bench/bench.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace llmdiff::cli {

namespace {

// The command line's options: bench::BenchOptions with --engines as written.
struct BenchCmdOptions : bench::BenchOptions {
  std::string engines_text = "ref,impl";
};

int run_bench(const BenchCmdOptions& o) {
  bench::BenchOptions b = o;
  b.engines = split_list(o.engines_text);
  return bench::run_bench(b);
}

}  // namespace

void setup_bench(CLI::App& app, Action& action) {
  auto opt = std::make_shared<BenchCmdOptions>();
  CLI::App* sub = app.add_subcommand(
      "bench", "Time prefill and decode of the ref and impl engines side by side (speed, peak RSS, bandwidth bound)");
  sub->add_option("--model", opt->model, "Model directory (config.json + safetensors) or GGUF file")->required();
  sub->add_option("--prompt", opt->prompt, "Prefill tokens")->capture_default_str();
  sub->add_option("--decode", opt->decode, "Greedy decode steps timed after the prefill")->capture_default_str();
  sub->add_option("--threads", opt->threads, "Threads of the engines and of the bandwidth probe (0: all cores)")
      ->capture_default_str();
  sub->add_option("--repeats", opt->repeats, "Runs per engine (best, median and worst reported)")->capture_default_str();
  sub->add_option("--mla", opt->mla, "impl's multi-head latent attention (deepseek_v3): naive or absorbed")
      ->check(CLI::IsMember({"naive", "absorbed"}))
      ->capture_default_str();
  sub->add_option("--engines", opt->engines_text, "Engines to time, comma-separated: ref, impl (none: only --e2e)")->capture_default_str();
  sub->add_option("--ref-dtype", opt->ref_dtype, "Ref compute dtype (default: the checkpoint's torch_dtype)");
  sub->add_option("--seed", opt->seed, "Seed of the prompt token ids")->capture_default_str();
  sub->add_option("--bandwidth-mib", opt->bandwidth_mib, "Buffer of the read-bandwidth probe, MiB")
      ->capture_default_str();
  sub->add_flag("--json", opt->json_out, "Print the results as JSON");
  sub->add_flag("--e2e", opt->e2e,
                "Also time the debugger end to end: both engines dumping every site, the dumps written and diffed, "
                "then `llmdiff run` with its defaults, phase by phase");
  sub->add_option("--e2e-decode", opt->e2e_decode, "Decode steps of the end-to-end and --bisect runs")->capture_default_str();
  sub->add_option("--bisect", opt->bisect,
                  "Also time the bisection of an impl candidate with this zoo bug, or `all`: one per zoo bug of the model, a table (phases, peak RSS, ratio to the "
                  "plain impl forward; with --engines none, only that)");
  sub->add_option("--batch", opt->batch,
                  "Also time the impl's continuous-batching engine serving 1 and N sequences of --prompt + --decode "
                  "tokens (prefill and decode tokens/s of all sequences together)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--serving", opt->serving,
                  "Also time the cost of each serving feature of the continuous-batching engine: N requests of "
                  "--prompt tokens sharing their first half and --decode tokens, served plainly, with the prefix "
                  "cache, speculative decoding (n-gram, draft model), bucket padding and 2 ranks (hit rate, "
                  "acceptance, decode tokens/s, overheads against the plain run)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--e2e-dir", opt->e2e_dir, "Keep the end-to-end dumps here (default: a temporary directory)");
  sub->callback([opt, &action] { action = [opt] { return run_bench(*opt); }; });
}

}  // namespace llmdiff::cli
