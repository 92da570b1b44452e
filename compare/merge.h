// `llmdiff merge`: the JSON results of shards of one bisection (`bisect
// --layers A:B --json`, schema llmdiff.bisect/1 with a "layers" key) joined
// into the document of the whole run.
//
// Each name belongs to one shard (dumps/contract/layer_window.h), so the merged
// comparison and local report are the shards' lists in canonical order; the
// verdict fails when any shard does; the first divergence and the first local
// failure are the first in canonical order over all shards; the diagnosis is
// the one of the shard holding the site it is about (the first local
// failure, else the first divergence). The local errors are those of the
// whole run exactly (each site is recomputed from the candidate's own inputs
// either way); the comparison of a shard starting past layer 0 runs from the
// candidate's residual stream entering it, so past the first divergence it
// counts the names that diverge by themselves in that shard, not every name
// downstream of the first.
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace llmdiff::compare {

struct ShardResult {
  std::string file;       // where it was read from (for errors)
  nlohmann::json result;  // bisect --layers A:B --json
};

// Throws UsageError when the parts are not shards of one bisection whose
// layer ranges cover the model once (naming the file and what differs).
nlohmann::json merge_bisect_shards(std::vector<ShardResult> parts);

// The merged result in a few lines: the verdict, the first divergence, the
// first local failure and the diagnosis, each with the shard it came from.
std::string render_merged_summary(const nlohmann::json& merged);

}  // namespace llmdiff::compare
