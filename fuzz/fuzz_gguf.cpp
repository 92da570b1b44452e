// libFuzzer target: the GGUF reader (header, metadata of every value type,
// tensor infos, alignment, data bounds) from arbitrary bytes, then every
// tensor of a supported type dequantised (ggml block layouts on arbitrary
// bits: NaN/Inf scales, any nibbles). A typed llmdiff::Error is the expected
// answer to bad input.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dumps/base/errors.h"
#include "fuzz/fuzz_common.h"
#include "dumps/formats/ggml_types.h"
#include "dumps/formats/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace llmdiff;
  try {
    const ParsedGguf g = parse_gguf(data, size, "fuzz.gguf");
    std::vector<float> row;
    for (const GgufTensorInfo& t : g.tensors) {
      if (!ggml_type_supported(uint32_t(t.type)) || t.ne.empty()) continue;
      const int64_t n = t.ne[0];
      if (n <= 0 || n > (1 << 16)) continue;
      const size_t row_bytes = ggml_row_bytes(t.type, n);
      if (row_bytes > t.nbytes) continue;
      row.resize(size_t(n));
      dequantize_row(t.type, data + g.data_start + t.offset, row.data(), n);  // the first row
    }
  } catch (const Error& e) {
    llmdiff::fuzz::check_message(e.what());
  }
  return 0;
}
