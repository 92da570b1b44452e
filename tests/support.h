// Helpers shared by the test binaries (depends on dumps/ only).
#pragma once
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/sampling/sampling.h"

namespace llmdiff::testing {

std::string source_dir();              // the project root
std::string golden_dir();              // tests/golden
std::vector<std::string> golden_models();  // model directory names under tests/golden, sorted
std::string golden_model(const std::string& name);                          // tests/golden/NAME
std::string golden_dump(const std::string& model, const std::string& scenario);  // .../NAME/SCENARIO.safetensors
std::string temp_path(const std::string& stem);  // a fresh path in a per-process temp dir
// A whole file as a string (any bytes); throws std::runtime_error when it cannot be read.
std::string read_text(const std::string& path);
// Runs a shell command line, its stdout into `output`; returns its exit
// code (-1 when it could not start or did not exit).
int run_command(const std::string& cmd, std::string* output);
// Runs the built llmdiff binary with `args` (a shell word list) and stderr
// folded into stdout, `env` (VAR=VALUE words or -u VAR, for env(1)) in front;
// returns its exit code (-1 when it did not exit).
int run_binary(const std::string& args, std::string* output, const std::string& env = "");

// The JSON of <script type="application/json" id="ID"> in an HTML page
// (null when the page has none).
nlohmann::json embedded_json(const std::string& page, const std::string& id);

// HF's `scenario` dump of `model` with `change` applied, written to a fresh
// file under `stem` (returns its path).
std::string changed_golden(const std::string& model, const std::string& scenario, const std::string& stem,
                           const std::function<void(MemoryDump&)>& change);

// The sampled dump at `path` (single-sequence, with sampling parameters in
// its manifest) with each step's sample.scores / sample.probs recomputed by
// a sampler running `pipeline` on the dump's own next_logits and history,
// written to a fresh file under `stem` (returns its path). The token is the
// pipeline's draw at the recorded sample.u; without one, the recorded token
// when the pipeline's distribution holds it, else its most probable token.
// The tokens fed on are left as recorded. *departs: some step's scores or
// probs changed.
std::string resampled_dump(const std::string& path, const SamplerPipeline& pipeline, const std::string& stem,
                           bool* departs);

// max |a-b| over a tensor pair (shapes must match; throws otherwise).
double max_abs_diff(const TensorData& a, const TensorData& b);
// "" when the two sources hold the same names in the same order with
// byte-identical tensors (NaN payloads and signed zeros included), else
// what differs first.
std::string first_difference(const TensorSource& a, const TensorSource& b);
double max_abs(const TensorData& a);
// Σ(a-b)² / Σb²
double nmse(const TensorData& a, const TensorData& b);

}  // namespace llmdiff::testing
