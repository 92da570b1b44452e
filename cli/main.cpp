// llmdiff: find where and why an LLM implementation diverges from HuggingFace.
// Exit codes: 0 ok / within tolerance, 1 divergence found, 2 usage or input error.
#include <malloc.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "dumps/errors.h"

int main(int argc, char** argv) {
  // libtorch allocates a fresh buffer for every op result. With glibc's
  // defaults, buffers of a few MB are mapped and unmapped each time, and the
  // kernel zeroes every page again: a fifth of a 1B-model `run` went there.
  // Serve buffers under 8 MB from the heap; larger ones (converted weight
  // matrices, e.g. a MoE model's hundreds of expert matrices converted and
  // dropped layer after layer) are mapped and returned when freed: from the
  // heap, their freed pieces stayed with the process (a 4-layer
  // DeepSeek-V2-Lite-shaped bisect peaked at 4.0 GB instead of 3.0).
  mallopt(M_MMAP_THRESHOLD, 8 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  CLI::App app{"llmdiff: layer-by-layer diffs of LLM inference against HuggingFace transformers"};
  llmdiff::cli::Action action;
  llmdiff::cli::setup_commands(app, action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  try {
    return action ? action() : 2;
  } catch (const llmdiff::Error& e) {
    std::fprintf(stderr, "llmdiff: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llmdiff: error: %s\n", e.what());
    return 2;
  }
}
