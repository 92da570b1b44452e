#include "dumps/contract/precision.h"

#include <cctype>

#include <nlohmann/json.hpp>

#include "dumps/base/errors.h"

namespace llmdiff {

namespace {

// "f16" -> F16 for the value set of `key`; false when unknown.
bool parse_value(const std::string& key, std::string v, PrecisionProfile& p) {
  for (char& c : v) c = char(std::tolower(static_cast<unsigned char>(c)));
  GgmlType t;
  if (v == "f32" || v == "float32") t = GgmlType::F32;
  else if (v == "f16" || v == "float16") t = GgmlType::F16;
  else if (v == "bf16" || v == "bfloat16") t = GgmlType::BF16;
  else if (key == "matmul_input" && v == "q8_0") t = GgmlType::Q8_0;
  else if (key == "matmul_input" && v == "q8_k") t = GgmlType::Q8_K;
  else if (key == "attention") {
    if (v != "flash" && v != "standard") return false;
    p.flash_attention = v == "flash";
    return true;
  } else if (key == "matmul_input" && v == "ggml") {
    p.weights = true;
    p.matmul_input = GgmlType::F32;
    return true;
  } else return false;
  if (key == "kv_cache") p.kv_cache = t;
  else p.matmul_input = t;
  return true;
}

const char* kValues = "kv_cache: f32, f16, bf16; matmul_input: f32, f16, bf16, q8_0, q8_k, ggml; attention: standard, flash";
bool known_key(const std::string& k) { return k == "kv_cache" || k == "matmul_input" || k == "attention"; }

// A string from the file as JSON with non-ASCII escaped (safe for messages).
std::string quoted(const std::string& s) { return nlohmann::json(s).dump(-1, ' ', true, nlohmann::json::error_handler_t::replace); }

std::string value_name(GgmlType t) {
  std::string s = ggml_type_name(uint32_t(t));
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

GgmlType PrecisionProfile::input_rounding(GgmlType w) const {
  if (weights) return ggml_vec_dot_type(w);
  return matmul_input;
}

std::string PrecisionProfile::str() const {
  std::string s;
  if (kv_cache != GgmlType::F32) s += "kv_cache=" + value_name(kv_cache);
  if (weights || matmul_input != GgmlType::F32)
    s += std::string(s.empty() ? "" : ",") + "matmul_input=" + (weights ? "ggml" : value_name(matmul_input));
  if (flash_attention) s += std::string(s.empty() ? "" : ",") + "attention=flash";
  return s;
}

std::string PrecisionProfile::json() const {
  nlohmann::json j = nlohmann::json::object();
  if (kv_cache != GgmlType::F32) j["kv_cache"] = value_name(kv_cache);
  if (weights || matmul_input != GgmlType::F32) j["matmul_input"] = weights ? "ggml" : value_name(matmul_input);
  if (flash_attention) j["attention"] = "flash";
  return j.dump();
}

PrecisionProfile PrecisionProfile::parse(const std::string& spec) {
  PrecisionProfile p;
  size_t at = 0;
  while (at <= spec.size() && !spec.empty()) {
    const size_t comma = spec.find(',', at);
    const std::string item = spec.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    if (eq == std::string::npos || !known_key(key) ||
        !parse_value(key, item.substr(eq + 1), p))
      throw UsageError("precision profile: '" + item + "' is not KEY=VALUE with " + kValues);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return p;
}

PrecisionProfile PrecisionProfile::from_manifest(const std::map<std::string, std::string>& extra,
                                                 const std::string& file) {
  PrecisionProfile p;
  auto it = extra.find("precision");
  if (it == extra.end()) return p;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(it->second);
  } catch (const nlohmann::json::exception&) {
    throw FormatError(file, "", "manifest key 'precision' is not JSON");
  }
  if (!j.is_object()) throw FormatError(file, "", "manifest key 'precision' is not a JSON object");
  for (auto kv = j.begin(); kv != j.end(); ++kv) {
    if (!known_key(kv.key()))
      throw FormatError(file, "", "manifest key 'precision': unknown key " + quoted(kv.key()) + " (known: " +
                                  kValues + ")");
    if (!kv.value().is_string() || !parse_value(kv.key(), kv.value().get<std::string>(), p))
      throw FormatError(file, "", "manifest key 'precision': " + kv.key() + " is " + kv.value().dump(-1, ' ', true, nlohmann::json::error_handler_t::replace) +
                                  " (known: " + kValues + ")");
  }
  return p;
}

}  // namespace llmdiff
