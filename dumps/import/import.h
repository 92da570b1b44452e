// `llmdiff import`: an engine's own tensors (dumps/import/foreign.h) turned into an
// llm-dump/1 file by a mapping (JSON or TOML, docs/IMPORT.md): name patterns
// with captures -> canonical names, and per rule the layout transforms of
// dumps/import/import_ops.h. Errors name the file, the tensor and the rule.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dumps/model/config.h"
#include "dumps/contract/dump.h"

namespace llmdiff::import {

struct Transform {
  std::string op;       // "reshape", "permute", ...
  nlohmann::json arg;   // its argument as written (null for none)
};

struct Rule {
  int index = 0;                         // 1-based, in the mapping's order
  std::string from;                      // pattern: text with {capture}s of digits
  std::vector<std::string> to;           // canonical names, {capture}s substituted
  int occurrence = -1;                   // of a name repeated in one call: 0 first, -1 last, -2 ...
  std::vector<std::string> model_types;  // empty: every model
  std::vector<std::string> unless;       // names (captures substituted): skipped when one exists
  std::vector<std::string> requires_;    // names (captures substituted): skipped unless all exist
  std::string when;                      // expression: skipped where it is 0
  bool rows_last = false;                // "rows": "last": the last R token rows only (dumps/contract/rows.h)
  std::vector<Transform> transforms;
  std::string describe() const;          // "rule 3 (from \"Qcur-{layer}\")"
};

struct Mapping {
  std::string source;  // the file, or "llama.cpp (bundled)"
  std::string description;
  bool ggml_dims = false;             // shapes stored fastest dimension first (ggml's ne[])
  std::string occurrence_suffix = "#"; // "Qcur-0#1": the second node named Qcur-0
  std::vector<Rule> rules;
  std::vector<std::string> ignore;    // patterns of foreign names deliberately not imported

  // Parses and validates (every transform known, with arguments of the right
  // kind). Throws ConfigError naming `source` and the rule.
  static Mapping from_json(const nlohmann::json& j, const std::string& source);
  static Mapping parse(const std::string& text, const std::string& source);  // JSON, else TOML
  // A mapping file, or the name of a bundled mapping ("llama.cpp").
  static Mapping load(const std::string& path_or_name);
};

// The names of the bundled mappings, and their text.
std::vector<std::string> bundled_mapping_names();
const char* bundled_mapping_text(const std::string& name);  // nullptr when unknown

struct ImportOptions {
  // Tokens of each forward call; empty: a rule must map step{N}.tokens.
  std::vector<std::vector<int64_t>> tokens;
  std::string dtype = "float32";  // the engine's compute dtype, for the manifest
  std::string producer;
  std::string model_name;
  std::string precision;  // a PrecisionProfile spec ("kv_cache=f16"), for the manifest; empty: none
};

struct ImportSummary {
  int steps = 0;
  int tensors = 0;
  std::vector<std::string> unmapped;        // foreign names no rule took (nor `ignore`)
  std::vector<std::string> unmatched_rules; // rules that matched nothing in any step
  std::vector<std::string> skipped;         // "name: why" of matches a `when`, `unless` or `requires` skipped
};

// Imports `inputs` (each a path for ForeignTensors). Without a {step}
// capture in any rule, input k holds forward call k; with one, the inputs
// are one pool of names. Every tensor produced is checked against the
// spec's shape for `model`.
ImportSummary import_tensors(const std::vector<std::string>& inputs, const Mapping& mapping, const ModelConfig& model,
                             const ImportOptions& opt, MemoryDump& out);

}  // namespace llmdiff::import
