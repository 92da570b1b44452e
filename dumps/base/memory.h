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

// Gives the heap's free pages back to the system when the free memory it
// holds adds up to at least `at_least_bytes` (always when 0). Safe from any
// thread, the first call included.
void release_free_heap(int64_t at_least_bytes = 0);

}  // namespace llmdiff
