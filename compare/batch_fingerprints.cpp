#include "compare/batch_fingerprints.h"

#include <algorithm>
#include <cmath>

#include "compare/paged_kv.h"
#include "compare/serving_fingerprints.h"
#include "compare/signature_finders.h"
#include "dumps/base/dtype.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"
#include "dumps/contract/sites.h"
#include "dumps/zoo/bugs.h"

namespace llmdiff::compare {

namespace {

std::string named(zoo::Signature s) { return zoo::bug_with_signature(s).name; }

// Positions of a call that run on in steps of one from k != 0 after the
// cached ones (not a restart at 0: rope-position-reset's fingerprint).
}  // namespace

void batch_positions_shifted(const FingerprintScene& scene, std::vector<Fingerprint>& out) {
  const TensorSource& cand = scene.cand;
  // Only a sequence of several run together: one sequence alone shifted is
  // no batching bug (its shift is said by the positions' signature).
  if (!dynamic_cast<const SequenceView*>(&cand)) return;
  const std::vector<int64_t>& past = scene.past;
  for (int s = 0; s < int(past.size()); ++s) {
    const std::string name = step_name(s, Site::Positions);
    if (!cand.has(name)) continue;
    const TensorData p = cand.get(name);
    if (!p.is_int || p.i.empty()) continue;
    const int64_t k = p.i[0] - past[size_t(s)];
    if (k == 0 || (p.i[0] == 0 && past[size_t(s)] > 0)) continue;
    if (k == rejected_before(scene.scenario, s)) continue;  // a verify call's drafts not rolled back
    bool run = true;
    for (size_t t = 1; t < p.i.size(); ++t) run = run && p.i[t] == p.i[0] + int64_t(t);
    if (!run) continue;
    out.push_back({named(zoo::Signature::PositionsShifted),
                   name + " starts at " + std::to_string(p.i[0]) + " where the sequence has " +
                       std::to_string(past[size_t(s)]) + " cached positions: every position " +
                       (k > 0 ? "+" : "") + std::to_string(k) +
                       ", counted from another start than the sequence's own first token (the batch's padded or "
                       "packed rows)",
                   true});
    return;
  }
}

// attn.probs [H, T, S]: rows over the sequence's own keys that sum to
// clearly less than 1 (the softmax also covered keys that are not its own).
void batch_attention_leak(const FingerprintScene& scene, std::vector<Fingerprint>& out) {
  const TensorSource& cand = scene.cand;
  // A row's sum may miss 1 by its values' rounding: far more in 16 bits
  // (the engine's declared type, or the grid its probabilities lie on: a
  // float32 engine's softmax computed in 16 bits).
  const std::string& dtype = cand.manifest().dtype;
  auto tol_for = [](const std::string& d) { return d == "bfloat16" ? 5e-2 : d == "float16" ? 1e-2 : 1e-3; };
  for (const TensorComparison& t : scene.global.tensors) {
    if (t.pass || parse_name(t.name).site != site_name(Site::AttnProbs)) continue;
    const TensorData p = cand.get(t.name);
    if (p.is_int || p.shape.size() != 3 || p.shape[2] == 0) continue;
    auto on_grid = [&p](bool bf16) {
      return std::all_of(p.f.begin(), p.f.end(), [bf16](float x) {
        return (bf16 ? bf16_to_f32(f32_to_bf16(x)) : f16_to_f32(f32_to_f16(x))) == x;
      });
    };
    const double tol = std::max(tol_for(dtype), on_grid(true) ? tol_for("bfloat16")
                                                : on_grid(false) ? tol_for("float16") : 0.0);
    const int64_t rows = p.shape[0] * p.shape[1], S = p.shape[2];
    int64_t short_rows = 0;
    double lowest = 1.0, total = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0;
      for (int64_t s = 0; s < S; ++s) sum += p.f[size_t(r * S + s)];
      if (!std::isfinite(sum)) return;
      if (sum < 1.0 - tol) ++short_rows;
      lowest = std::min(lowest, sum);
      total += sum;
    }
    if (short_rows == 0) return;
    out.push_back({named(zoo::Signature::AttentionLeak),
                   t.name + ": " + std::to_string(short_rows) + " of " + std::to_string(rows) +
                       " probability rows over the sequence's own " + std::to_string(S) + " keys sum to less than 1 "
                       "(mean " + sig::num(total / double(rows)) + ", lowest " + sig::num(lowest) +
                       "): the softmax also covered keys outside the sequence (another sequence's, in a packed batch)",
                   true});
    return;
  }
}

