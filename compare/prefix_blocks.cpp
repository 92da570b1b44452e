#include "compare/prefix_blocks.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>

#include "dumps/contract/calls.h"
#include "dumps/contract/sequences.h"
#include "dumps/contract/sites.h"
#include "dumps/model/config.h"

namespace llmdiff::compare {

namespace {

// One sequence as the check reads it: its tokens by position, its hit, and
// layer 0's key cache rows of each step [S, width] (position-major).
struct SeqRows {
  int seq = 0;
  std::vector<int64_t> tokens;  // by position
  int64_t hit = 0;              // positions served from the prefix cache at step 0
  std::vector<CallSpan> spans;
  std::vector<std::vector<float>> rows;  // per step: [S, width], empty when not dumped
  int64_t width = 0;
};

// k_cache [H, S, Dh] -> [S, H*Dh]; latent_cache [S, R] as it is.
std::vector<float> position_major(const TensorData& t, int64_t* width) {
  if (t.shape.size() == 2) {
    *width = t.shape[1];
    return t.f;
  }
  const int64_t H = t.shape[0], S = t.shape[1], D = t.shape[2];
  *width = H * D;
  std::vector<float> out(size_t(S * H * D));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t s = 0; s < S; ++s)
      std::copy_n(&t.f[size_t((h * S + s) * D)], D, &out[size_t((s * H + h) * D)]);
  return out;
}

std::optional<SeqRows> read_sequence(const TensorSource& batch, int b) {
  const SequenceView v(batch, b);
  SeqRows r;
  r.seq = b;
  r.spans = call_spans(v);
  if (r.spans.empty()) return std::nullopt;
  r.tokens = cached_prefix(v);
  r.hit = int64_t(r.tokens.size());
  const std::vector<std::vector<int64_t>> steps = v.step_tokens();
  for (size_t s = 0; s < steps.size(); ++s) {
    r.tokens.resize(size_t(r.spans[s].P));
    r.tokens.insert(r.tokens.end(), steps[s].begin(), steps[s].end());
    std::vector<float> rows;
    for (Site site : {Site::AttnKCache, Site::AttnLatentCache}) {
      const std::string name = layer_name(int(s), 0, site);
      if (!v.has(name)) continue;
      const TensorData t = v.get(name);
      if (t.is_int || (t.shape.size() != 3 && t.shape.size() != 2)) continue;
      int64_t w = 0;
      rows = position_major(t, &w);
      if (r.width == 0) r.width = w;
      if (w != r.width) rows.clear();
      break;
    }
    r.rows.push_back(std::move(rows));
  }
  return r;
}

// Row p of step s ([S, width]), or nullptr when the step does not hold it.
const float* row(const SeqRows& r, size_t s, int64_t p) {
  if (s >= r.rows.size() || r.rows[s].empty() || p >= int64_t(r.rows[s].size()) / r.width) return nullptr;
  return &r.rows[s][size_t(p * r.width)];
}

bool same_row(const float* a, const float* b, int64_t w) { return a && b && std::equal(a, a + w, b); }

// The first position before or at p where two sequences' tokens differ, -1 when none.
int64_t first_difference(const SeqRows& a, const SeqRows& b, int64_t p) {
  for (int64_t i = 0; i <= p; ++i)
    if (i >= int64_t(a.tokens.size()) || i >= int64_t(b.tokens.size()) || a.tokens[size_t(i)] != b.tokens[size_t(i)])
      return i;
  return -1;
}

// The sequence (other than r) whose own rows hold `value` at position p,
// with the step it holds it at.
std::optional<std::pair<const SeqRows*, size_t>> owner_of(const std::vector<SeqRows>& all, const SeqRows& r,
                                                          int64_t p, const float* value) {
  for (const SeqRows& o : all) {
    if (o.seq == r.seq || o.width != r.width) continue;
    for (size_t s = 0; s < o.rows.size(); ++s)
      if (same_row(row(o, s, p), value, r.width)) return std::make_pair(&o, s);
  }
  return std::nullopt;
}

std::string block_of(const TensorSource& batch, int seq, size_t step, int64_t p) {
  const std::string bt = sequence_prefix(seq) + step_name(int(step), Site::KvBlockTable);
  const KvCacheLayout layout = manifest_kv_cache(batch.manifest(), batch.label());
  if (!batch.has(bt) || layout.block_size <= 0) return "";
  const TensorData t = batch.get(bt);
  const int64_t i = p / layout.block_size;
  return t.is_int && i < int64_t(t.i.size()) ? " (block " + std::to_string(t.i[size_t(i)]) + ")" : "";
}

}  // namespace

