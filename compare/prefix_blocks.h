// A prefix cache's faults, from the values of a several-sequence dump
// (docs/DUMP_FORMAT.md, "Prefix cache"): cache rows are the keys of the
// tokens at and before their position, so a row a sequence reads at
// position p must be the row of a sequence whose tokens up to p are its own.
// Layer 0's key cache rows (k_cache, MLA's latent_cache) of every sequence's
// steps are matched by value:
// - a row served from the cache (a position of the sequence's hit) that
//   equals another sequence's row while their tokens differ before p, and
//   agree at p: a block of another prefix served (its hash covered the
//   block's own tokens only);
// - a row that changed after the sequence wrote it (or was served it), now
//   equal to another sequence's row for another token at p: that sequence
//   wrote into a block this one holds (a shared block written in place
//   without copy-on-write, or a block given to it while still in use).
// Each finding names both sequences, the position and the block when the
// dump has kv.block_table.
#pragma once
#include <vector>

#include "compare/paged_kv.h"
#include "dumps/contract/dump.h"

namespace llmdiff::compare {

// kinds: "prefix-stale" (the zoo's PrefixBlockStale), "prefix-overwritten"
// (PrefixBlockOverwritten when the writer shares the block through the
// prefix cache, else BlockShared). `seq` is the sequence that reads the
// wrong row, `other_seq` the one whose row it is, `iteration` the engine
// iteration of the step where it is first read (-1 without iter names).
std::vector<PagedKvFinding> check_prefix_blocks(const TensorSource& batch);

}  // namespace llmdiff::compare
