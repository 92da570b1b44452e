// The one hook through which an engine reports each intermediate where it is
// computed, like llama.cpp's cb(cur, "attn_norm", il). Names are full
// canonical names (see names.h); data is row-major and contiguous.
#pragma once
#include <cstdint>
#include <string>

#include "dumps/formats/safetensors.h"

namespace llmdiff {

class Observer {
 public:
  virtual ~Observer() = default;
  // Whether the observer records `name`. Engines skip materialising costly
  // sites (k_rep/v_rep, scores/probs) when nobody wants them.
  virtual bool wants(const std::string& name) const = 0;
  virtual void on_f32(const std::string& name, const Shape& shape, const float* data) = 0;
  virtual void on_i64(const std::string& name, const Shape& shape, const int64_t* data) = 0;
};

// Records nothing.
class NullObserver : public Observer {
 public:
  bool wants(const std::string&) const override { return false; }
  void on_f32(const std::string&, const Shape&, const float*) override {}
  void on_i64(const std::string&, const Shape&, const int64_t*) override {}
};

}  // namespace llmdiff
