#include "dumps/contract/consistency.h"

#include <algorithm>
#include <string>
#include <vector>

#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"

namespace llmdiff {

namespace {

// The architecture fields two configs of one model share.
void check_same_model(const TensorSource& dump, const ModelConfig& model) {
  if (dump.manifest().config.empty()) return;
  ModelConfig d;
  try {
    d = parse_config(dump.manifest().config, dump.label() + " manifest config");
  } catch (const ConfigError&) {
    return;  // an unparsable manifest config says nothing about the model; inspect reports it
  }
  const std::vector<std::tuple<const char*, int64_t, int64_t>> fields = {
      {"hidden_size", d.hidden_size, model.hidden_size},
      {"num_hidden_layers", d.num_hidden_layers, model.num_hidden_layers},
      {"num_attention_heads", d.num_attention_heads, model.num_attention_heads},
      {"num_key_value_heads", d.num_key_value_heads, model.num_key_value_heads},
      {"head_dim", d.head_dim, model.head_dim},
      {"intermediate_size", d.intermediate_size, model.intermediate_size},
      {"vocab_size", d.vocab_size, model.vocab_size}};
  std::string differ;
  for (const auto& [field, a, b] : fields)
    if (a != b)
      differ += (differ.empty() ? "" : ", ") + std::string(field) + " " + std::to_string(a) + " (model: " +
                std::to_string(b) + ")";
  if (d.family != model.family)
    differ = "model_type '" + d.model_type + "' (model: '" + model.model_type + "')" + (differ.empty() ? "" : ", ") + differ;
  if (!differ.empty())
    throw ConfigError(dump.label(), "the dump's manifest config describes another model than " + model.source +
                                        ": " + differ);
}

}  // namespace

void check_dump_against_model(const TensorSource& dump, const ModelConfig& model) {
  check_same_model(dump, model);
  const std::vector<std::string> names = dump.names();
  for (const std::string& n : names) {
    const CanonName c = parse_name(n);
    if (c.kind == CanonName::Kind::Layer && c.layer >= model.num_hidden_layers)
      throw FormatError(dump.label(), n, "layer " + std::to_string(c.layer) + " but the model (" + model.source +
                                             ") has " + std::to_string(model.num_hidden_layers) + " layers");
  }
  const std::vector<std::vector<int64_t>> steps = dump.step_tokens();
  for (size_t s = 0; s < steps.size(); ++s)
    for (size_t i = 0; i < steps[s].size(); ++i)
      if (steps[s][i] < 0 || steps[s][i] >= model.vocab_size)
        throw FormatError(dump.label(), step_name(int(s), Site::Tokens),
                          "token " + std::to_string(steps[s][i]) + " at index " + std::to_string(i) +
                              " is outside the vocabulary [0, " + std::to_string(model.vocab_size) + ")");
  // Positions (out of order, shifted, restarting) are what the candidate
  // computed: the bisection judges them, never an input error.
}

}  // namespace llmdiff
