#include "compare/paged_kv.h"

#include <map>
#include <nlohmann/json.hpp>

#include "dumps/base/errors.h"
#include "dumps/contract/calls.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"
#include "dumps/contract/sites.h"

namespace llmdiff::compare {

namespace {

std::vector<int64_t> ints(const TensorSource& d, const std::string& name) {
  const TensorData t = d.get(name);
  if (!t.is_int) throw FormatError(d.label(), name, "expected an integer tensor");
  return t.i;
}

std::string who(int seq, int step) {
  return (seq >= 0 ? "seq" + std::to_string(seq) + " " : std::string()) + "step " + std::to_string(step);
}

// Blocks a sequence of S positions uses: the first ceil(S / B) entries.
int64_t blocks_used(int64_t S, int64_t B) { return B > 0 ? (S + B - 1) / B : 0; }

// The positions each step of a single-sequence dump holds: P before it, T
// new (after a prefix-cache hit, with verify calls' rollbacks).
using StepSpan = CallSpan;
std::vector<StepSpan> spans(const TensorSource& d) { return call_spans(d); }

}  // namespace

KvCacheLayout manifest_kv_cache(const Manifest& m, const std::string& where) {
  KvCacheLayout l;
  auto it = m.extra.find("kv_cache");
  if (it == m.extra.end()) return l;
  try {
    const nlohmann::json j = nlohmann::json::parse(it->second);
    l.kind = j.value("kind", std::string("contiguous"));
    l.block_size = j.value("block_size", int64_t(0));
    l.num_blocks = j.value("num_blocks", int64_t(0));
    l.capacity = j.value("capacity", int64_t(0));
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(where, "", "manifest 'kv_cache': " + std::string(e.what()));
  }
  if (l.kind != "contiguous" && l.kind != "paged" && l.kind != "ring")
    throw FormatError(where, "", "manifest 'kv_cache': unknown kind '" + l.kind + "' (contiguous, paged, ring)");
  if (l.kind == "paged" && l.block_size <= 0)
    throw FormatError(where, "", "manifest 'kv_cache': a paged cache needs block_size > 0");
  if (l.kind == "ring" && l.capacity <= 0)
    throw FormatError(where, "", "manifest 'kv_cache': a ring cache needs capacity > 0");
  return l;
}

std::vector<PagedKvFinding> check_paged_sequence(const TensorSource& d, int seq) {
  std::vector<PagedKvFinding> out;
  bool any = false;
  for (const std::string& n : d.names())
    if (n.find(".kv.") != std::string::npos) any = true;
  if (!any) return out;
  const KvCacheLayout layout = manifest_kv_cache(d.manifest(), d.label());
  const int64_t B = layout.block_size;
  const std::vector<StepSpan> sp = spans(d);
  for (int step = 0; step < int(sp.size()); ++step) {
    const int64_t P = sp[size_t(step)].P, T = sp[size_t(step)].T, S = P + T;
    auto add = [&](const std::string& kind, const std::string& text) {
      out.push_back({seq, step, kind, who(seq, step) + ": " + text});
    };
    const std::string ctx = step_name(step, "kv.context_len");
    if (d.has(ctx)) {
      const std::vector<int64_t> c = ints(d, ctx);
      if (c.size() == 1 && c[0] != S) {
        const int64_t k = c[0] - S;
        add("context-length", "kv.context_len " + std::to_string(c[0]) + ", the sequence holds " + std::to_string(S) +
                                  " positions: " +
                                  (k == 1    ? "one too long (attention reads a stale slot)"
                                   : k > 0   ? std::to_string(k) + " too long (stale slots read)"
                                   : k == -1 ? "one too short (the newest key is not read)"
                                             : std::to_string(-k) + " too short"));
      }
    }
    const std::string bt = step_name(step, "kv.block_table"), sm = step_name(step, "kv.slot_mapping");
    if (!d.has(bt) || B <= 0) continue;
    const std::vector<int64_t> table = ints(d, bt);
    if (int64_t(table.size()) < blocks_used(S, B)) {
      add("block-table", "kv.block_table has " + std::to_string(table.size()) + " blocks, " + std::to_string(S) +
                             " positions of block size " + std::to_string(B) + " need " +
                             std::to_string(blocks_used(S, B)));
      continue;
    }
    for (int64_t i = 0; i < blocks_used(S, B); ++i)
      if (table[size_t(i)] < 0 || (layout.num_blocks > 0 && table[size_t(i)] >= layout.num_blocks)) {
        add("block-range", "kv.block_table[" + std::to_string(i) + "] = " + std::to_string(table[size_t(i)]) +
                               " is outside the pool [0, " + std::to_string(layout.num_blocks) + ")");
        break;
      }
    if (!d.has(sm)) continue;
    const std::vector<int64_t> slots = ints(d, sm);
    if (int64_t(slots.size()) != T) {
      add("slot-mapping", "kv.slot_mapping has " + std::to_string(slots.size()) + " slots for " + std::to_string(T) +
                              " new tokens");
      continue;
    }
    // Slot of position p: its block's id x block size + p's offset in it.
    std::vector<int64_t> offsets;
    int64_t first_bad = -1;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = P + t, want = table[size_t(p / B)] * B + p % B;
      offsets.push_back(slots[size_t(t)] - want);
      if (first_bad < 0 && slots[size_t(t)] != want) first_bad = t;
    }
    if (first_bad < 0) continue;
    const int64_t p = P + first_bad;
    bool uniform = true;
    for (int64_t o : offsets) uniform = uniform && o == offsets[0];
    std::string text = "kv.slot_mapping writes position " + std::to_string(p) + " to slot " +
                       std::to_string(slots[size_t(first_bad)]) + ", its block table puts it at " +
                       std::to_string(table[size_t(p / B)] * B + p % B) + " (block " +
                       std::to_string(table[size_t(p / B)]) + ", offset " + std::to_string(p % B) + ")";
    if (uniform) text += ": every slot of this call off by " + std::to_string(offsets[0]);
    add("slot-mapping", text);
  }
  return out;
}

