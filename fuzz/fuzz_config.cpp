// libFuzzer target: HF config.json parsing (every supported model type,
// rope scaling, MoE and MLA fields) from arbitrary text. A typed
// llmdiff::Error is the expected answer to bad input.
#include <cstddef>
#include <cstdint>
#include <string>

#include "dumps/model/config.h"
#include "dumps/base/errors.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const llmdiff::ModelConfig c =
        llmdiff::parse_config(std::string(reinterpret_cast<const char*>(data), size), "fuzz/config.json");
    (void)c.default_dtype();
  } catch (const llmdiff::Error& e) {
    llmdiff::fuzz::check_message(e.what());
  }
  return 0;
}
