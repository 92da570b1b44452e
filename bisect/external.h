// An engine outside llmdiff, as `llmdiff regress` runs it: a command
// template the user's CI already knows how to call, or a directory where its
// dumps already are. Either way one llm-dump/1 file per (model, scenario).
#pragma once
#include <map>
#include <string>

#include "dumps/contract/engine.h"

namespace llmdiff::bisect {

struct ExternalEngine {
  std::string name = "external";  // the JUnit testsuite / table label
  // Shell command with {model} (model directory), {tokens} (prompt ids,
  // comma separated), {chunks} (the prompt's forward calls, their sizes
  // comma separated), {decode} (greedy decode steps after the prompt), {out}
  // (the dump to write), {name} (MODEL/SCENARIO of the case).
  std::string command;
  // Or: a directory holding DIR/MODEL/SCENARIO.safetensors.
  std::string dumps_dir;
  std::string work_dir;  // where the command's dumps and logs go
  int timeout_s = 600;
};

// The placeholders of a scenario (replay of a golden dump): tokens, chunks,
// decode. Throws UsageError when its forward calls are not a prompt
// (possibly chunked) followed by one-token greedy decode steps.
std::map<std::string, std::string> scenario_placeholders(const Scenario& sc);

// `templ` with every {key} replaced by its value, shell-quoted. Throws
// UsageError naming an unknown placeholder.
std::string expand_command(const std::string& templ, const std::map<std::string, std::string>& values);

// The engine's dump of case `id` (MODEL/SCENARIO, '/' kept as a folder):
// runs the command (killed after timeout_s) or finds the file in dumps_dir.
// Throws Error with the exit status and the last lines of the command's
// output, or the missing path.
std::string external_dump(const ExternalEngine& e, const std::string& model_dir, const std::string& id,
                          const Scenario& sc);

}  // namespace llmdiff::bisect
