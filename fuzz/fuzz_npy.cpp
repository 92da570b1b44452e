// libFuzzer target: NumPy's .npy images and .npz (zip) archives from
// arbitrary bytes, as `llmdiff import` reads an engine's arrays. A typed
// llmdiff::Error is the expected answer to bad input.
#include <cstddef>
#include <cstdint>
#include <string>

#include "dumps/base/errors.h"
#include "dumps/formats/npy.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const llmdiff::TensorData t = llmdiff::parse_npy(data, size, "fuzz.npy", "a");
    (void)t.numel();
  } catch (const llmdiff::Error& e) {
    llmdiff::fuzz::check_message(e.what());
  }
  try {
    for (const llmdiff::ZipMember& m : llmdiff::zip_members(data, size, "fuzz.npz")) {
      try {
        const std::vector<uint8_t> bytes = llmdiff::zip_extract(data, size, m, "fuzz.npz");
        (void)llmdiff::parse_npy(bytes.data(), bytes.size(), "fuzz.npz", m.name);
      } catch (const llmdiff::Error& e) {
        llmdiff::fuzz::check_message(e.what());
      }
    }
  } catch (const llmdiff::Error& e) {
    llmdiff::fuzz::check_message(e.what());
  }
  return 0;
}