std::vector<PagedKvFinding> check_prefix_blocks(const TensorSource& batch) {
  std::vector<PagedKvFinding> out;
  std::vector<SeqRows> all;
  for (int b : dump_sequences(batch))
    if (std::optional<SeqRows> r = read_sequence(batch, b)) all.push_back(std::move(*r));
  auto found = [&](const SeqRows& r, size_t step, const std::string& kind, const SeqRows& other,
                   const std::string& text) {
    PagedKvFinding f;
    f.seq = r.seq;
    f.step = int(step);
    f.kind = kind;
    f.text = text;
    f.other_seq = other.seq;
    f.iteration = engine_iteration(batch, r.seq, int(step)).value_or(-1);
    out.push_back(f);
  };
  for (const SeqRows& r : all) {
    // Rows served from the cache: another prefix's?
    for (int64_t p = 0; p < r.hit; ++p) {
      const float* served = row(r, 0, p);
      if (!served) break;
      const auto o = owner_of(all, r, p, served);
      if (!o) continue;
      const int64_t d = first_difference(r, *o->first, p);
      if (d < 0) continue;  // the same prefix: a rightful hit
      const std::string who = "seq" + std::to_string(o->first->seq);
      if (d < p) {
        found(r, 0, "prefix-stale", *o->first,
              "seq" + std::to_string(r.seq) + " step 0: the key cache row at position " + std::to_string(p) +
                  block_of(batch, r.seq, 0, p) + ", served from the prefix cache, is " + who +
                  "'s, whose tokens differ at position " + std::to_string(d) + " before it: a block of another "
                  "prefix served (a hash that does not cover the whole prefix)");
      } else {
        found(r, 0, "prefix-overwritten", *o->first,
              "seq" + std::to_string(r.seq) + " step 0: the key cache row at position " + std::to_string(p) +
                  block_of(batch, r.seq, 0, p) + ", served from the prefix cache, holds " + who +
                  "'s key for another token: " + who + " wrote into the block");
      }
      break;
    }
    // Rows that changed after they were held.
    bool reported = false;
    for (size_t s = 1; s < r.rows.size() && !reported; ++s) {
      const int64_t kept = r.spans[s].P;  // positions of the steps before, kept (a rollback drops the rest)
      for (int64_t p = 0; p < kept && !reported; ++p) {
        const float *before = row(r, s - 1, p), *now = row(r, s, p);
        if (!before || !now || same_row(before, now, r.width)) continue;
        const auto o = owner_of(all, r, p, now);
        if (!o || first_difference(r, *o->first, p) < 0) continue;
        const SeqRows& w = *o->first;
        found(r, s, w.hit > 0 ? "prefix-overwritten" : "block-shared", w,
              "seq" + std::to_string(r.seq) + " step " + std::to_string(s) + ": the key cache row at position " +
                  std::to_string(p) + block_of(batch, r.seq, s, p) + " changed after step " + std::to_string(s - 1) +
                  " and is now seq" + std::to_string(w.seq) + "'s, for its token " +
                  std::to_string(p < int64_t(w.tokens.size()) ? w.tokens[size_t(p)] : -1) + " (this sequence's is " +
                  std::to_string(r.tokens[size_t(p)]) + "): seq" + std::to_string(w.seq) +
                  " wrote into a block this one holds" +
                  (w.hit > 0 ? ", a block it shares through the prefix cache (no copy-on-write)" : ""));
        reported = true;
      }
    }
  }
  return out;
}

}  // namespace llmdiff::compare
