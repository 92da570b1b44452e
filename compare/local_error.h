// Local errors (teacher forcing): every site of a dump recomputed with the
// reference's op from that dump's OWN inputs (q_rope from the dump's q and the
// reference rotary table, a layer's output from the dump's layer input, ...)
// and compared with the dump's output. A site whose local error exceeds the
// reference's own local rounding noise is wrong by itself; a site that only
// diverges globally merely inherits the error of an earlier one.
//
// compare/ sees the reference only through the LocalOracle interface (the
// libtorch-backed implementation lives in bisect/pipeline.cpp, over the
// teacher-forced decoder graph of ref/graph.h).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "compare/noise_floor.h"
#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/names.h"

namespace llmdiff::compare {

// A number as bug parameters are written: printf "%g" ("1e-05", "20000").
std::string value_str(double v);

// One bug hypothesis of the zoo: its name as `--inject` spells it and, for
// parameterised bugs (rope-theta, rmsnorm-eps), the value.
struct Hypothesis {
  std::string bug;
  std::optional<double> value;
  std::string str() const;  // "rope-interleaved", "rmsnorm-eps=1e-05"
  bool operator==(const Hypothesis& o) const { return bug == o.bug && value == o.value; }
};

// Sites recomputed from a dump's own inputs.
struct Recomputed {
  MemoryDump values{"recomputed"};             // full canonical names
  std::map<std::string, std::string> source;   // name -> the dump's tensors it was recomputed from
};

// A change of a projection that engines make by mistake:
//  - TransposedWeight: its weight's memory read as [in, out] instead of HF's
//    [out, in] (for a square matrix, x W instead of x W^T: an engine that
//    forgot to transpose);
//  - NormSkipped: the RMSNorm before it skipped, the projection applied to
//    the norm's input (q/k/v and MLA's q_a/kv_a of the layer's input,
//    gate/up of the residual stream after attention, MLA's q of q_a, the
//    logits of the last layer's output).
enum class ProjectionChange { TransposedWeight, NormSkipped };

class LocalOracle {
 public:
  virtual ~LocalOracle() = default;
  // Recomputes every site of `dump` that the oracle knows how to, at
  // `dtype`, from the dump's own values: each op reads its inputs from the
  // dump where the dump holds them and recomputes them (from their own inputs,
  // recursively) where it does not. A dump holding only `layers.*.out` thus
  // gets each layer recomputed from its layer input, every step in order with
  // the layer's own KV cache. With `h`, the ops run as the bug hypothesis
  // describes (supports(h) must be true). With `only`, just those of the
  // dump's sites (their inputs still read from the whole dump).
  virtual std::unique_ptr<Recomputed> recompute(const TensorSource& dump, ComputeDType dtype,
                                                const Hypothesis* h = nullptr,
                                                const std::vector<std::string>* only = nullptr) const = 0;
  // Whether recompute() can run the ops under `h`.
  virtual bool supports(const Hypothesis& h) const = 0;
  // A copy of the oracle on `threads` threads (nullptr: it cannot be split).
  virtual std::unique_ptr<LocalOracle> with_threads(int threads) const { return nullptr; }
  // A key per decoder layer: layers with equal keys run the same ops (a
  // dense or a MoE block), so a hypothesis changes the same sites in each.
  // Empty: unknown (every layer is recomputed under a hypothesis).
  virtual std::vector<int> layer_kinds() const { return {}; }
  // The projection at `name` (attn.q/k/v, attn.out, mlp.gate/up/down; MLA's
  // attn.q_a, attn.q, attn.kv_a, attn.kv; logits) recomputed in float64 from
  // the dump's own values with `change` (ProjectionChange), its first
  // min(T, max_rows) rows: [rows, out]. nullopt where the site has no such
  // weight or the dump lacks the input.
  virtual std::optional<std::vector<float>> changed_projection(const TensorSource& dump, const std::string& name,
                                                               ProjectionChange change, int64_t max_rows) const {
    return std::nullopt;
  }
};

// A read-only view of `base` restricted to `keep` (names absent from base are ignored).
class SubsetSource : public TensorSource {
 public:
  SubsetSource(const TensorSource& base, const std::vector<std::string>& keep);
  const std::string& label() const override { return base_.label(); }
  const Manifest& manifest() const override { return base_.manifest(); }
  std::vector<std::string> names() const override { return names_; }
  const TensorSource& base() const { return base_; }
  bool has(const std::string& name) const override;
  Shape shape(const std::string& name) const override;
  TensorData get(const std::string& name) const override;

