// The default thread count and the deterministic random numbers every part
// of llmdiff shares.
#pragma once
#include <cstdint>

namespace llmdiff {

// Hardware threads of this machine (at least 1): what "0 threads" means.
int default_threads();
// `threads`, or default_threads() when it is 0 or less.
int resolve_threads(int threads);

// splitmix64: the next value of the sequence `state` (advanced in place).
inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace llmdiff
