// What the explainers (compare/explain.h) read beyond the comparison, the
// local errors and the zoo's diagnosis: measurements a bisection makes on
// the way (bisect/ runs the engines they need), kept with the result as
// data. Each is absent when it was not measured or does not apply.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "compare/paged_kv.h"
#include "dumps/model/config.h"

namespace llmdiff::compare {

// Evidence that is gathered only when the explainers reach the one reading
// it (each costs engine runs): the zoo's diagnosis (hypothesis replays,
// fingerprints, error signatures), the run with a precision profile's
// roundings, the replay of a batch's schedule with each batch bug.
enum class Need { Nothing, Diagnosis, Rounding, BatchReplay, TensorParallel };

// A float32 candidate that diverges, judged again at the 16-bit dtype its
// weights are stored in (an engine rounding its matmul inputs to it).
struct WeightsDtypeCheck {
  ComputeDType dtype = ComputeDType::BFloat16;
  bool within_noise = false;  // every name within the noise floor judged at that dtype
  // Over the names that diverge as float32: the median of the candidate's
  // error over the 16-bit run's (both against the float64 truth); nullopt
  // when none was measured. Within the 16-bit noise is not enough (a small
  // bug hides in it too): the error must be of the 16-bit run's size.
  std::optional<double> median_ratio;
};

// The candidate's KV cache holds every value rounded to a 16-bit type
// (LocalSite::stored_as), and how its local failures relate to that
// (bisect/ggml_rounding.h knows which ops read the cache in its type).
struct KvCacheRounding {
  ComputeDType stored_as = ComputeDType::Float16;
  // Every local failure is an attention product reading the cache, within
  // that type's rounding (ggml multiplies q by the cache, and the
  // probabilities by V, in the cache's type); false when none fails.
  bool products_only = false;
  std::string first_product;      // the first of those failures
  double product_rmse = 0;        // its local rmse
  double product_relative = 0;    // that rmse over the rms of its value
  size_t failing = 0;             // local failures
  bool fused = false;             // no attention probabilities in the dump: a fused (flash) attention
};

// The clean engine making a precision profile's roundings (e.g. ggml's
// matmul inputs for quantised weights), run up to the candidate's first
// local failure, against the candidate there.
struct RoundingProbe {
  std::string profile;        // the profile's manifest JSON
  std::string flags;          // the same as `import --precision` flags
  std::string at;             // the site
  double to_profile = 0;      // rmse of the candidate against the run with the profile
  double to_plain = 0;        // ... against the reference at float32
};

// A block of a paged cache in the tables of two live sequences, at or
// before the engine iteration where the first divergent sequence goes wrong.
struct BlockReuse {
  std::string bug;   // the zoo's bug with that signature
  std::string text;  // the paged-cache finding, with its numbers
  int seq = 0, step = 0, iteration = 0;
};

// The batch's engine schedule replayed with each batch bug of the zoo,
// against the first divergent sequence's diverging names.
struct BatchReplayEvidence {
  int seq = 0;
  size_t iterations = 0;           // engine iterations replayed
  std::vector<std::string> fits;   // bugs reproducing every diverging name, in the zoo's order
  std::vector<std::optional<double>> values;  // each fit's parameter (rope-theta=...), nullopt for none
  std::vector<std::string> descriptions;  // what each of them does
  int compared = 0;                // diverging names compared (the first fit's)
  double worst = 0;                // the first fit's largest rmse / agreement threshold
  std::string tried;               // per bug: "name agree/compared"
};

// A tensor-parallel candidate (docs/DUMP_FORMAT.md "Tensor parallelism")
// judged rank by rank (compare/tensor_parallel.h): exact evidence at an
// all-reduce or a rank's shard, else the candidate's calls replayed over
// its ranks with each tensor-parallel bug of the zoo.
struct TensorParallelEvidence {
  int ranks = 0;
  // The rank check that found the bug: the zoo's bug, the name (canonical,
  // unsharded) where it shows, the rank it is about (-1: every rank), and
  // what was measured. Empty bug: every check passed or none applied.
  std::string bug, at, text;
  int rank = -1;
  // The replay with each tensor-parallel bug (made when no check speaks):
  // those reproducing every diverging name, the first fit's numbers, and
  // per bug "name agree/compared".
  std::vector<std::string> fits, descriptions;
  int compared = 0;
  double worst = 0;
  std::string tried;
  bool replayed = false;
};

struct Evidence {
  std::vector<Need> gathered;    // the needs gathered so far (a refused one may be asked again)
  bool diagnosed = false;        // the zoo's hypotheses were tested (BisectResult::diagnosis)
  std::optional<RingWrap> ring;  // a ring KV cache that wraps
  std::optional<WeightsDtypeCheck> weights_dtype;
  std::optional<KvCacheRounding> kv_cache;
  std::optional<RoundingProbe> rounding;
  std::optional<BlockReuse> block_reuse;
  std::optional<BatchReplayEvidence> batch_replay;
  std::optional<TensorParallelEvidence> tensor_parallel;
};

}  // namespace llmdiff::compare
