#include "impl/cache_views.h"

#include <algorithm>
#include <cstring>

namespace llmdiff::impl {

std::vector<float> causal_mask(int64_t T, int64_t S, int64_t offset, int64_t window) {
  std::vector<float> mask(size_t(T * S), 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s <= std::min(offset + t, S - 1); ++s)
      if (window <= 0 || offset + t - s < window) mask[size_t(t * S + s)] = 1.0f;
  return mask;
}

std::vector<float> ring_slots(const std::vector<float>& c, int64_t S, int64_t capacity, int64_t width) {
  const int64_t n = std::min(S, capacity);
  std::vector<float> out(size_t(n * width));
  for (int64_t p = S - n; p < S; ++p)
    std::copy_n(&c[size_t(p * width)], width, &out[size_t((p % capacity) * width)]);
  return out;
}

std::vector<float> head_major_cache(const std::vector<float>& c, int64_t S, int64_t Hkv, int64_t Dh) {
  std::vector<float> out(size_t(Hkv * S * Dh));
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t s = 0; s < S; ++s)
      std::memcpy(&out[size_t((h * S + s) * Dh)], &c[size_t((s * Hkv + h) * Dh)], size_t(Dh) * sizeof(float));
  return out;
}

std::vector<float> repeat_kv(const std::vector<float>& c, int64_t S, int64_t Hq, int64_t Hkv, int64_t Dh,
                             const std::vector<int>& kv_head) {
  std::vector<float> out(size_t(Hq * S * Dh));
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t s = 0; s < S; ++s)
      std::memcpy(&out[size_t((h * S + s) * Dh)], &c[size_t((s * Hkv + kv_head[size_t(h)]) * Dh)],
                  size_t(Dh) * sizeof(float));
  return out;
}

}  // namespace llmdiff::impl
