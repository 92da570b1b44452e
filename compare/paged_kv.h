// The bookkeeping of a paged KV cache, checked from the names a paged
// engine writes (docs/DUMP_FORMAT.md: `kv.block_table`, `kv.slot_mapping`,
// `kv.context_len` per sequence and step; manifest `kv_cache`
// {"kind": "paged", "block_size": B, "num_blocks": N}). The canonical caches
// (`k_cache`, `v_cache`) are the gathered ones and are compared as values;
// these checks name the cause when the bookkeeping itself is wrong: a slot
// mapping off by k, a context length one too long (a stale slot read), a
// block table too short, a block in the tables of two live sequences (reused
// before its sequence finished).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"

namespace llmdiff::compare {

struct KvCacheLayout {
  std::string kind = "contiguous";  // contiguous, paged, ring
  int64_t block_size = 0;           // paged
  int64_t num_blocks = 0;           // paged (0: not given)
  int64_t capacity = 0;             // ring
};
// The manifest's `kv_cache` (contiguous when absent); throws FormatError
// naming `where` when it is malformed.
KvCacheLayout manifest_kv_cache(const Manifest& m, const std::string& where);

struct PagedKvFinding {
  int seq = -1;        // -1: a single-sequence dump
  int step = 0;
  std::string kind;    // context-length, slot-mapping, block-table, block-shared, block-range
  std::string text;    // with the numbers
  int other_seq = -1;  // block-shared: the sequence that held the block first
  int iteration = -1;  // block-shared: the engine iteration both were in
};

// One sequence's steps (a single-sequence dump or a SequenceView; `seq` only
// labels the findings). Nothing when the dump has no kv.* names.
std::vector<PagedKvFinding> check_paged_sequence(const TensorSource& d, int seq = -1);
// Across the sequences of a several-sequence dump: a block in the tables of
// two sequences of one engine iteration (iter{N}.seqs).
std::vector<PagedKvFinding> check_paged_blocks_shared(const TensorSource& batch);

// A ring-buffer cache (manifest kv_cache {"kind": "ring", "capacity": C},
// Loom's `pos % MaxSeqLen`): the first step whose sequence holds more than C
// positions, where positions < S - C have been overwritten.
struct RingWrap {
  int64_t capacity = 0;
  int step = 0;
  int64_t S = 0;     // positions the sequence holds at that step
  std::string text;  // the finding, with its numbers
};
std::optional<RingWrap> ring_wrap(const TensorSource& d);

}  // namespace llmdiff::compare
