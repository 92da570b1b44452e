#include "compare/merge.h"

#include <algorithm>
#include <set>
#include <tuple>

#include "compare/bisect_report.h"
#include "compare/bisect_result.h"
#include "compare/finding.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"

namespace llmdiff::compare {

using json = nlohmann::json;

namespace {

bool name_less(const json& a, const json& b) {
  return NameOrder()(a.at("name").get<std::string>(), b.at("name").get<std::string>());
}

const json& field(const ShardResult& p, const char* key) {
  if (!p.result.is_object() || !p.result.contains(key))
    throw UsageError(p.file + ": no \"" + key + "\" (not the JSON of bisect --layers A:B --json)");
  return p.result.at(key);
}

int layer_field(const ShardResult& p, const char* key) {
  const json& l = field(p, "layers");
  if (!l.is_object() || !l.contains(key) || !l.at(key).is_number_integer())
    throw UsageError(p.file + ": not a shard (\"layers\" is " + l.dump() + "; bisect --layers A:B --json writes one)");
  return l.at(key).get<int>();
}

// Every element of the arrays at `at` (an object path) of every part, in part order.
std::vector<json> gather(const std::vector<ShardResult>& parts, const json::json_pointer& at) {
  std::vector<json> all;
  for (const ShardResult& p : parts)
    if (p.result.contains(at) && p.result.at(at).is_array())
      for (const json& e : p.result.at(at)) all.push_back(e);
  return all;
}

// gather() in canonical order of each element's "name" (stable: equal names
// keep part order).
json concat_sorted(const std::vector<ShardResult>& parts, const json::json_pointer& at) {
  std::vector<json> v = gather(parts, at);
  std::stable_sort(v.begin(), v.end(), name_less);
  return json(v);
}

// gather() of names, in canonical order.
json concat_names(const std::vector<ShardResult>& parts, const json::json_pointer& at) {
  std::vector<std::string> v;
  for (const json& e : gather(parts, at)) v.push_back(e.get<std::string>());
  sort_canonical(v);
  return json(v);
}

// gather() with each element once (notes).
json union_of(const std::vector<ShardResult>& parts, const json::json_pointer& at) {
  json out = json::array();
  std::set<std::string> seen;
  for (const json& e : gather(parts, at))
    if (seen.insert(e.dump()).second) out.push_back(e);
  return out;
}

std::string str_or_empty(const json& j, const char* key) {
  return j.contains(key) && j.at(key).is_string() ? j.at(key).get<std::string>() : "";
}

// The merged verdict in the words of compare/bisect_result.h's headline(),
// with the finding read back from the diagnosing shard.
std::string merged_headline(const json& m) {
  const json& local = m.at("local");
  const bool sampler_fails = m.contains("sampling") && m["sampling"].value("verdict", "") == "fail";
  return verdict_headline(finding_from_json(m.at("finding")), m.at("ok").get<bool>(),
                          m.at("compared").get<size_t>(), m.value("criterion", "") == "noise-floor",
                          local.is_object() ? std::optional<size_t>(local.value("recomputed", size_t(0)))
                                            : std::nullopt,
                          str_or_empty(m, "localised_at"), sampler_fails, "",
                          m.contains("sampling") && m["sampling"].is_object() ? m["sampling"].value("finding", "") : "");
}

}  // namespace

json merge_bisect_shards(std::vector<ShardResult> parts) {
  if (parts.empty()) throw UsageError("merge: no shard results given");
  for (const ShardResult& p : parts)
    if (str_or_empty(p.result, "schema") != kBisectSchema)
      throw UsageError(p.file + ": schema \"" + str_or_empty(p.result, "schema") + "\", expected " + kBisectSchema +
                       " (bisect --layers A:B --json)");
  std::stable_sort(parts.begin(), parts.end(), [](const ShardResult& a, const ShardResult& b) {
    return layer_field(a, "first") < layer_field(b, "first");
  });
  // One bisection: the same candidate, model, dtype, criterion and calls.
  const ShardResult& base = parts.front();
  const int num_layers = layer_field(base, "num_layers");
  for (const ShardResult& p : parts) {
    for (const char* key : {"candidate", "model", "dtype", "criterion"})
      if (field(p, key) != field(base, key))
        throw UsageError("merge: " + p.file + " and " + base.file + " are not shards of one bisection: \"" + key +
                         "\" is " + field(p, key).dump() + " vs " + field(base, key).dump());
    const json& calls = field(p, "scenario");
    const json steps = calls.is_object() ? calls.value("tokens_per_step", json()) : json();
    if (steps != base.result["scenario"].value("tokens_per_step", json()))
      throw UsageError("merge: " + p.file + " and " + base.file + " replay different forward calls");
    if (layer_field(p, "num_layers") != num_layers)
      throw UsageError("merge: " + p.file + " is a shard of a model of " +
                       std::to_string(layer_field(p, "num_layers")) + " layers, " + base.file + " of " +
                       std::to_string(num_layers));
  }
  // The ranges cover the layers once, in order.
  int next = 0;
  for (const ShardResult& p : parts) {
    const int first = layer_field(p, "first"), end = layer_field(p, "end");
    if (first != next)
      throw UsageError("merge: " + p.file + " holds layers " + std::to_string(first) + ":" + std::to_string(end) +
                       (first < next ? ", which overlap the shard before it" : "") +
                       (first > next ? ", but no shard holds layers " + std::to_string(next) + ":" +
                                           std::to_string(first)
                                     : std::string()));
    next = end;
  }
  if (next != num_layers)
    throw UsageError("merge: no shard holds layers " + std::to_string(next) + ":" + std::to_string(num_layers) +
                     " of the model's " + std::to_string(num_layers));

  json m = base.result;
  m["layers"] = nullptr;
  m["shards"] = json::array();
  for (const ShardResult& p : parts) m["shards"].push_back({{"file", p.file}, {"layers", field(p, "layers")}});
  // The finishing shard holds `generated` and the sampler's names.
  const ShardResult& last = parts.back();
  m["scenario"] = field(last, "scenario");

  // The comparison.
  json& diff = m["diff"];
  diff["tensors"] = concat_sorted(parts, json::json_pointer("/diff/tensors"));
  diff["only_in_reference"] = concat_names(parts, json::json_pointer("/diff/only_in_reference"));
  diff["only_in_candidate"] = concat_names(parts, json::json_pointer("/diff/only_in_candidate"));
  diff["notes"] = union_of(parts, json::json_pointer("/diff/notes"));
  size_t passed = 0, failed = 0;
  std::string first_divergence;
  for (const json& t : diff["tensors"]) {
    if (t.value("pass", false)) {
      ++passed;
    } else {
      ++failed;
      if (first_divergence.empty()) first_divergence = t.at("name").get<std::string>();
    }
  }
  diff["summary"] = {{"compared", diff["tensors"].size()},
                     {"passed", passed},
                     {"failed", failed},
                     {"only_in_reference", diff["only_in_reference"].size()},
                     {"only_in_candidate", diff["only_in_candidate"].size()}};
  diff["first_divergence"] = first_divergence.empty() ? json(nullptr) : json(first_divergence);
  diff["ok"] = failed == 0 && !diff["tensors"].empty();
  std::vector<json> tv = gather(parts, json::json_pointer("/diff/layer_trace"));
  auto part_rank = [](const json& g) {
    const std::string part = g.value("part", "");
    return part == "pre" ? 0 : part == "layer" ? 1 : 2;
  };
  std::stable_sort(tv.begin(), tv.end(), [&](const json& a, const json& b) {
    return std::make_tuple(a.value("step", 0), part_rank(a), a.value("layer", 0)) <
           std::make_tuple(b.value("step", 0), part_rank(b), b.value("layer", 0));
  });
  diff["layer_trace"] = json(tv);
  if (last.result.contains("diff") && last.result["diff"].contains("greedy"))
    diff["greedy"] = last.result["diff"]["greedy"];

  // The local errors.
  bool local_ran = false;
  size_t recomputed = 0;
  for (const ShardResult& p : parts)
    if (p.result.contains("local") && p.result["local"].is_object()) {
      local_ran = true;
      recomputed += p.result["local"].value("recomputed", size_t(0));
    }
  std::string first_local;
  if (local_ran) {
    json failing = concat_sorted(parts, json::json_pointer("/local/failing_sites"));
    if (!failing.empty()) first_local = failing.front().at("name").get<std::string>();
    m["local"] = {{"recomputed", recomputed},
                  {"failing", failing.size()},
                  {"first_failure", failing.empty() ? json(nullptr) : failing.front()},
                  {"failing_sites", failing},
                  {"not_recomputed", concat_names(parts, json::json_pointer("/local/not_recomputed"))}};
  } else {
    m["local"] = nullptr;
  }

  // The verdict, and where the error originates.
  const std::string localised = !first_local.empty() ? first_local : first_divergence;
  int exit_code = 0;
  for (const ShardResult& p : parts) exit_code = std::max(exit_code, field(p, "exit_code").get<int>());
  const bool ok = failed == 0 && first_local.empty() && !diff["tensors"].empty();
  m["ok"] = ok;
  m["exit_code"] = std::max(exit_code, ok ? 0 : 1);
  m["first_divergence"] = first_divergence.empty() ? json(nullptr) : json(first_divergence);
  m["first_local_failure"] = first_local.empty() ? json(nullptr) : json(first_local);
  m["localised_at"] = localised.empty() ? json(nullptr) : json(localised);
  m["compared"] = diff["tensors"].size();
  m["diverging"] = failed;
  m["notes"] = union_of(parts, json::json_pointer("/notes"));

  // The diagnosis (and what it declares) of the shard holding that site:
  // the one whose own first local failure, else first divergence, it is.
  const ShardResult* diagnosing = &base;
  for (const ShardResult& p : parts)
    if (!localised.empty() && str_or_empty(p.result, "localised_at") == localised) {
      diagnosing = &p;
      break;
    }
  for (const char* key : {"finding", "diagnosis", "declare_dtype", "declare_kv_cache", "declare_precision", "layout"})
    m[key] = field(*diagnosing, key);
  m["diagnosed_by"] = diagnosing->file;
  // A sampler's check: the finishing shard's.
  m.erase("sampling");
  for (const ShardResult& p : parts)
    if (p.result.contains("sampling")) m["sampling"] = p.result["sampling"];
  m["headline"] = merged_headline(m);
  return m;
}

std::string render_merged_summary(const json& m) {
  auto text = [](const json& j) { return j.is_string() ? j.get<std::string>() : std::string("none"); };
  std::string o = "llmdiff merge: " + std::to_string(m.value("shards", json::array()).size()) + " shards of " +
                  text(m.value("candidate", json())) + "\n";
  for (const json& s : m.value("shards", json::array()))
    o += "  layers " + std::to_string(s["layers"].value("first", 0)) + ":" +
         std::to_string(s["layers"].value("end", 0)) + "  " + s.value("file", "") + "\n";
  const json diff = m.value("diff", json::object());
  const json summary = diff.value("summary", json::object());
  o += "\nRESULT: " + std::string(m.value("ok", false) ? "no divergence" : "divergence") + ": " +
       std::to_string(summary.value("failed", 0)) + " of " + std::to_string(summary.value("compared", 0)) +
       " names diverge";
  const json local = m.value("local", json());
  if (local.is_object())
    o += ", " + std::to_string(local.value("failing", 0)) + " of " + std::to_string(local.value("recomputed", 0)) +
         " sites fail on their own inputs";
  o += "\n  first divergence      " + text(m.value("first_divergence", json())) + "\n";
  o += "  first local failure   " + text(m.value("first_local_failure", json())) + "\n";
  if (m.contains("finding")) {
    const Finding f = finding_from_json(m.at("finding"));
    if (f.kind != FindingKind::Passes) {
      o += "  diagnosis             " + headline(f) + ", from " + m.value("diagnosed_by", "") + "\n";
      o += "  evidence              " + explanation(f) + "\n";
    }
  }
  return o;
}

}  // namespace llmdiff::compare
