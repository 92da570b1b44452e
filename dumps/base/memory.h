// The machine's memory as llmdiff's commands budget it: what is available
// now, and the default budget a checkpoint must fit to stay resident.
#pragma once
#include <cstdint>

namespace llmdiff {

// MemAvailable of /proc/meminfo in bytes (0 when unknown).
int64_t available_memory_bytes();
// The default budget for keeping a checkpoint's pages resident: half of
// the memory available when the command starts (the other half for the
// activations, the dumps and the page cache), 4 GiB when that is unknown.
int64_t default_memory_budget();

}  // namespace llmdiff
