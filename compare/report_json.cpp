// JSON renderings of diff and regress results. The schema is documented in
// compare/README.md; fields are only ever added, never renamed or removed,
// without bumping the schema version.
#include <cmath>

#include "compare/report.h"

namespace llmdiff::compare {

namespace {
using nlohmann::json;

json shape_json(const Shape& s) { return json(s); }

json index_or_null(int64_t flat, const Shape& shape) {
  if (flat < 0) return nullptr;
  return json(unravel(flat, shape));
}

json manifest_json(const Manifest& m) {
  json j = json::object();
  for (const auto& kv : m.to_map()) {
    if (kv.first == "config") continue;  // large; the model name identifies it
    j[kv.first] = kv.second;
  }
  return j;
}

json side_json(const SideSummary& s) {
  return {{"label", s.label}, {"manifest", manifest_json(s.manifest)}, {"steps", s.steps}, {"tensors", s.tensors}};
}

json tolerance_json(const Tolerance& t) { return {{"rtol", json_num(t.rtol)}, {"atol", json_num(t.atol)}}; }

json nonfinite_json(const NonFiniteCounts& c, const Shape& shape) {
  return {{"nan", c.nan}, {"pos_inf", c.pos_inf}, {"neg_inf", c.neg_inf}, {"first_nan", index_or_null(c.first_nan, shape)}};
}

json finding_json(const LayoutFinding& f) {
  json j = {{"kind", finding_kind_name(f.kind)},
            {"summary", f.summary},
            {"matches", f.matches},
            {"cand_view", shape_json(f.cand_view)},
            {"ref_view", shape_json(f.ref_view)},
            {"perm", f.perm},
            {"rope", f.rope},
            {"max_abs", json_num(f.metrics.max_abs)},
            {"nmse", json_num(f.metrics.nmse)},
            {"min_atol", json_num(f.allclose.min_atol)}};
  if (f.kind == LayoutFinding::Kind::CacheLength) {
    j["ref_len"] = f.ref_len;
    j["cand_len"] = f.cand_len;
    j["extra_nonzero"] = f.extra_nonzero;
  }
  return j;
}

json tensor_json(const TensorComparison& t) {
  json j = {{"name", t.name},
            {"step", t.parsed.step},
            {"layer", t.parsed.layer},
            {"site", t.parsed.site},
            {"kind", t.is_int ? "int" : "float"},
            {"ref_shape", shape_json(t.ref_shape)},
            {"cand_shape", shape_json(t.cand_shape)},
            {"shape_match", t.shape_match},
            {"pass", t.pass},
            {"judgement",
             {{"judged", t.judgement.judged},
              {"pass", t.judgement.pass},
              {"metric", t.judgement.metric},
              {"value", json_num(t.judgement.value)},
              {"threshold", json_num(t.judgement.threshold)}}},
            {"tolerance", {{"rtol", json_num(t.tolerance.rtol)}, {"atol", json_num(t.tolerance.atol)}, {"source", t.tolerance_source}}},
            {"metrics", nullptr},
            {"allclose", nullptr},
            {"logits", nullptr},
            {"int", nullptr},
            {"findings", json::array()},
            {"notes", t.notes}};
  if (t.shape_match && !t.is_int) {
    const auto& m = t.metrics;
    j["metrics"] = {{"count", m.count},
                    {"finite_pairs", m.finite_pairs},
                    {"max_abs", json_num(m.max_abs)},
                    {"max_abs_at", index_or_null(m.max_abs_at, t.ref_shape)},
                    {"ref_at_max_abs", json_num(m.ref_at_max_abs)},
                    {"cand_at_max_abs", json_num(m.cand_at_max_abs)},
                    {"max_rel", json_num(m.max_rel)},
                    {"mean_abs", json_num(m.mean_abs)},
                    {"rmse", json_num(m.rmse)},
                    {"nmse", json_num(m.nmse)},
                    {"sqnr_db", json_num(m.sqnr_db)},
                    {"cosine", json_num(m.cosine)},
                    {"ref_max_abs", json_num(m.ref_max_abs)},
                    {"cand_max_abs", json_num(m.cand_max_abs)},
                    {"max_ulp", m.max_ulp},
                    {"ulp_dtype", compute_dtype_name(m.ulp_dtype)},
                    {"ref_nonfinite", nonfinite_json(m.ref_nonfinite, t.ref_shape)},
                    {"cand_nonfinite", nonfinite_json(m.cand_nonfinite, t.ref_shape)},
                    {"nonfinite_mismatch", m.nonfinite_mismatch}};
    const auto& a = t.allclose;
    j["allclose"] = {{"failing", a.failing},
                     {"fraction", json_num(a.fraction)},
                     {"first_fail", index_or_null(a.first_fail, t.ref_shape)},
                     {"worst_ratio", json_num(a.worst_ratio)},
                     {"min_atol", json_num(a.min_atol)},
                     {"min_rtol", json_num(a.min_rtol)}};
  }
  if (t.logits) {
    const auto& l = *t.logits;
    j["logits"] = {{"rows", l.rows},
                   {"argmax_agree", l.argmax_agree},
                   {"first_argmax_mismatch", l.first_argmax_mismatch < 0 ? json(nullptr) : json(l.first_argmax_mismatch)},
                   {"ref_argmax", l.ref_argmax},
                   {"cand_argmax", l.cand_argmax},
                   {"topk", l.topk},
                   {"topk_overlap", json_num(l.topk_overlap)},
                   {"kl_mean", json_num(l.kl_mean)},
                   {"kl_max", json_num(l.kl_max)}};
  }
  if (t.shape_match && t.is_int) {
    j["int"] = {{"count", t.ints.count},
                {"mismatches", t.ints.mismatches},
                {"first_mismatch", index_or_null(t.ints.first_mismatch, t.ref_shape)},
                {"ref_value", t.ints.ref_value},
                {"cand_value", t.ints.cand_value}};
  }
  for (const auto& f : t.findings) j["findings"].push_back(finding_json(f));
  return j;
}

const char* part_name(LayerTrace::Part p) {
  switch (p) {
    case LayerTrace::Part::Pre: return "pre";
    case LayerTrace::Part::Layer: return "layer";
    case LayerTrace::Part::Post: return "post";
  }
  return "?";
}
}  // namespace

json diff_to_json(const DiffResult& r) {
  json j;
  j["schema"] = kDiffSchema;
  j["ok"] = r.ok();
  j["reference"] = side_json(r.ref);
  j["candidate"] = side_json(r.cand);
  j["dtype"] = compute_dtype_name(r.dtype);
  j["dtype_source"] = r.dtype_source;
  j["tolerance"] = tolerance_json(r.base_tolerance);
  json ov = json::array();
  for (const auto& o : r.overrides) {
    json x = {{"glob", o.glob}, {"text", o.text}};
    x["rtol"] = o.rtol ? json_num(*o.rtol) : json(nullptr);
    x["atol"] = o.atol ? json_num(*o.atol) : json(nullptr);
    ov.push_back(x);
  }
  j["overrides"] = ov;
  j["criterion"] = r.criterion;
  j["sites"] = r.sites;
  j["summary"] = {{"compared", r.tensors.size()},
                  {"passed", r.passing()},
                  {"failed", r.failing()},
                  {"only_in_reference", r.only_in_ref.size()},
                  {"only_in_candidate", r.only_in_cand.size()}};
  j["first_divergence"] = r.first() ? json(r.first()->name) : json(nullptr);
  j["only_in_reference"] = r.only_in_ref;
  j["only_in_candidate"] = r.only_in_cand;
  j["notes"] = r.notes;
  j["tensors"] = json::array();
  for (const auto& t : r.tensors) j["tensors"].push_back(tensor_json(t));
  j["layer_trace"] = json::array();
  for (const auto& g : r.layer_trace) {
    j["layer_trace"].push_back({{"step", g.step},
                                {"part", part_name(g.part)},
                                {"layer", g.layer},
                                {"compared", g.compared},
                                {"failing", g.failing},
                                {"worst_nmse", json_num(g.worst_nmse)},
                                {"worst_nmse_site", g.worst_nmse_site},
                                {"worst_max_abs", json_num(g.worst_max_abs)},
                                {"worst_max_abs_site", g.worst_max_abs_site},
                                {"key_site", g.has_key ? json(g.key_site) : json(nullptr)},
                                {"key_nmse", g.has_key ? json_num(g.key_nmse) : json(nullptr)},
                                {"key_max_abs", g.has_key ? json_num(g.key_max_abs) : json(nullptr)}});
  }
  json steps = json::array();
  for (const auto& s : r.greedy.steps)
    steps.push_back({{"step", s.step}, {"ref_token", s.ref_token}, {"cand_token", s.cand_token}});
  j["greedy"] = {{"steps", steps},
                 {"first_divergent_step", r.greedy.first_divergent_step < 0 ? json(nullptr) : json(r.greedy.first_divergent_step)},
                 {"generated", r.greedy.has_generated
                                   ? json{{"reference", r.greedy.ref_generated},
                                          {"candidate", r.greedy.cand_generated},
                                          {"first_mismatch", r.greedy.first_generated_mismatch < 0
                                                                 ? json(nullptr)
                                                                 : json(r.greedy.first_generated_mismatch)}}
                                   : json(nullptr)}};
  return j;
}

std::string render_diff_json(const DiffResult& r) { return diff_to_json(r).dump(2) + "\n"; }

json regress_to_json(const RegressionReport& r) {
  json j;
  j["schema"] = kRegressSchema;
  j["ok"] = r.ok();
  j["golden"] = r.golden;
  j["policy"] = {{"f32_abs", json_num(r.policy.f32_abs)},
                 {"bf16_ref", tolerance_json(r.policy.bf16_ref)},
                 {"f16_ref", tolerance_json(r.policy.f16_ref)},
                 {"lowp_impl_nmse", json_num(r.policy.lowp_impl_nmse)},
                 {"require_all_names", r.policy.require_all_names},
                 {"external_all_names", r.policy.external_all_names}};
  j["summary"] = {{"cases", r.cases.size()}, {"passed", r.cases.size() - r.failing()}, {"failed", r.failing()}};
  j["cases"] = json::array();
  for (const auto& c : r.cases) {
    json x = {{"model", c.model},
              {"scenario", c.scenario},
              {"engine", c.engine_label()},
              {"engine_kind", engine_kind_name(c.engine)},
              {"model_dtype", compute_dtype_name(c.model_dtype)},
              {"dump", c.dump},
              {"rule", c.rule},
              {"pass", c.pass},
              {"error", c.error.empty() ? json(nullptr) : json(c.error)},
              {"worst", c.worst_name.empty() ? json(nullptr)
                                             : json{{"name", c.worst_name},
                                                    {"metric", c.worst_metric},
                                                    {"value", json_num(c.worst_value)},
                                                    {"threshold", json_num(c.worst_threshold)}}},
              {"failures", c.failures},
              {"missing", c.missing},
              {"seconds", json_num(c.seconds)},
              {"first_divergence", c.diff && c.diff->first() ? json(c.diff->first()->name) : json(nullptr)}};
    j["cases"].push_back(x);
  }
  return j;
}

std::string render_regress_json(const RegressionReport& r) { return regress_to_json(r).dump(2) + "\n"; }

}  // namespace llmdiff::compare