 private:
  const TensorSource& base_;
  std::vector<std::string> names_;  // canonical order
  std::set<std::string> index_;
};

// The local verdict on one site.
struct LocalSite {
  std::string name;
  CanonName parsed;
  std::string source;         // what the recompute read
  bool is_int = false;
  bool shape_match = true;
  Shape cand_shape, local_shape;
  // Candidate vs its own float64 recompute.
  double max_abs = 0, nmse = 0;
  int64_t max_abs_at = -1;
  int64_t int_mismatches = 0;
  // Candidate and reference local RMSEs and the noise-floor verdict.
  bool has_ref_noise = false;  // the reference's local noise at this site is known
  // The local error is within the floor alone: it passes whatever the noise,
  // which was then not measured (RefOnDemand).
  bool within_floor = false;
  NoiseStats noise;
  bool pass = true;
  std::string note;
  // A cache site whose every value is the recompute rounded to this 16-bit
  // type (a lower-precision cache by design).
  std::optional<ComputeDType> stored_as;
};

struct LocalReport {
  bool ran = false;                        // false: no oracle (model not given or --no-local)
  ComputeDType dtype = ComputeDType::Float32;
  std::string hypothesis;                  // empty: the reference ops
  std::vector<LocalSite> sites;            // canonical order
  std::vector<std::string> not_recomputed; // candidate names the oracle could not recompute
  std::optional<size_t> first_failure;     // index into sites
  size_t failing() const;
  const LocalSite* find(const std::string& name) const;
  const LocalSite* first() const { return first_failure ? &sites[*first_failure] : nullptr; }
};

// Per name, the RMSE between a run's values and their float64 recompute from
// its own inputs: that run's local rounding noise. With the clean impl's run,
// the second honest noise of the local verdicts (as in the global noise
// floor: an op's float32 error depends on its accumulation order, and a
// sequential chain over a long reduction is several times OpenBLAS's).
using LocalNoise = std::map<std::string, double>;
LocalNoise local_noise(const TensorSource& values, const Recomputed& local);

// The second honest run's local noise, made only where a verdict needs it.
// It only raises a site's threshold (the larger of the two noises), so a
// site within the reference's own noise passes with it too: judge_local asks
// `fill` for the sites that fail without it (the run's own values recomputed
// at those names alone) instead of recomputing the whole run.
class SecondNoise {
 public:
  using Fill = std::function<LocalNoise(const std::vector<std::string>& names)>;
  SecondNoise() = default;
  explicit SecondNoise(LocalNoise known) : known_(std::move(known)) {}  // all there is
  explicit SecondNoise(Fill fill) : fill_(std::move(fill)) {}
  const LocalNoise& known() const { return known_; }
  // Makes the noise of those of `names` not asked before known (those the run can give).
  void need(const std::vector<std::string>& names);
  bool missing(const std::string& name) const { return fill_ && !asked_.count(name) && !known_.count(name); }
  size_t filled() const { return asked_.size(); }  // sites recomputed on demand so far

 private:
  LocalNoise known_;
  std::set<std::string> asked_;
  Fill fill_;
};

// The reference's values at the candidate's dtype, made only at the sites
// whose verdict needs them: a site whose local error is within the floor
// alone passes whatever the noise (threshold = m x noise + floor), so
// judge_local asks `fill` (the reference's ops at that dtype on the
// candidate's inputs, at those names alone) only for the others.
class RefOnDemand {
 public:
  using Fill = std::function<std::unique_ptr<Recomputed>(const std::vector<std::string>& names)>;
  explicit RefOnDemand(Fill fill);
  const TensorSource& values() const { return made_; }  // what has been made so far
  // Makes those of `names` not asked before (those the fill can give).
  void need(const std::vector<std::string>& names);
  bool missing(const std::string& name) const { return !asked_.count(name); }
  size_t asked() const { return asked_.size(); }

