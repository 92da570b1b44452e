// libFuzzer target: an llm-dump/1 file's manifest and names — the safetensors
// metadata read as the manifest, every tensor name parsed as a canonical
// name, the `precision` and `sampling` keys and the embedded config parsed.
// A typed llmdiff::Error is the expected answer to bad input.
#include <cstddef>
#include <cstdint>

#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "dumps/base/errors.h"
#include "fuzz/fuzz_common.h"
#include "dumps/contract/names.h"
#include "dumps/contract/precision.h"
#include "dumps/formats/safetensors.h"
#include "dumps/sampling/sampling.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace llmdiff;
  try {
    const ParsedHeader h = parse_safetensors(data, size, "fuzz.safetensors");
    for (const auto& t : h.tensors) {
      const CanonName c = parse_name(t.name);
      (void)c.str();
    }
    const Manifest m = Manifest::from_map(h.metadata);
    (void)m.to_map();
    (void)PrecisionProfile::from_manifest(m.extra, "fuzz.safetensors");
    (void)manifest_sampling(m, "fuzz.safetensors");
    if (!m.config.empty()) (void)parse_config(m.config, "fuzz.safetensors");
  } catch (const Error& e) {
    llmdiff::fuzz::check_message(e.what());
  }
  return 0;
}
