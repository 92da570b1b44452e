// llmdiff's two engines built by name, and the manifest of a dump one writes:
// what the commands and the bisect pipeline share.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/model/weights.h"

namespace llmdiff::bisect {

struct EngineOptions {
  std::string dtype;                 // ref compute dtype; empty: the checkpoint's torch_dtype
  int threads = 0;                   // 0: all cores
  int64_t max_seq = 0;               // impl KV capacity; 0: max_position_embeddings
  std::vector<std::string> inject;   // impl bug zoo
  bool release_weights = false;      // impl: ImplOptions::release_weights
  std::string mla = "naive";         // impl, MLA models: ImplOptions::mla ("naive" or "absorbed")
  std::string precision;             // impl: a PrecisionProfile::parse() spec ("" = none)
  int64_t kv_ring = 0;               // impl: ImplOptions::kv_ring (0 = contiguous cache)
  int tensor_parallel = 1;           // impl: ImplOptions::tensor_parallel (ranks; 1 = none)
};

// Whether the impl keeps a checkpoint's pages resident or streams them
// layer by layer (ImplOptions::release_weights): resident when it fits the
// budget (`budget` <= 0: default_memory_budget(), half the memory available
// now), which `dump` and `bench` decide alike.
struct WeightPolicy {
  bool stream = false;
  int64_t checkpoint_bytes = 0, budget_bytes = 0;
  std::string str() const;  // "resident (2.20 GB checkpoint within a 11.50 GB budget)"
};
WeightPolicy weight_policy(const Model& model, int64_t budget);

// "ref" or "impl"; throws UsageError otherwise (or for bugs given to the ref).
std::unique_ptr<Engine> make_engine(const std::string& which, const Model& model, const EngineOptions& opt);

// The manifest of a dump produced by `engine` on `model` for `sc`.
Manifest make_manifest(const Engine& engine, const Model& model, const std::string& model_dir, const Scenario& sc);
// The same from the producer text and compute dtype (spec spelling).
Manifest make_manifest(const std::string& producer, const std::string& dtype, const Model& model,
                       const std::string& model_dir, const Scenario& sc);

// Basename of a directory path ("a/b/" -> "b").
std::string dir_name(const std::string& path);

}  // namespace llmdiff::bisect
