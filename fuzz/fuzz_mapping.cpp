// libFuzzer target: `llmdiff import` mapping files (JSON or TOML) from
// arbitrary text: rules, patterns, transforms and their arguments. A typed
// llmdiff::Error is the expected answer to bad input.
#include <cstddef>
#include <cstdint>
#include <string>

#include "dumps/base/errors.h"
#include "dumps/import/import.h"
#include "dumps/import/import_ops.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const llmdiff::import::Mapping m = llmdiff::import::Mapping::parse(text, "fuzz/mapping");
    for (const auto& r : m.rules)
      if (!r.when.empty()) {
        try {
          (void)llmdiff::import::eval_expr(r.when, {{"T", 5}, {"D", 64}, {"numel", 320}});
        } catch (const llmdiff::Error& e) {
          llmdiff::fuzz::check_message(e.what());
        }
      }
  } catch (const llmdiff::Error& e) {
    llmdiff::fuzz::check_message(e.what());
  }
  return 0;
}
