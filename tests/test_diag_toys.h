// Toy dumps and runners of the diagnosis tests: two steps (T = 3 then 1)
// with positions, mask, k_cache, final_norm and logits, each structural bug
// switched on by a flag, and a hypothesis runner that returns stored dumps.
// Header-only; included by tests/test_compare_diag.cpp and
// tests/test_bisect_pipeline.cpp.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "compare/diagnose.h"
#include "dumps/base/errors.h"
#include "tests/test_compare_helpers.h"

namespace llmdiff::testing {

using compare::Fingerprint;
using compare::Hypothesis;
using compare::HypothesisRunner;

// Two steps (T = 3 then 1) of a toy dump: positions, mask, k_cache, final_norm, logits.
inline std::shared_ptr<MemoryDump> toy_dump(bool reset_positions, bool square_mask, bool overwrite_cache,
                                            float logits_scale) {
  auto d = std::make_shared<MemoryDump>("toy");
  d->mutable_manifest().dtype = "float32";
  d->mutable_manifest().scenario = "decode";
  d->put(int_tensor("step0.tokens", {3}, {5, 6, 7}));
  d->put(int_tensor("step1.tokens", {1}, {8}));
  d->put(int_tensor("step0.positions", {3}, {0, 1, 2}));
  d->put(int_tensor("step1.positions", {1}, {reset_positions ? 0 : 3}));
  d->put(float_tensor("step0.mask", {3, 3}, {1, 0, 0, 1, 1, 0, 1, 1, 1}));
  d->put(float_tensor("step1.mask", {1, 4},
                      square_mask ? std::vector<float>{1, 0, 0, 0} : std::vector<float>{1, 1, 1, 1}));
  const int64_t S1 = overwrite_cache ? 1 : 4;
  d->put(float_tensor("step0.layers.0.attn.k_cache", {1, 3, 2}, {1, 2, 3, 4, 5, 6}));
  d->put(float_tensor("step1.layers.0.attn.k_cache", {1, S1, 2}, std::vector<float>(size_t(2 * S1), 1.0f)));
  for (int s = 0; s < 2; ++s) {
    const int64_t T = s == 0 ? 3 : 1;
    std::vector<float> fn(size_t(T * 2)), lg(size_t(T * 3));
    for (size_t i = 0; i < fn.size(); ++i) fn[i] = float(i) * 0.5f + 1.0f;
    for (size_t i = 0; i < lg.size(); ++i) lg[i] = logits_scale * (float(i % 3) - 1.0f + 0.25f * float(i / 3));
    d->put(float_tensor(step_name(s, "final_norm"), {T, 2}, fn));
    d->put(float_tensor(step_name(s, "logits"), {T, 3}, lg));
  }
  return d;
}

inline Scenario toy_scenario() {
  Scenario sc;
  sc.name = "decode";
  sc.steps = {{5, 6, 7}, {8}};
  return sc;
}

inline bool fired(const std::vector<Fingerprint>& fps, const std::string& bug) {
  for (const auto& f : fps)
    if (f.bug == bug && f.decisive) return true;
  return false;
}

// A runner that "runs" each hypothesis by returning a stored dump.
class TableRunner : public HypothesisRunner {
 public:
  std::map<std::string, std::shared_ptr<MemoryDump>> runs;  // hypothesis str -> dump ("" = clean)
  std::vector<Hypothesis> hypotheses() const override {
    std::vector<Hypothesis> out;
    for (const auto& kv : runs)
      if (!kv.first.empty()) out.push_back(Hypothesis{kv.first, std::nullopt});
    return out;
  }
  std::vector<std::pair<std::string, std::string>> inapplicable() const override {
    return {{"missing-bias", "no biases"}};
  }
  std::unique_ptr<MemoryDump> run(const Hypothesis& h, const Scenario&,
                                  const std::vector<std::string>&) const override {
    auto it = runs.find(h.str());
    if (it == runs.end()) throw UsageError("no such run");
    return std::make_unique<MemoryDump>(*it->second);
  }
  std::optional<double> configured(const std::string&) const override { return std::nullopt; }
};


}  // namespace llmdiff::testing
