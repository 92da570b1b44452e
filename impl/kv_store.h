// The KV cache seam: the one interface between the impl's forward
// (impl/forward.h) and wherever keys and values live. A forward call writes
// each sequence's new rows through it and reads back what that sequence's
// attention sees; the store decides where rows go:
//  - ContiguousKv: one sequence, rows in position order (a ring of C
//    positions is a view of it: attention reads the last C, the cache sites
//    show the ring's slots);
//  - PagedKv: a pool of fixed-size blocks shared by many sequences, a block
//    table per sequence, a slot for every new row.
//
// Each layer holds up to three streams of per-token rows: keys and values
// (GQA: [Hkv*Dh] each; MLA's naive form: every head's [Dn+Dr] key and [Dv]
// value) and MLA's latent rows [Rkv+Dr] (the normalised latent then the rope
// key k_pe: all the absorbed form caches). Keys and values are stored as the
// precision profile's kv_cache type rounds them; latent rows in float32.
#pragma once
#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dumps/formats/ggml_types.h"

namespace llmdiff::impl {

enum class KvStream { Key = 0, Value = 1, Latent = 2 };
constexpr int kKvStreams = 3;

// Row widths of the streams (0: the model keeps no such stream).
struct KvWidths {
  std::array<int64_t, kKvStreams> of{0, 0, 0};
  int64_t operator[](KvStream s) const { return of[size_t(s)]; }
};

// Where one sequence's part of a forward call writes and what it reads.
struct KvAccess {
  int seq = 0;                 // the sequence (PagedKv: its block table)
  int64_t write_at = 0;        // first position written (P; 0 when a call overwrites the cache)
  int64_t T = 0;               // rows written: positions [write_at, write_at + T)
  int64_t context = 0;         // positions attention reads: [0, context)
  std::vector<int64_t> slots;  // PagedKv: the pool slot each new row is written to [T]
};

class KvStore {
 public:
  virtual ~KvStore() = default;
  // Stores rows [a.T, width] of `s` for the access' new positions (PagedKv:
  // at a.slots), keys and values rounded to the store's type.
  virtual void write(int layer, KvStream s, const KvAccess& a, const float* rows) = 0;
  // Positions [0, a.context) of `s`, token-major [context, width]; valid
  // until the next read of the same stream.
  virtual const float* read(int layer, KvStream s, const KvAccess& a) = 0;
  // What the cache holds for the cache sites (k_cache, v_cache, latent
  // rows): the rows read, or a ring's slots; `rows` set to their count.
  virtual std::vector<float> held(int layer, KvStream s, const KvAccess& a, int64_t* rows);
  // Whether the store reports a block table, slots and context lengths (kv.*).
  virtual bool paged() const { return false; }
  // The block table of sequence `seq` (PagedKv), empty otherwise.
  virtual const std::vector<int64_t>& table(int seq) const;
  // For each entry of table(seq), the sequence that wrote the block (a
  // prefix cache's kv.block_source); empty when the store shares no blocks.
  virtual std::vector<int64_t> block_sources(int seq) const { return {}; }
  // The manifest's kv_cache (docs/DUMP_FORMAT.md); empty: contiguous.
  virtual std::string json() const { return ""; }
  int64_t width(KvStream s) const { return widths_[s]; }

 protected:
  KvStore(int layers, KvWidths widths, GgmlType storage) : layers_(layers), widths_(widths), storage_(storage) {}
  // Copies `n` rows of `s` into dst, keys and values rounded to the storage type.
  void store_rows(KvStream s, const float* src, int64_t n, float* dst) const;
  int layers_;
  KvWidths widths_;
  GgmlType storage_;
};

// One sequence's cache, every position in order; `ring` > 0: a ring of that
// many positions (Loom's pos % MaxSeqLen): held() shows its slots, slot j
// the newest position p with p mod ring = j, and the engine masks the
// positions the ring has overwritten.
class ContiguousKv final : public KvStore {
 public:
  ContiguousKv(int layers, KvWidths widths, GgmlType storage, int64_t ring = 0);
  void write(int layer, KvStream s, const KvAccess& a, const float* rows) override;
  const float* read(int layer, KvStream s, const KvAccess& a) override;
  std::vector<float> held(int layer, KvStream s, const KvAccess& a, int64_t* rows) override;
  std::string json() const override;
  void clear();
  // Keeps the first `positions` positions of every layer and stream.
  void truncate(int64_t positions);
  int64_t ring() const { return ring_; }

