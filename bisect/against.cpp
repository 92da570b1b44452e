#include "bisect/against.h"

#include <map>
#include <memory>

#include "bisect/tensor_parallel.h"
#include "dumps/base/errors.h"
#include "dumps/contract/ranks.h"
#include "dumps/contract/sequences.h"
#include "dumps/contract/sites.h"

namespace llmdiff::bisect {

namespace {

// One side's bisection with the views its results' names refer to.
struct BisectedSide {
  compare::AgainstSideInput input;
  std::vector<std::unique_ptr<TensorSource>> views;

  void add(std::unique_ptr<TensorSource> view, compare::SequenceBisect s) {
    input.views.push_back(view.get());
    views.push_back(std::move(view));
    input.sequences.push_back(std::move(s));
  }
};

// A view that only borrows `src` (the single-sequence dump itself).
class Borrowed final : public TensorSource {
 public:
  explicit Borrowed(const TensorSource& src) : src_(src) {}
  const std::string& label() const override { return src_.label(); }
  const Manifest& manifest() const override { return src_.manifest(); }
  std::vector<std::string> names() const override { return src_.names(); }
  bool has(const std::string& n) const override { return src_.has(n); }
  Shape shape(const std::string& n) const override { return src_.shape(n); }
  TensorData get(const std::string& n) const override { return src_.get(n); }

 private:
  const TensorSource& src_;
};

// One configuration bisected as `llmdiff bisect` would: a prefix-cache hit
// and verify calls replayed as the format places them, tensor-parallel
// ranks unsharded and judged rank by rank (bisect/tensor_parallel.h),
// several sequences each against the reference running it alone.
BisectedSide bisect_side(const ModelOracles& m, const TensorSource& file, const BisectOptions& opt, const char* side) {
  BisectedSide s;
  s.input.label = file.label();
  BisectOptions o = opt;
  if (opt.progress) o.progress = [&opt, side](const std::string& what) { opt.progress(std::string(side) + ": " + what); };
  const bool tp = file.manifest().extra.count(tensor_parallel_key()) > 0;
  std::unique_ptr<RankView> unsharded;  // the rank-less run the ranks make together
  if (tp) unsharded = std::make_unique<RankView>(file, m.model.config);
  const TensorSource& dump = tp ? static_cast<const TensorSource&>(*unsharded) : file;
  const std::vector<int> seqs = dump_sequences(dump);
  if (seqs.empty()) {
    compare::SequenceBisect b;
    b.seq = 0;
    b.result = tp ? bisect_tensor_parallel(m, file, o) : bisect_candidate(m, file, o);
    s.add(std::make_unique<Borrowed>(dump), std::move(b));
  } else {
    s.input.several = true;
    compare::BatchBisect batch = tp ? bisect_tensor_parallel_batch(m, file, o) : bisect_batch(m, file, o);
    s.input.notes = std::move(batch.notes);
    s.input.sampling = std::move(batch.sampling);
    for (compare::SequenceBisect& b : batch.sequences) {
      const int seq = b.seq;
      s.add(std::make_unique<SequenceView>(dump, seq), std::move(b));
    }
  }
  if (unsharded) s.views.push_back(std::move(unsharded));
  return s;
}

}  // namespace

compare::TruthLogits float64_logits(const ModelOracles& m) {
  return [&m](const std::vector<int64_t>& tokens) {
    Scenario sc;
    sc.name = "float64 logits";
    sc.steps = {tokens};
    const std::string name = step_name(0, Site::NextLogits);
    const std::unique_ptr<MemoryDump> d = m.reference.run(sc, ComputeDType::Float64, {name});
    return d->get(name).floats();
  };
}

compare::AgainstResult bisect_against(const ModelOracles& m, const TensorSource& a, const TensorSource& b,
                                      const BisectOptions& opt) {
  if (!opt.noise_floor)
    throw UsageError("--against judges each side by its own noise floor: not with --no-noise-floor");
  if (!opt.layers.whole()) throw UsageError("--against: bisect both configurations whole, without --layers");
  BisectedSide sa = bisect_side(m, a, opt, "A");
  BisectedSide sb = bisect_side(m, b, opt, "B");
  compare::AgainstResult r = compare::pair_against(std::move(sa.input), std::move(sb.input), float64_logits(m));
  if (opt.progress) opt.progress("sequences paired by prompt");
  if (r.model.empty()) r.model = dir_name(m.dir);
  return r;
}

}  // namespace llmdiff::bisect
