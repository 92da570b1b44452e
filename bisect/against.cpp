#include "bisect/against.h"

#include <map>
#include <memory>

#include "bisect/prefix_replay.h"
#include "bisect/spec_replay.h"
#include "bisect/tp_unshard.h"
#include "dumps/base/errors.h"
#include "dumps/contract/sequences.h"
#include "dumps/contract/sites.h"

namespace llmdiff::bisect {

namespace {

// One side's bisection with the views its results' names refer to.
struct BisectedSide {
  compare::AgainstSideInput input;
  std::vector<std::unique_ptr<TensorSource>> views;
  std::map<int, int64_t> replayed_prefix;  // seq -> its cached prefix, replayed as a call of its own

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

// Whether a sequence's calls need a view to be replayed as the reference
// runs them: a prefix-cache hit, speculative verify calls.
bool served(const TensorSource& seq) { return has_prefix_hit(seq) || has_verify_calls(seq); }

// `seq` as bisected: its cached prefix replayed as a call of its own, its
// verify calls as the one-token calls of their kept rows (the notes say how
// its steps are numbered then).
std::unique_ptr<TensorSource> as_bisected(std::unique_ptr<TensorSource> seq, int b, BisectedSide& side,
                                          std::vector<std::unique_ptr<TensorSource>>& keep) {
  if (has_prefix_hit(*seq)) {
    auto view = std::make_unique<PrefixReplayView>(*seq);
    side.input.notes.push_back("seq" + std::to_string(b) + ": " + view->note());
    side.replayed_prefix[b] = view->prefix_length();
    keep.push_back(std::move(seq));  // the view reads it
    seq = std::move(view);
  }
  if (has_verify_calls(*seq)) {
    auto view = std::make_unique<SpecSplitView>(*seq);
    side.input.notes.push_back("seq" + std::to_string(b) + ": " + view->note());
    keep.push_back(std::move(seq));
    seq = std::move(view);
  }
  return seq;
}

BisectedSide bisect_side(const ModelOracles& m, const TensorSource& file, const BisectOptions& opt, const char* side) {
  BisectedSide s;
  s.input.label = file.label();
  BisectOptions o = opt;
  if (opt.progress) o.progress = [&opt, side](const std::string& what) { opt.progress(std::string(side) + ": " + what); };
  std::vector<std::unique_ptr<TensorSource>> sources;  // what the views read
  // Tensor-parallel ranks: the rank-less run they make together.
  const TensorSource* whole = &file;
  if (has_rank_names(file)) {
    auto unsharded = std::make_unique<UnshardView>(file, m.model.config);
    s.input.notes.push_back(unsharded->note());
    whole = unsharded.get();
    sources.push_back(std::move(unsharded));
  }
  const TensorSource& dump = *whole;
  const std::vector<int> seqs = dump_sequences(dump);
  if (seqs.empty()) {
    std::unique_ptr<TensorSource> view = as_bisected(std::make_unique<Borrowed>(dump), 0, s, sources);
    compare::SequenceBisect b;
    b.seq = 0;
    b.result = bisect_candidate(m, *view, o);
    s.add(std::move(view), std::move(b));
  } else {
    s.input.several = true;
    bool views = false;
    for (int b : seqs) views = views || served(SequenceView(dump, b));
    if (!views) {
      compare::BatchBisect batch = bisect_batch(m, dump, o);
      s.input.notes = std::move(batch.notes);
      s.input.sampling = std::move(batch.sampling);
      for (compare::SequenceBisect& b : batch.sequences) {
        const int seq = b.seq;
        s.add(std::make_unique<SequenceView>(dump, seq), std::move(b));
      }
    } else {
      // The batch's schedule replay serves no prefix hits and rolls back no
      // drafts: each sequence against the reference running it alone, its
      // own clean run.
      s.input.notes.push_back("sequences served from a prefix cache or decoded speculatively: each sequence bisected "
                              "on its own (the noise floor's second run is the clean impl running it alone)");
      for (int b : seqs) {
        std::unique_ptr<TensorSource> view =
            as_bisected(std::make_unique<SequenceView>(dump, b), b, s, sources);
        compare::SequenceBisect r;
        r.seq = b;
        r.result = bisect_candidate(m, *view, o);
        s.add(std::move(view), std::move(r));
      }
    }
  }
  for (auto& src : sources) s.views.push_back(std::move(src));
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
  // A replayed prefix is the sequence's own first call as paired: said as
  // what the dump served.
  for (auto [side, out] : {std::pair{&sa, &r.a}, std::pair{&sb, &r.b}})
    for (compare::AgainstSequence& q : out->sequences) {
      auto it = side->replayed_prefix.find(q.bisect.seq);
      if (it != side->replayed_prefix.end()) q.cached_prefix = it->second;
    }
  if (opt.progress) opt.progress("sequences paired by prompt");
  if (r.model.empty()) r.model = dir_name(m.dir);
  return r;
}

}  // namespace llmdiff::bisect
