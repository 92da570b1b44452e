// What attention reads, as the canonical names show it: the causal mask of
// one call and views of a token-major KV cache (head-major, after
// repeat_kv, a ring's slots), for the forward (impl/forward.cpp) and the
// KV stores (impl/kv_store.cpp).
#pragma once
#include <cstdint>
#include <vector>

namespace llmdiff::impl {

// mask [T, S]: 1 where query t (the (offset+t)-th key position, offset = S-T
// for a causal call after S-T cached keys) may attend key s: s <= offset + t,
// and closer than the sliding window (window <= 0: none).
std::vector<float> causal_mask(int64_t T, int64_t S, int64_t offset, int64_t window);

// A ring of `capacity` slots after S positions were written at p mod
// capacity: slot j holds the newest position p < S with p mod capacity = j.
// Rows of `width` floats; the result has min(S, capacity) rows.
std::vector<float> ring_slots(const std::vector<float>& c, int64_t S, int64_t capacity, int64_t width);

// A token-major cache [S, Hkv*Dh] as [Hkv, S, Dh].
std::vector<float> head_major_cache(const std::vector<float>& c, int64_t S, int64_t Hkv, int64_t Dh);

// K or V after repeat_kv: [Hq, S, Dh], query head h reading kv head kv_head[h].
std::vector<float> repeat_kv(const std::vector<float>& c, int64_t S, int64_t Hq, int64_t Hkv, int64_t Dh,
                             const std::vector<int>& kv_head);

}  // namespace llmdiff::impl