 private:
  std::vector<std::array<std::vector<float>, kKvStreams>> rows_;  // per layer, per stream [positions, width]
  int64_t ring_;
};

// A paged cache: per layer and stream a pool [num_blocks * block_size,
// width]; a block allocator and a block table per sequence. Reading gathers
// a sequence's positions through its table into a scratch per stream.
//
// With a prefix cache, full blocks stay indexed by the hash of the whole
// prefix they end (the chain of their tokens and every block before) after
// their sequence is done, reference-counted while sequences share them,
// evicted least recently used when the pool runs out; a sequence admitted
// with a prompt whose first blocks are indexed is given them (a hit),
// including a block its prompt matches only partly, which it copies before
// writing into (copy-on-write).
class PagedKv final : public KvStore {
 public:
  PagedKv(int layers, KvWidths widths, GgmlType storage, int64_t block_size, int64_t num_blocks);
  void write(int layer, KvStream s, const KvAccess& a, const float* rows) override;
  const float* read(int layer, KvStream s, const KvAccess& a) override;
  bool paged() const override { return true; }
  const std::vector<int64_t>& table(int seq) const override;
  std::vector<int64_t> block_sources(int seq) const override;
  std::string json() const override;

  int64_t block_size() const { return B_; }
  int64_t num_blocks() const { return num_blocks_; }
  // Blocks for sequence `seq` until its table covers `positions`; throws
  // UsageError naming the iteration when the pool has none left.
  void allocate(int seq, int64_t positions, int iteration);
  // The pool slot of position p of `seq` (block table[p / B] * B + p % B).
  int64_t slot_of(int seq, int64_t p) const;
  // Gives blocks [from, to) of the table of `seq` back (a block is free once
  // no sequence holds it; the table keeps them: a sequence that still reads
  // them is a bug).
  void release(int seq, size_t from, size_t to);
  // Blocks past the first `positions` of `seq` given back and dropped from
  // its table (a rollback).
  void truncate(int seq, int64_t positions);
  // block-table-order: the first two blocks of a sequence holding two full
  // blocks or more are gathered swapped.
  void gather_swapped(bool on) { swapped_ = on; }

  // ---- prefix cache
  struct PrefixOptions {
    bool on = false;
    bool hash_last_block = false;  // prefix-hash-last-block: a block hashed by its own tokens only
    bool shared_write = false;     // prefix-shared-write: no copy-on-write
  };
  void prefix_cache(const PrefixOptions& o) { prefix_ = o; }
  bool prefix_cache() const { return prefix_.on; }
  // A new sequence's hit: the longest prefix of `prompt` whose blocks are
  // indexed (full blocks, then a partly matching one), at most `max_hit`
  // positions; those blocks put in its table. Returns the hit's length.
  int64_t lookup(int seq, const std::vector<int64_t>& prompt, int64_t max_hit);
  // Makes the blocks `seq` writes positions [from, to) into its own: a
  // block it shares is copied first (copy-on-write), unless the store is
  // told not to. Call before the slots are taken.
  void own_for_write(int seq, int64_t from, int64_t to, int iteration);
  // Indexes the full blocks of `seq` among its first `positions`, which
  // hold `tokens` (the sequence's tokens by position).
  void index_full_blocks(int seq, const std::vector<int64_t>& tokens, int64_t positions);

 private:
  std::vector<int64_t>& table_of(int seq);
  int64_t take_block(int seq, int iteration);
  void drop_ref(int64_t block);
  uint64_t block_hash(uint64_t parent, const int64_t* tokens) const;
  int64_t B_, num_blocks_;
  std::vector<std::array<std::vector<float>, kKvStreams>> pool_;  // per layer, per stream [num_blocks*B, width]
  std::array<std::vector<float>, kKvStreams> scratch_;          // a sequence's gathered rows
  std::deque<int64_t> free_;               // blocks no sequence holds and no index keeps
  std::vector<std::vector<int64_t>> tables_;
  std::vector<int> refs_;                  // per block: sequences holding it
  std::vector<int64_t> owner_;             // per block: the sequence that wrote it
  bool swapped_ = false;
  // prefix cache
  PrefixOptions prefix_;
  struct Indexed {
    uint64_t hash = 0, parent = 0;
    std::vector<int64_t> tokens;  // [B]
    int64_t last_use = 0;
  };
  std::vector<std::optional<Indexed>> indexed_;  // per block
  std::map<uint64_t, int64_t> by_hash_;           // full-prefix hash -> block
  int64_t clock_ = 0;
};

}  // namespace llmdiff::impl
