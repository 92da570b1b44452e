// Runs llmdiff command lines in-process, through the same subcommands, option
// parsing and actions as the binary (cli::setup_commands, as cli/main.cpp).
// Header-only; for the end-to-end tests/test_cli*.cpp.
#pragma once
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "dumps/base/errors.h"
#include "tests/support.h"

namespace llmdiff::testing {

// One parsed command line. The app lives as long as the action: a
// subcommand's options may point into it.
class CliCommand {
 public:
  // `args` without the program name; throws CLI::ParseError as main's parse does.
  explicit CliCommand(const std::vector<std::string>& args) {
    cli::setup_commands(app_, action_);
    std::vector<const char*> argv{"llmdiff"};
    for (const auto& a : args) argv.push_back(a.c_str());
    app_.parse(int(argv.size()), argv.data());
  }
  CliCommand(const CliCommand&) = delete;
  CliCommand& operator=(const CliCommand&) = delete;

  // The subcommand's exit code; its exceptions propagate.
  int run() const { return action_ ? action_() : 2; }

 private:
  CLI::App app_{"llmdiff"};
  cli::Action action_;
};

struct CliRun {
  int code = -1;
  std::string out;    // what the action printed on stdout
  std::string error;  // what a parse error or an llmdiff::Error said (code 2)
};

// Parses and runs `args` with stdout captured; parse errors and llmdiff::Error
// map to exit code 2 as in main.
inline CliRun run_cli(const std::vector<std::string>& args) {
  CliRun r;
  std::unique_ptr<CliCommand> cmd;
  try {
    cmd = std::make_unique<CliCommand>(args);
  } catch (const CLI::ParseError& e) {
    r.code = 2;
    r.error = e.what();
    return r;
  }
  ::testing::internal::CaptureStdout();
  try {
    r.code = cmd->run();
  } catch (const Error& e) {
    r.code = 2;
    r.error = e.what();
  }
  std::fflush(stdout);
  r.out = ::testing::internal::GetCapturedStdout();
  return r;
}

// `llmdiff bisect --json` of `dump` against the golden model `model` (one
// thread): the parsed JSON, the exit code in `code` (expected 0 or 1).
inline nlohmann::json bisect_json(const std::string& model, const std::string& dump, int* code) {
  const CliRun r = run_cli({"bisect", "--model", golden_model(model), dump, "--json", "--threads", "1"});
  *code = r.code;
  EXPECT_TRUE(r.code == 0 || r.code == 1) << r.error << r.out;
  return nlohmann::json::parse(r.out);
}

}  // namespace llmdiff::testing
