// A tensor-parallel run, as a bisection reads it (docs/DUMP_FORMAT.md,
// "Serving features", "Tensor parallelism"): rank r's tensors under
// `rank{r}.` (before any `seq{b}.`), each holding its shard by the rule of
// its site. This view unshards them into the names of one rank-less run:
// query heads, kv heads and the MLP's columns concatenated in rank order
// (GQA kv heads replicated on R / Hkv ranks when Hkv < R: the first rank of
// each group's copy), partial sums (attn.out, mlp.down, moe.expert_out,
// moe.routed, moe.shared, moe.out) added in rank order in float32, every
// other name rank 0's copy (else the lowest rank that writes it). A rank's
// shard is judged inside the unsharded tensor, not on its own.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/model/config.h"

namespace llmdiff::bisect {

// Whether `dump` holds `rank{r}.` names.
bool has_rank_names(const TensorSource& dump);

class UnshardView final : public TensorSource {
 public:
  // Throws FormatError when the ranks are not 0 .. R-1 (manifest
  // tensor_parallel {"ranks": R} when given) or a sharded name lacks a rank.
  UnshardView(const TensorSource& dump, const ModelConfig& cfg);
  const std::string& label() const override { return dump_.label(); }
  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> names() const override { return names_; }
  bool has(const std::string& name) const override { return holders_.count(name) > 0; }
  Shape shape(const std::string& name) const override { return get(name).shape; }
  TensorData get(const std::string& name) const override;
  int ranks() const { return ranks_; }
  std::string note() const;

 private:
  const TensorSource& dump_;
  const ModelConfig& cfg_;
  int ranks_ = 0;
  Manifest manifest_;
  std::vector<std::string> names_;                  // canonical order, without the rank prefix
  std::map<std::string, std::vector<int>> holders_; // name -> the ranks writing it, ascending
};

}  // namespace llmdiff::bisect
