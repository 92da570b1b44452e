// Pieces shared by the subcommands: parsing option values, building engines,
// filling manifests.
#pragma once
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "bisect/engines.h"
#include "dumps/model/weights.h"

namespace llmdiff::cli {

using bisect::EngineOptions;
using bisect::make_engine;
using bisect::make_manifest;
using bisect::dir_name;

// "1,2,3" -> {1,2,3}; throws UsageError naming the option on bad input.
std::vector<int64_t> parse_int_list(const std::string& text, const std::string& option);
// "a,b" -> {"a","b"} (empty items dropped).
std::vector<std::string> split_list(const std::string& text);
// --memory-budget SIZE ("8GB", "500MB") in bytes; "" -> 0 (the default
// budget). Throws UsageError naming the option on a bad size.
int64_t parse_memory_budget(const std::string& text);

// The scenario of --tokens/--chunks/--decode or of --replay DUMP (exactly one
// of tokens/replay must be given).
Scenario scenario_from_options(const std::string& tokens, const std::string& replay, const std::string& chunks,
                               int decode);

// --tokens/--replay/--decode/--chunks, shared by the commands that run a model.
struct ScenarioCliOptions {
  std::string tokens, replay, chunks;
  int decode = 0;
  Scenario scenario() const { return scenario_from_options(tokens, replay, chunks, decode); }
};
void add_scenario_options(CLI::App& sub, ScenarioCliOptions& o);

// Writes a side output of a command (a Markdown report, JUnit XML) to `path`
// atomically and says "wrote WHAT PATH": on stderr when stdout carries JSON,
// else on stdout.
void write_side_output(const std::string& path, const std::string& text, const std::string& what, bool json);

// --verbose: one line per finished phase on stderr with the wall time since
// construction and the process's peak RSS ("[  12.3 s, peak 4.1 GB] what").
class PhaseLog {
 public:
  explicit PhaseLog(bool enabled);
  void operator()(const std::string& what) const;
  bool enabled() const { return enabled_; }

 private:
  bool enabled_;
  double start_;
  mutable int64_t read_ = 0, written_ = 0;  // /proc/self/io at the last phase's end
};


}  // namespace llmdiff::cli
