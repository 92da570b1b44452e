// libFuzzer target: the safetensors container (header length, JSON header,
// dtypes, shapes, offsets) from arbitrary bytes. A typed llmdiff::Error, with a
// printable message, is the expected answer to bad input; anything else (a crash, a sanitizer
// report, another exception) is a finding.
#include <cstddef>
#include <cstdint>

#include "dumps/base/errors.h"
#include "fuzz/fuzz_common.h"
#include "dumps/formats/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const llmdiff::ParsedHeader h = llmdiff::parse_safetensors(data, size, "fuzz.safetensors");
    for (const auto& t : h.tensors) (void)t.name.size();
  } catch (const llmdiff::Error& e) {
    llmdiff::fuzz::check_message(e.what());
  }
  return 0;
}
