// Helpers shared by the compare/ tests: in-memory copies of golden dumps and
// tensor builders. Header-only; included by tests/test_compare*.cpp.
#pragma once
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "tests/support.h"

namespace llmdiff::testing {

// A full in-memory copy (tensors and manifest) of a dump.
inline void copy_into(const TensorSource& src, MemoryDump& dst) {
  dst.mutable_manifest() = src.manifest();
  for (const auto& n : src.names()) dst.put(src.get(n));
}

inline TensorData float_tensor(const std::string& name, Shape shape, std::vector<float> values) {
  TensorData t;
  t.name = name;
  t.shape = std::move(shape);
  t.f = std::move(values);
  return t;
}

inline TensorData int_tensor(const std::string& name, Shape shape, std::vector<int64_t> values) {
  TensorData t;
  t.name = name;
  t.shape = std::move(shape);
  t.is_int = true;
  t.stored = DType::I64;
  t.i = std::move(values);
  return t;
}

}  // namespace llmdiff::testing