// The paged cache's bookkeeping: a slot mapping off from the block table, a
// context read beyond the positions held.
void batch_paged_bookkeeping(const FingerprintScene& scene, std::vector<Fingerprint>& out) {
  for (const PagedKvFinding& f : check_paged_sequence(scene.cand)) {
    if (f.kind == "slot-mapping") {
      out.push_back({named(zoo::Signature::SlotMappingOff), f.text, true});
      return;
    }
    if (f.kind == "context-length" && f.text.find("too long") != std::string::npos) {
      out.push_back({named(zoo::Signature::ContextTooLong), f.text, true});
      return;
    }
  }
}

// The first failing attn.k_cache [Hkv, S, Dh] of a paged cache: its blocks of
// B positions are the reference's blocks in another order.
void batch_blocks_out_of_order(const FingerprintScene& scene, std::vector<Fingerprint>& out) {
  const TensorSource &cand = scene.cand, &ref = scene.ref;
  const KvCacheLayout layout = manifest_kv_cache(cand.manifest(), cand.label());
  if (layout.kind != "paged" || layout.block_size <= 0) return;
  const int64_t B = layout.block_size;
  for (const TensorComparison& t : scene.global.tensors) {
    if (t.pass || parse_name(t.name).site != site_name(Site::AttnKCache)) continue;
    const TensorData a = cand.get(t.name), b = ref.get(t.name);
    if (a.is_int || b.is_int || a.shape != b.shape || a.shape.size() != 3) return;
    const int64_t H = a.shape[0], S = a.shape[1], Dh = a.shape[2], nb = S / B;
    if (nb < 2) return;
    double scale = 0;
    for (float v : b.f) scale = std::max(scale, double(std::fabs(v)));
    // Max difference of candidate block i against reference block j, every head.
    auto block_diff = [&](int64_t i, int64_t j) {
      double d = 0;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < B; ++r)
          for (int64_t e = 0; e < Dh; ++e)
            d = std::max(d, std::fabs(double(a.f[size_t((h * S + i * B + r) * Dh + e)]) -
                                      b.f[size_t((h * S + j * B + r) * Dh + e)]));
      return d;
    };
    const double tol = 1e-3 * std::max(scale, 1e-30);
    std::vector<int64_t> from;  // candidate block i holds reference block from[i]
    for (int64_t i = 0; i < nb; ++i) {
      int64_t found = -1;
      for (int64_t j = 0; j < nb && found < 0; ++j)
        if (block_diff(i, j) <= tol) found = j;
      if (found < 0) return;
      from.push_back(found);
    }
    std::vector<int64_t> sorted = from;
    std::sort(sorted.begin(), sorted.end());
    bool permutation = true, identity = true;
    for (int64_t i = 0; i < nb; ++i) {
      permutation = permutation && sorted[size_t(i)] == i;
      identity = identity && from[size_t(i)] == i;
    }
    if (!permutation || identity) return;
    std::string order;
    for (int64_t j : from) order += (order.empty() ? "" : ", ") + std::to_string(j);
    out.push_back({named(zoo::Signature::BlocksOutOfOrder),
                   t.name + " holds the reference's blocks of " + std::to_string(B) + " positions in the order [" +
                       order + "] (block i of the candidate is block order[i] of the reference): the cache was "
                       "gathered through its block table out of order",
                   true});
    return;
  }
}

}  // namespace llmdiff::compare
