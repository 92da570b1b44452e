// One file per subcommand. Each has an options struct with defaults, a
// setup_X that declares its CLI11 options and a run_X that does the work and
// returns the exit code (0 ok, 1 divergence). Errors are thrown as
// llmdiff::Error and mapped to exit code 2 by main.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>

namespace llmdiff::cli {

using Action = std::function<int()>;

// Each setup_X adds its subcommand to `app` and, when parsing selects it,
// stores the work to do in `action`.
void setup_inspect(CLI::App& app, Action& action);
void setup_dump(CLI::App& app, Action& action);
void setup_diff(CLI::App& app, Action& action);
void setup_run(CLI::App& app, Action& action);
void setup_bisect(CLI::App& app, Action& action);
void setup_regress(CLI::App& app, Action& action);
void setup_synth(CLI::App& app, Action& action);
void setup_bench(CLI::App& app, Action& action);
void setup_convert(CLI::App& app, Action& action);
void setup_import(CLI::App& app, Action& action);
void setup_merge(CLI::App& app, Action& action);

// All of the above on `app`, which then requires exactly one subcommand: the
// llmdiff command line (cli/main.cpp; the end-to-end tests parse through it too).
void setup_commands(CLI::App& app, Action& action);

}  // namespace llmdiff::cli
