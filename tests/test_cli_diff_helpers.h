// Runs llmdiff subcommands in-process (the same setup_X / action path as
// main) with stdout captured, and writes engine dumps for the end-to-end
// tests of diff and regress. Header-only.
#pragma once
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "dumps/dump.h"
#include "dumps/engine.h"
#include "dumps/errors.h"
#include "dumps/weights.h"
#include "tests/support.h"

namespace llmdiff::testing {

struct CliRun {
  int code = -1;
  std::string out;
  std::string error;  // what an llmdiff::Error said (code 2)
};

// Parses `args` (without the program name) like main does and runs the
// action; llmdiff::Error and parse errors map to exit code 2 as in main.
inline CliRun run_cli(const std::vector<std::string>& args) {
  CLI::App app{"llmdiff"};
  app.require_subcommand(1);
  cli::Action action;
  cli::setup_diff(app, action);
  cli::setup_regress(app, action);
  std::vector<const char*> argv{"llmdiff"};
  for (const auto& a : args) argv.push_back(a.c_str());
  CliRun r;
  try {
    app.parse(int(argv.size()), argv.data());
  } catch (const CLI::ParseError& e) {
    r.code = 2;
    r.error = e.what();
    return r;
  }
  ::testing::internal::CaptureStdout();
  try {
    r.code = action ? action() : 2;
  } catch (const Error& e) {
    r.code = 2;
    r.error = e.what();
  }
  std::fflush(stdout);
  r.out = ::testing::internal::GetCapturedStdout();
  return r;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Replays a golden dump through an engine ("ref" or "impl", optional zoo
// bugs) into a dump file at `out`.
inline void write_engine_dump(const std::string& engine, const std::string& model_dir, const std::string& golden,
                              const std::string& out, const std::vector<std::string>& inject = {}) {
  Model model = Model::load(model_dir);
  cli::EngineOptions eo;
  eo.inject = inject;
  auto e = cli::make_engine(engine, model, eo);
  Scenario sc = replay_scenario(DumpFile(golden));
  DumpWriter w(out);
  w.mutable_manifest() = cli::make_manifest(*e, model, model_dir, sc);
  run_scenario(*e, sc, w);
  w.finish();
}

}  // namespace llmdiff::testing
