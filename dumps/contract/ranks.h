// Tensor-parallel dumps (docs/DUMP_FORMAT.md, "Tensor parallelism"): the
// manifest says `tensor_parallel: {"ranks": R}` and rank r's tensors are the
// canonical names behind `rank{r}.` (before any `seq{b}.`), each holding its
// shard by the rule of its site: its query heads, its kv heads (replicated
// when Hkv < R), its columns of the MLP, or its partial sum before the
// all-reduce; every other name is replicated.
//
// RankLayout says which heads and columns each rank holds: the impl's
// sharding (impl/tensor_parallel.h) and the reader's unsharding share it.
// RankView reads a tensor-parallel dump as the unsharded canonical dump
// (heads and columns concatenated in rank order, partial sums added in rank
// order), so that every analysis of a single-rank dump works on it, and
// gives each rank's own tensors to the checks that judge them one by one.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/contract/sites.h"
#include "dumps/model/config.h"

namespace llmdiff {

// The manifest key, and its value for R ranks: {"ranks": R}.
const char* tensor_parallel_key();
std::string tensor_parallel_json(int ranks);
// R of the manifest's tensor_parallel; 1 without the key. Throws
// FormatError naming the file for a value that is not {"ranks": R >= 1}.
int manifest_ranks(const Manifest& m, const std::string& label);

// "rank{r}."
std::string rank_prefix(int r);
// r when `name` starts with "rank{r}." (at most 6 digits), else -1; `rest`,
// when given, is set to where the name after the prefix starts.
int rank_of(const std::string& name, size_t* rest = nullptr);

// How one rank's tensor of a site relates to the unsharded tensor.
enum class ShardRule {
  Replicated,  // every rank holds all of it (the unsharded tensor is rank 0's)
  QueryHeads,  // the rank's query heads [r*Hq/R, (r+1)*Hq/R) on `axis`
  KvHeads,     // the rank's kv heads on `axis`: Hkv/R of them, or the one its query heads read when Hkv < R
  Columns,     // the MLP's intermediate columns [r*F/R, (r+1)*F/R) on `axis`
  PartialSum,  // the rank's partial sum before the all-reduce: the unsharded tensor is their sum in rank order
};
const char* shard_rule_name(ShardRule r);  // "replicated", "query heads", ...

struct ShardSpec {
  ShardRule rule = ShardRule::Replicated;
  int axis = 0;  // the axis of the heads or columns (QueryHeads, KvHeads, Columns)
  bool sharded() const { return rule != ShardRule::Replicated; }
};
// The rule of a site on a model: MLA's k_rope, k_cache and v_cache hold query
// heads, GQA's kv heads.
ShardSpec shard_spec(Site s, const ModelConfig& m);

// R ranks over a model's heads and columns.
struct RankLayout {
  int ranks = 1;
  int64_t q_heads = 0;   // query heads of each rank: Hq/R
  int64_t kv_heads = 0;  // kv heads of each rank: Hkv/R, or 1 (replicated) when Hkv < R; MLA: q_heads
  int64_t kv_total = 0;  // Hkv (MLA: Hq)
  bool kv_replicated() const { return kv_total < ranks; }
  // The kv head of rank r's local kv head j, as the spec splits them:
  // r*Hkv/R + j (rounded down when Hkv < R).
  int64_t kv_head(int r, int64_t j = 0) const;
  // The first rank holding kv head j (where the unsharded tensor takes it from).
  int holder(int64_t kv_head) const;
  // Throws UsageError saying what R does not divide (heads, kv heads, an
  // intermediate size).
  static RankLayout of(const ModelConfig& m, int ranks);
  // The same check: "" when R ranks fit the model, else why not.
  static std::string problem(const ModelConfig& m, int ranks);
  // The extent of the shard axis of one rank's tensor of `s` at layer
  // `layer`: its heads times the width each has on that axis, or its
  // columns; nullopt for a site that is not split along an axis.
  std::optional<int64_t> shard_extent(Site s, const ModelConfig& m, int64_t layer) const;
};

// A tensor-parallel dump as the unsharded canonical dump. Its names are the
// canonical names without `rank{r}.`; a name outside every rank is read as
// replicated (a producer may write a model-wide name once). The manifest is
// the source's without `tensor_parallel`. The source must outlive the view.
class RankView final : public TensorSource {
 public:
  // Checks that every sharded name is held by every rank, each with its
  // shard's shape, and that no rank is beyond R; throws MissingTensorError,
  // ShapeError or FormatError naming the file and the tensor.
  RankView(const TensorSource& source, const ModelConfig& m);
  const TensorSource& source() const { return src_; }
  int ranks() const { return layout_.ranks; }
  const RankLayout& layout() const { return layout_; }
  const ModelConfig& config() const { return cfg_; }
  // The rule of a canonical name (seq{b}. allowed).
  ShardSpec spec(const std::string& name) const;
  // Rank r's own tensor of canonical `name`: its shard or partial sum, or
  // (replicated) the copy the source holds, rank r's when it has one, else
  // rank 0's; "" when there is none.
  std::string rank_name(int r, const std::string& name) const;

  const std::string& label() const override { return src_.label(); }
  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> names() const override { return names_; }
  bool has(const std::string& name) const override { return held_.count(name) > 0; }
  Shape shape(const std::string& name) const override;
  TensorData get(const std::string& name) const override;

 private:
  const TensorSource& src_;
  ModelConfig cfg_;
  RankLayout layout_;
  Manifest manifest_;
  std::vector<std::string> names_;           // canonical order
  std::map<std::string, uint64_t> held_;     // canonical name -> bit r: rank r holds it (bit 63: no rank prefix)
};

// A tensor-parallel dump (its manifest has tensor_parallel) read unsharded
// with the model config of its manifest; nullptr for any other dump. Throws
// as RankView does, and ConfigError for a manifest without a readable config.
std::unique_ptr<RankView> unsharded(const TensorSource& d);

// Writes a tensor-parallel run's names: a name already under a rank as it
// is, any other (a replicated name, reported once) under rank0.
class RankZeroNames final : public Observer {
 public:
  explicit RankZeroNames(Observer& out) : out_(out) {}
  bool wants(const std::string& n) const override { return out_.wants(named(n)); }
  void on_f32(const std::string& n, const Shape& s, const float* d) override { out_.on_f32(named(n), s, d); }
  void on_i64(const std::string& n, const Shape& s, const int64_t* d) override { out_.on_i64(named(n), s, d); }

 private:
  static std::string named(const std::string& n) { return rank_of(n) >= 0 ? n : rank_prefix(0) + n; }
  Observer& out_;
};

}  // namespace llmdiff
