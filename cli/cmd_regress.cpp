// llmdiff regress --golden DIR [--engine ref|impl|both|none] [--engine-cmd TEMPLATE | --engine-dumps DIR]
//   [--junit FILE] [--json] [--policy KEY=VALUE]... [--threads N] [--verbose]
// Replays every HF dump of every model directory under DIR through the
// engine(s) — llmdiff's own, and/or the user's engine through a command
// template or a directory of its dumps (bisect/external.h) — and checks the
// result against the regression policy (compare/regress.h). Exit 0 when every
// case passes, 1 otherwise, 2 on bad input (unreadable golden tree).
#include <fmt/core.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>

#include "cli/commands.h"
#include "cli/common.h"
#include "bisect/external.h"
#include "compare/regress.h"
#include "compare/report.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"
#include "dumps/contract/sequences.h"
#include "dumps/model/weights.h"

namespace llmdiff::cli {

struct RegressOptions {
  std::string golden, engine = "both", junit;
  bisect::ExternalEngine external;  // --engine-cmd / --engine-dumps
  std::vector<std::string> policy;
  int threads = 0;
  bool json = false, verbose = false, engine_given = false;
};

namespace {

std::vector<compare::EngineKind> engines_of(const std::string& which) {
  if (which == "both") return {compare::EngineKind::Ref, compare::EngineKind::Impl};
  if (which == "none") return {};
  return {compare::parse_engine_kind(which)};
}

// The external engine's case: its dump of the scenario (run or found), judged
// like the impl's.
void run_external_case(const RegressOptions& o, const std::string& model_dir, const TensorSource& hf, const Scenario& sc,
                       compare::RegressionCase& c, const compare::RegressionPolicy& policy) {
  try {
    const std::string path = bisect::external_dump(o.external, model_dir, c.id(), sc);
    const DumpFile out(path);
    c.diff = compare::compare_dumps(hf, out, compare::regression_options(policy, c.engine, c.model_dtype));
  } catch (const std::exception& e) {
    c.error = e.what();
  }
}

int run_regress_with(const RegressOptions& o);

int run_regress(const RegressOptions& o) {
  if (o.golden.empty()) throw UsageError("--golden is required");
  RegressOptions opts = o;
  if (!o.external.command.empty())  // a wrong placeholder is the user's error, before any case runs
    bisect::expand_command(o.external.command, {{"model", ""}, {"tokens", ""}, {"chunks", ""}, {"decode", ""},
                                                {"out", ""}, {"name", ""}});
  // A work directory of our own is removed afterwards, unless a case fails:
  // its dumps are then what `llmdiff bisect` needs.
  struct OwnDir {
    std::string path;
    bool keep = false;
    ~OwnDir() {
      std::error_code ec;
      if (!path.empty() && !keep) std::filesystem::remove_all(path, ec);
    }
  } own;
  if (!opts.external.command.empty() && opts.external.work_dir.empty()) {
    const char* tmpdir = std::getenv("TMPDIR");
    std::string base = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/llmdiff-regress-XXXXXX";
    std::vector<char> buf(base.begin(), base.end());
    buf.push_back('\0');
    if (!mkdtemp(buf.data())) throw IoError(base, "cannot make a work directory for --engine-cmd");
    opts.external.work_dir = own.path = buf.data();
  }
  const int code = run_regress_with(opts);
  if (code != 0 && !own.path.empty()) {
    own.keep = true;
    fmt::print(stderr, "note: {}'s dumps and logs are kept in {} (MODEL/SCENARIO.safetensors; bisect a failing "
                       "case with llmdiff bisect --model MODEL_DIR DUMP)\n", opts.external.name, own.path);
  }
  return code;
}

int run_regress_with(const RegressOptions& o) {
  compare::RegressionReport report;
  report.golden = o.golden;
  for (const auto& kv : o.policy) report.policy.set(kv);
  const bool external = !o.external.command.empty() || !o.external.dumps_dir.empty();
  if (!o.external.command.empty() && !o.external.dumps_dir.empty())
    throw UsageError("--engine-cmd and --engine-dumps: one or the other");
  // With an external engine, llmdiff's own run only when --engine asks.
  const auto kinds = engines_of(external && o.engine == "both" && !o.engine_given ? "none" : o.engine);
  const auto models = compare::discover_golden(o.golden);
  std::vector<std::string> notes;
  EngineOptions eo;
  eo.threads = o.threads;

  for (const auto& gm : models) {
    Model model = Model::load(gm.dir);
    const ComputeDType dt = model.config.default_dtype();
    // One engine per kind and model, reused across its dumps (run_scenario
    // starts every scenario from an empty cache).
    std::map<compare::EngineKind, std::unique_ptr<Engine>> engines;
    std::map<compare::EngineKind, std::string> engine_errors;
    for (auto k : kinds) {
      try {
        engines[k] = make_engine(compare::engine_kind_name(k), model, eo);
      } catch (const std::exception& e) {
        engine_errors[k] = e.what();
      }
    }
    for (const auto& path : gm.dumps) {
      const DumpFile file(path);
      // A several-sequence dump (a batched HF run): one case per sequence,
      // the engine running that sequence alone.
      std::vector<std::unique_ptr<SequenceView>> views;
      for (int b : dump_sequences(file)) views.push_back(std::make_unique<SequenceView>(file, b));
      const size_t parts = std::max<size_t>(1, views.size());
      for (size_t part = 0; part < parts; ++part) {
        const TensorSource& hf = views.empty() ? static_cast<const TensorSource&>(file) : *views[part];
        Scenario sc = replay_with_sampling(hf);
        if (external) {
          compare::RegressionCase c;
          c.model = gm.name;
          c.scenario = std::filesystem::path(path).stem().string();
          if (!views.empty()) c.scenario += "/seq" + std::to_string(views[part]->sequence());
          c.dump = path;
          c.engine = compare::EngineKind::External;
          c.engine_name = o.external.name;
          c.model_dtype = dt;
          c.rule = report.policy.describe(c.engine, dt);
          if (sc.sampling && sc.sampling->do_sample) {
            notes.push_back(c.id() + ": a sampling run (HF's own random draws), not replayed by " + o.external.name);
          } else {
            const auto t0 = std::chrono::steady_clock::now();
            run_external_case(o, gm.dir, hf, sc, c, report.policy);
            c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            compare::evaluate_case(c, report.policy);
            if (o.verbose)
              fmt::print(stderr, "{} {}: {}\n", c.engine_label(), c.id(), c.pass ? "PASS" : "FAIL");
            report.cases.push_back(std::move(c));
          }
        }
        for (auto k : kinds) {
          compare::RegressionCase c;
          c.model = gm.name;
          c.scenario = std::filesystem::path(path).stem().string();
          if (!views.empty()) c.scenario += "/seq" + std::to_string(views[part]->sequence());
          c.dump = path;
          c.engine = k;
          c.model_dtype = dt;
          c.rule = report.policy.describe(k, dt);
          auto t0 = std::chrono::steady_clock::now();
          if (engine_errors.count(k)) {
            c.error = engine_errors[k];
          } else {
            try {
              Engine& engine = *engines[k];
              MemoryDump out(std::string(compare::engine_kind_name(k)) + " replay of " + path);
              out.mutable_manifest() = make_manifest(engine, model, gm.dir, sc);
              run_scenario(engine, sc, out);
              c.diff = compare::compare_dumps(hf, out, compare::regression_options(report.policy, k, dt));
            } catch (const std::exception& e) {
              c.error = e.what();
            }
          }
          c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          compare::evaluate_case(c, report.policy);
          if (o.verbose)
            fmt::print(stderr, "{} {}/{} {}: {}\n", compare::engine_kind_name(k), c.model, c.scenario,
                       c.pass ? "PASS" : "FAIL", c.pass ? c.worst_name : (c.failures.empty() ? "" : c.failures[0]));
          report.cases.push_back(std::move(c));
        }
      }
    }
  }

  if (o.json)
    std::fputs(compare::render_regress_json(report).c_str(), stdout);
  else
    std::fputs(compare::render_regress_table(report, o.verbose).c_str(), stdout);
  if (!o.json)
    for (const std::string& n : notes) fmt::print("note: {}\n", n);
  if (!o.junit.empty()) write_side_output(o.junit, compare::render_regress_junit(report), "JUnit XML", o.json);
  std::fflush(stdout);
  return report.ok() ? 0 : 1;
}

}  // namespace

void setup_regress(CLI::App& app, Action& action) {
  auto o = std::make_shared<RegressOptions>();
  CLI::App* sub = app.add_subcommand("regress", "Replay golden HF dumps through the engines and check them against "
                                                "the regression policy");
  sub->add_option("--golden", o->golden, "golden tree: model directories (config.json + weights) holding HF dumps")
      ->required();
  sub->add_option("--engine", o->engine, "llmdiff's own engines: ref, impl, both or none (default: both, none "
                                         "with --engine-cmd/--engine-dumps)")
      ->check(CLI::IsMember({"ref", "impl", "both", "none"}))
      ->each([o](const std::string&) { o->engine_given = true; });
  sub->add_option("--engine-cmd", o->external.command,
                  "your engine: a shell command template writing one dump, with {model} {tokens} {chunks} {decode} "
                  "{out} {name} (e.g. \"./myengine --model {model} --prompt {tokens} --decode {decode} --dump "
                  "{out}\")");
  sub->add_option("--engine-dumps", o->external.dumps_dir,
                  "your engine's dumps, already written: DIR/MODEL/SCENARIO.safetensors for each golden dump "
                  "(DIR/MODEL/SCENARIO/seqB.safetensors for a batch's sequences)");
  sub->add_option("--engine-name", o->external.name, "your engine's name in the table, JSON and JUnit")
      ->capture_default_str();
  sub->add_option("--engine-timeout", o->external.timeout_s, "seconds a --engine-cmd run may take")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--work-dir", o->external.work_dir,
                  "where --engine-cmd writes its dumps and logs (default: a fresh temporary directory, removed "
                  "when every case passes)");
  sub->add_option("--junit", o->junit, "write JUnit XML to this file (testsuite per engine, testcase per "
                                       "model/scenario)");
  sub->add_flag("--json", o->json, "print the result as JSON (schema llmdiff.regress/1, see compare/README.md)");
  std::string keys;
  for (const auto& k : compare::RegressionPolicy::keys()) keys += (keys.empty() ? "" : ", ") + k;
  sub->add_option("--policy", o->policy, "override a regression policy bound, KEY=VALUE (repeatable; keys: " + keys + ")");
  sub->add_option("--threads", o->threads, "engine threads (default: all cores)")->check(CLI::NonNegativeNumber);
  sub->add_flag("--verbose", o->verbose, "print each case as it finishes and every failing name");
  sub->callback([o, &action] { action = [o] { return run_regress(*o); }; });
}

}  // namespace llmdiff::cli
