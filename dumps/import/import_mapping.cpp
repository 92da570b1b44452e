// Mapping files of `llmdiff import`: parsing and validation (dumps/import/import.h).
#include <fstream>
#include <set>
#include <sstream>

#include <toml++/toml.h>

#include "dumps/base/errors.h"
#include "dumps/import/import.h"
#include "dumps/import/import_pattern.h"

namespace llmdiff::import {

using nlohmann::json;

namespace {

json toml_to_json(const toml::node& n) {
  if (const auto* t = n.as_table()) {
    json o = json::object();
    for (const auto& [k, v] : *t) o[std::string(k.str())] = toml_to_json(v);
    return o;
  }
  if (const auto* a = n.as_array()) {
    json o = json::array();
    for (const auto& v : *a) o.push_back(toml_to_json(v));
    return o;
  }
  if (const auto* s = n.as_string()) return s->get();
  if (const auto* i = n.as_integer()) return i->get();
  if (const auto* f = n.as_floating_point()) return f->get();
  if (const auto* b = n.as_boolean()) return b->get();
  return nullptr;  // dates and times: not used by mappings
}

bool is_int_or_expr(const json& v) { return v.is_number_integer() || v.is_string(); }

// Checks one transform's argument; throws `bad` with the reason.
void check_transform(const Transform& t, const std::function<void(const std::string&)>& bad) {
  const json& a = t.arg;
  auto want = [&](bool ok, const char* what) {
    if (!ok) bad(std::string("\"") + t.op + "\" takes " + what + ", not " + a.dump());
  };
  auto object_keys = [&](std::initializer_list<const char*> allowed, std::initializer_list<const char*> required) {
    want(a.is_object(), "an object");
    for (const auto& [k, v] : a.items()) {
      bool known = false;
      for (const char* x : allowed) known = known || k == x;
      if (!known) bad("\"" + t.op + "\" has no argument \"" + k + "\"");
    }
    for (const char* r : required)
      if (!a.contains(r)) bad("\"" + t.op + "\" needs \"" + r + "\"");
  };
  if (t.op == "reverse_dims" || t.op == "duplicate_halves") {
    want(a.is_null() || a == true, "no argument");
  } else if (t.op == "reshape") {
    want(a.is_array() && !a.empty(), "a list of dimensions (numbers or expressions)");
    for (const json& d : a) want(is_int_or_expr(d), "a list of dimensions (numbers or expressions)");
  } else if (t.op == "permute" || t.op == "transpose") {
    want(a.is_array() && (t.op == "permute" || a.size() == 2), t.op == "permute" ? "a list of axes" : "two axes");
    for (const json& d : a) want(d.is_number_integer(), "whole-number axes");
  } else if (t.op == "slice") {
    object_keys({"axis", "start", "end"}, {"axis", "end"});
    want(a["axis"].is_number_integer(), "an integer axis");
    want(is_int_or_expr(a["end"]) && (!a.contains("start") || is_int_or_expr(a["start"])), "start/end expressions");
  } else if (t.op == "select") {
    object_keys({"axis", "index"}, {"axis", "index"});
    want(a["axis"].is_number_integer() && is_int_or_expr(a["index"]), "an integer axis and an index");
  } else if (t.op == "split") {
    object_keys({"axis", "sizes"}, {"axis", "sizes"});
    want(a["axis"].is_number_integer() && a["sizes"].is_array() && a["sizes"].size() >= 2,
         "an axis and two or more sizes");
    for (const json& d : a["sizes"]) want(is_int_or_expr(d), "sizes as numbers or expressions");
  } else if (t.op == "deinterleave" || t.op == "interleave") {
    want(a.is_null() || is_int_or_expr(a), "a group size (default Dh)");
  } else if (t.op == "scale") {
    want(a.is_number() || a.is_string(), "a number or an expression");
  } else if (t.op == "bits") {
    want(a == "bf16" || a == "f16", "\"bf16\" or \"f16\"");
  } else if (t.op == "gather_paged") {
    object_keys({"block_table", "layout", "length"}, {"block_table"});
    want(a["block_table"].is_string(), "a block_table pattern");
    want(!a.contains("layout") || a["layout"] == "block,slot,head,dim" || a["layout"] == "block,head,slot,dim",
         "layout block,slot,head,dim or block,head,slot,dim");
    want(!a.contains("length") || is_int_or_expr(a["length"]), "a length expression");
  } else {
    bad("\"" + t.op + "\" is not a transform (reverse_dims, reshape, permute, transpose, slice, select, split, "
        "deinterleave, interleave, duplicate_halves, scale, bits, gather_paged)");
  }
}

Rule parse_rule(const json& r, int index, const std::string& source) {
  Rule rule;
  rule.index = index;
  auto bad = [&](const std::string& why) -> void {
    throw ConfigError(source, "rule " + std::to_string(index) +
                                  (rule.from.empty() ? "" : " (from \"" + rule.from + "\")") + ": " + why);
  };
  if (!r.is_object()) bad("not an object");
  if (!r.contains("from") || !r["from"].is_string() || r["from"].get<std::string>().empty())
    bad("needs \"from\": the engine's name pattern");
  rule.from = r["from"].get<std::string>();
  for (const auto& [k, v] : r.items())
    if (k != "from" && k != "to" && k != "occurrence" && k != "model_types" && k != "unless" && k != "requires" && k != "when" &&
        k != "rows" && k != "transforms" && k != "comment")
      bad("unknown key \"" + k + "\"");
  if (!r.contains("to")) bad("needs \"to\": the canonical name(s)");
  if (r["to"].is_string()) {
    rule.to.push_back(r["to"].get<std::string>());
  } else if (r["to"].is_array() && !r["to"].empty()) {
    for (const json& t : r["to"]) {
      if (!t.is_string()) bad("\"to\" holds a non-string");
      rule.to.push_back(t.get<std::string>());
    }
  } else {
    bad("\"to\" is a name or a list of names");
  }
  if (r.contains("occurrence")) {
    const json& o = r["occurrence"];
    if (o == "first") rule.occurrence = 0;
    else if (o == "last") rule.occurrence = -1;
    else if (o.is_number_integer()) rule.occurrence = o.get<int>();
    else bad("\"occurrence\" is \"first\", \"last\" or an index (negative from the last)");
  }
  if (r.contains("model_types")) {
    if (!r["model_types"].is_array()) bad("\"model_types\" is a list of config.json model_type values");
    for (const json& t : r["model_types"]) {
      if (!t.is_string()) bad("\"model_types\" holds a non-string");
      rule.model_types.push_back(t.get<std::string>());
    }
  }
  // A name or a list of names, each with the captures substituted.
  auto names = [&](const char* key, std::vector<std::string>& out) {
    if (!r.contains(key)) return;
    const json& v = r[key];
    if (v.is_string()) {
      out.push_back(v.get<std::string>());
      return;
    }
    if (!v.is_array()) bad(std::string("\"") + key + "\" is a name or a list of names");
    for (const json& x : v) {
      if (!x.is_string()) bad(std::string("\"") + key + "\" holds a non-string");
      out.push_back(x.get<std::string>());
    }
  };
  names("unless", rule.unless);
  names("requires", rule.requires_);
  if (r.contains("when")) {
    if (!r["when"].is_string()) bad("\"when\" is an expression");
    rule.when = r["when"].get<std::string>();
  }
  if (r.contains("rows")) {
    if (r["rows"] != "last" && r["rows"] != "all") bad("\"rows\" is \"all\" or \"last\"");
    rule.rows_last = r["rows"] == "last";
  }
  if (r.contains("transforms")) {
    if (!r["transforms"].is_array()) bad("\"transforms\" is a list");
    int k = 0;
    for (const json& t : r["transforms"]) {
      ++k;
      Transform tr;
      if (t.is_string()) {
        tr.op = t.get<std::string>();
      } else if (t.is_object() && t.size() == 1) {
        tr.op = t.begin().key();
        tr.arg = t.begin().value();
      } else {
        bad("transform " + std::to_string(k) + " is not a name or an object with one key: " + t.dump());
      }
      check_transform(tr, [&](const std::string& why) { bad("transform " + std::to_string(k) + ": " + why); });
      rule.transforms.push_back(std::move(tr));
    }
  }
  size_t outputs = 1;
  for (const Transform& t : rule.transforms)
    if (t.op == "split") outputs *= t.arg["sizes"].size();
  if (outputs != rule.to.size())
    bad("the transforms give " + std::to_string(outputs) + " tensor(s), \"to\" names " +
        std::to_string(rule.to.size()));
  try {
    const Pattern from = Pattern::compile(rule.from);
    for (const std::string& t : rule.to) from.check_template(t);
    for (const std::string& u : rule.unless) from.check_template(u);
    for (const std::string& q : rule.requires_) from.check_template(q);
    for (const Transform& t : rule.transforms)
      if (t.op == "gather_paged") from.check_template(t.arg["block_table"].get<std::string>());
  } catch (const UsageError& e) {
    bad(e.what());
  }
  return rule;
}

}  // namespace

std::string Rule::describe() const { return "rule " + std::to_string(index) + " (from \"" + from + "\")"; }

Mapping Mapping::from_json(const json& j, const std::string& source) {
  Mapping m;
  m.source = source;
  if (!j.is_object()) throw ConfigError(source, "a mapping is an object with \"rules\"");
  for (const auto& [k, v] : j.items())
    if (k != "format" && k != "description" && k != "dims" && k != "occurrence_suffix" && k != "ignore" &&
        k != "rules")
      throw ConfigError(source, "unknown key \"" + k + "\" (format, description, dims, occurrence_suffix, "
                                "ignore, rules)");
  if (j.contains("format") && j["format"] != "llmdiff-mapping/1")
    throw ConfigError(source, "format " + j["format"].dump() + " is not llmdiff-mapping/1");
  if (j.contains("description")) m.description = j["description"].is_string() ? j["description"].get<std::string>() : "";
  if (j.contains("dims")) {
    if (j["dims"] != "row_major" && j["dims"] != "ggml")
      throw ConfigError(source, "\"dims\" is \"row_major\" or \"ggml\" (fastest dimension first)");
    m.ggml_dims = j["dims"] == "ggml";
  }
  if (j.contains("occurrence_suffix")) {
    if (!j["occurrence_suffix"].is_string() || j["occurrence_suffix"].get<std::string>().empty())
      throw ConfigError(source, "\"occurrence_suffix\" is a non-empty string");
    m.occurrence_suffix = j["occurrence_suffix"].get<std::string>();
  }
  if (j.contains("ignore")) {
    if (!j["ignore"].is_array()) throw ConfigError(source, "\"ignore\" is a list of name globs");
    for (const json& g : j["ignore"]) {
      if (!g.is_string()) throw ConfigError(source, "\"ignore\" holds a non-string");
      m.ignore.push_back(g.get<std::string>());
    }
  }
  if (!j.contains("rules") || !j["rules"].is_array() || j["rules"].empty())
    throw ConfigError(source, "no \"rules\"");
  int index = 0;
  for (const json& r : j["rules"]) m.rules.push_back(parse_rule(r, ++index, source));
  return m;
}

Mapping Mapping::parse(const std::string& text, const std::string& source) {
  size_t p = text.find_first_not_of(" \t\r\n");
  if (p != std::string::npos && text[p] == '{') {
    json j;
    try {
      j = json::parse(text);
    } catch (const json::exception& e) {
      throw ConfigError(source, std::string("malformed JSON: ") + e.what());
    }
    return from_json(j, source);
  }
  // TOML mappings are plain ASCII (the parser's Unicode tables are not
  // trusted with arbitrary bytes); JSON takes any UTF-8.
  int line = 1, col = 0;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    ++col;
    if (c == '\n') {
      ++line;
      col = 0;
    } else if (c >= 0x80 || (c < 0x20 && c != '\t' && c != '\r')) {
      throw ConfigError(source, "line " + std::to_string(line) + ", column " + std::to_string(col) + ": byte 0x" +
                                    "0123456789abcdef"[c >> 4] + "0123456789abcdef"[c & 15] +
                                    ": a TOML mapping is plain ASCII (write names with other characters in a JSON "
                                    "mapping)");
    }
  }
  try {
    const toml::table t = toml::parse(text, source);
    return from_json(toml_to_json(t), source);
  } catch (const toml::parse_error& e) {
    std::ostringstream where;
    where << e.source().begin;
    throw ConfigError(source, "malformed TOML (" + where.str() + "): " + std::string(e.description()));
  }
}

Mapping Mapping::load(const std::string& path_or_name) {
  if (const char* text = bundled_mapping_text(path_or_name)) return parse(text, path_or_name + " (bundled)");
  std::ifstream in(path_or_name, std::ios::binary);
  if (!in) {
    std::string names;
    for (const auto& n : bundled_mapping_names()) names += (names.empty() ? "" : ", ") + n;
    throw IoError(path_or_name, "cannot open the mapping file (bundled mappings: " + names + ")");
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path_or_name);
}

}  // namespace llmdiff::import
