#include "cli/commands.h"

namespace llmdiff::cli {

void setup_commands(CLI::App& app, Action& action) {
  app.require_subcommand(1);
  setup_inspect(app, action);
  setup_dump(app, action);
  setup_diff(app, action);
  setup_regress(app, action);
  setup_run(app, action);
  setup_bisect(app, action);
  setup_merge(app, action);
  setup_synth(app, action);
  setup_bench(app, action);
  setup_convert(app, action);
  setup_import(app, action);
}

}  // namespace llmdiff::cli
