// Engine dumps for the end-to-end tests of diff and regress (which run the
// commands through tests/cli_runner.h). Header-only.
#pragma once
#include <string>
#include <vector>

#include "cli/common.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/model/weights.h"
#include "tests/cli_runner.h"
#include "tests/support.h"

namespace llmdiff::testing {

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
