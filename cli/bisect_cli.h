// The command-line options `bisect` and `run` share, and their output.
#pragma once
#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bisect/pipeline.h"
#include "cli/common.h"
#include "compare/against.h"
#include "compare/batch_report.h"
#include "compare/bisect_result.h"

namespace llmdiff::cli {

// The command-line options bisect and run share.
struct BisectCliOptions {
  std::vector<std::string> tol;     // --tol GLOB=SPEC (repeatable)
  std::optional<double> rtol, atol;
  std::string sites;                // --sites GLOB,...
  bool no_noise_floor = false, no_local = false, no_diagnose = false;
  bool json = false, all = false;
  std::string report;               // --report FILE.md
  std::string html;                 // --html FILE.html
  std::string junit;                // --junit FILE.xml
  int threads = 0;
  bool verbose = false;             // --verbose: phase timings on stderr
  std::string memory_budget;        // --memory-budget SIZE (empty: half the memory available)
};
void add_bisect_cli_options(CLI::App& sub, BisectCliOptions& o);
// `log` (when enabled) receives the pipeline's phases.
bisect::BisectOptions bisect_options(const BisectCliOptions& o, const PhaseLog* log = nullptr);
// Prints the result (table or JSON), writes the Markdown, HTML and JUnit
// reports if asked; returns the result's exit code (0 within tolerance and a
// sampler that passes, 1 otherwise).
int emit_bisect(const compare::BisectResult& r, const BisectCliOptions& o);
// The same for a several-sequence candidate: the batch table, JSON and
// JUnit; the Markdown and HTML reports are the first divergent sequence's
// (else seq0's).
int emit_batch_bisect(const compare::BatchBisect& b, const BisectCliOptions& o);
// Two configurations (`bisect --against`): the pairs' table or JSON, the
// Markdown and HTML reports of the comparison; 0 when every pair is
// legitimate, 1 when a side has a bug.
int emit_against(const compare::AgainstResult& r, const BisectCliOptions& o);

}  // namespace llmdiff::cli