std::vector<PagedKvFinding> check_paged_blocks_shared(const TensorSource& batch) {
  std::vector<PagedKvFinding> out;
  const KvCacheLayout layout = manifest_kv_cache(batch.manifest(), batch.label());
  if (layout.kind != "paged") return out;
  const int64_t B = layout.block_size;
  std::map<int, std::vector<StepSpan>> spans_of;  // per sequence
  std::map<int, int64_t> hit_of;                   // per sequence: its prefix-cache hit
  struct Holder {
    int seq = 0, step = 0;
    bool partial_hit = false;  // the block its hit ends inside (it shares it, then writes into it)
  };
  for (int n = 0; batch.has("iter" + std::to_string(n) + ".seqs"); ++n) {
    std::map<int64_t, Holder> owner;  // block -> its holder in this iteration
    for (const auto& [seq, step] : iteration_members(batch, n)) {
      const std::string bt = sequence_prefix(seq) + step_name(step, Site::KvBlockTable);
      if (step < 0 || !batch.has(bt)) continue;
      if (!spans_of.count(seq)) {
        const SequenceView v(batch, seq);
        spans_of[seq] = spans(v);
        hit_of[seq] = int64_t(cached_prefix(v).size());
      }
      const auto& sp = spans_of[seq];
      if (step >= int(sp.size())) continue;
      const int64_t S = sp[size_t(step)].P + sp[size_t(step)].T, hit = hit_of[seq];
      const std::vector<int64_t> table = ints(batch, bt);
      // Blocks wholly inside its prefix-cache hit are read, never written:
      // shared by design.
      for (int64_t i = hit / std::max<int64_t>(B, 1); i < std::min<int64_t>(int64_t(table.size()), blocks_used(S, B));
           ++i) {
        const int64_t blk = table[size_t(i)];
        const Holder me{seq, step, hit % B != 0 && i == hit / B};
        auto it = owner.find(blk);
        if (it != owner.end() && it->second.seq != seq) {
          const Holder& other = it->second;
          const std::string both = "engine iteration " + std::to_string(n) + ": block " + std::to_string(blk) +
                                   " is in the block tables of seq" + std::to_string(other.seq) + " (step " +
                                   std::to_string(other.step) + ") and seq" + std::to_string(seq) + " (step " +
                                   std::to_string(step) + ")";
          if (me.partial_hit || other.partial_hit) {
            // Served to the one whose hit ends inside it, which then writes
            // its own positions into it: no copy-on-write.
            const Holder& writer = me.partial_hit ? me : other;
            const Holder& victim = me.partial_hit ? other : me;
            out.push_back({victim.seq, victim.step, "prefix-overwritten",
                           both + ": seq" + std::to_string(writer.seq) + "'s prefix-cache hit ends at position " +
                               std::to_string(hit_of[writer.seq]) + " inside it, and it writes its own positions "
                               "into the shared block instead of a copy (no copy-on-write)",
                           writer.seq, n});
          } else {
            out.push_back({seq, step, "block-shared",
                           both + ": a block reused before its sequence finished, or two sequences writing one block",
                           other.seq, n});
          }
          break;
        }
        owner[blk] = me;
      }
    }
  }
  return out;
}

std::optional<RingWrap> ring_wrap(const TensorSource& d) {
  const KvCacheLayout layout = manifest_kv_cache(d.manifest(), d.label());
  if (layout.kind != "ring") return std::nullopt;
  const std::vector<StepSpan> sp = spans(d);
  for (int step = 0; step < int(sp.size()); ++step) {
    const int64_t S = sp[size_t(step)].P + sp[size_t(step)].T;
    if (S <= layout.capacity) continue;
    RingWrap w{layout.capacity, step, S, ""};
    w.text = "ring KV cache of capacity " + std::to_string(layout.capacity) + " (manifest kv_cache): at step " +
             std::to_string(step) + " the sequence holds " + std::to_string(S) + " positions, so positions < " +
             std::to_string(S - layout.capacity) + " were overwritten; from this step the engine's attention no "
             "longer reads what HF's does";
    return w;
  }
  return std::nullopt;
}

}  // namespace llmdiff::compare