 private:
  // Every fill's values, read where they were made (spilled, not copied).
  class Made : public TensorSource {
   public:
    const std::string& label() const override { return label_; }
    const Manifest& manifest() const override { return manifest_; }
    std::vector<std::string> names() const override;
    bool has(const std::string& name) const override { return at.count(name) != 0; }
    Shape shape(const std::string& name) const override;
    TensorData get(const std::string& name) const override;
    std::vector<std::unique_ptr<Recomputed>> parts;
    std::map<std::string, const TensorSource*> at;

   private:
    std::string label_ = "reference at the candidate's dtype, where a verdict needs it";
    Manifest manifest_;
  };
  Fill fill_;
  std::set<std::string> asked_;
  Made made_;
};

// Judges each recomputed site: the candidate's local error (against
// `cand_local`, its float64 recompute) vs the reference's local error at
// `dtype` (`ref` against `ref_local`, recomputed from the same subset of
// names) or, where larger, `second` (another honest run's local noise).
// Integer sites (tokens, positions, generated) and sites without a reference
// noise level are compared exactly / by the floor alone. `sites` filters
// names (site globs; empty = all). With `lazy`, the reference's values are
// lazy->values() (`ref` is not read), made where a verdict needs them
// (`ref_local` their float64 recompute: the candidate's own, for the
// reference's ops on its inputs). Sites are judged `threads` at a time (0:
// every core); the report does not depend on it.
LocalReport judge_local(const TensorSource& cand, const Recomputed& cand_local, const TensorSource* ref,
                        const Recomputed* ref_local, ComputeDType dtype, const std::vector<std::string>& sites = {},
                        SecondNoise* second = nullptr, RefOnDemand* lazy = nullptr, int threads = 0);

// Runs the oracle on the candidate (float64) and on the reference at dtype
// restricted to the candidate's names (float64), then judge_local. With `h`,
// the candidate is recomputed under the hypothesis (the reference's noise
// always comes from the reference ops). `ref_local` may pass a reference
// recompute to reuse (it must come from the same subset of names).
LocalReport analyse_local(const LocalOracle& oracle, const TensorSource& cand, const TensorSource* ref,
                          ComputeDType dtype, const std::vector<std::string>& sites = {},
                          const Hypothesis* h = nullptr, const Recomputed* ref_local = nullptr,
                          SecondNoise* second = nullptr, RefOnDemand* lazy = nullptr);

// analyse_local under `h`, given the candidate's recompute with the
// reference ops (`clean`, judged as `clean_report`): only the sites `h` can
// change are recomputed. Those are found on the first layer of each kind
// (LocalOracle::layer_kinds), recomputed in full under `h` with every site
// outside the layers; in the other layers, the sites whose value changed
// there, and those computed from recomputed inputs. Every other site keeps
// its clean verdict: its op and its inputs (the candidate's) are the same.
// The report is analyse_local's; without layer kinds it is analyse_local.
LocalReport analyse_local_variant(const LocalOracle& oracle, const TensorSource& cand, const Recomputed& clean,
                                  const LocalReport& clean_report, const TensorSource* ref, ComputeDType dtype,
                                  const std::vector<std::string>& sites, const Hypothesis& h,
                                  const Recomputed* ref_local, SecondNoise* second = nullptr,
                                  RefOnDemand* lazy = nullptr);

// Whether `h` leaves the op at the candidate's site `name` as the reference
// ops compute it: that site alone recomputed under `h` from the candidate's
// own inputs at `dtype` gives exactly `clean`'s values there, `clean` being
// the same site recomputed at `dtype` without `h` (false when the oracle
// cannot recompute it). At float32: an op the hypothesis moves by less than
// float32's rounding everywhere cannot explain a local failure above the
// noise floor, and the product costs half a float64 one.
bool op_unchanged_under(const LocalOracle& oracle, const TensorSource& cand, const Recomputed& clean,
                        const std::string& name, const Hypothesis& h, ComputeDType dtype = ComputeDType::Float64);

// The reference's float64 recompute over the candidate's subset of names
// (what analyse_local needs as `ref_local`).
std::unique_ptr<Recomputed> recompute_reference(const LocalOracle& oracle, const TensorSource& cand,
                                                const TensorSource& ref);

}  // namespace llmdiff::compare
