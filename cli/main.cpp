// llmdiff: find where and why an LLM implementation diverges from HuggingFace.
// Exit codes: 0 ok / within tolerance, 1 divergence found, 2 usage or input error.
#include <malloc.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "dumps/base/blas_core.h"
#include "dumps/base/errors.h"
#include "ref/block_cache.h"

int main(int argc, char** argv) {
  // OpenBLAS chose its kernels when it was loaded, by the CPU's model number:
  // a CPU newer than the library gets its generic SSE3 kernels, far slower
  // than those its instructions allow (dumps/base/blas_core.h). The process
  // starts again, once, with those named.
  llmdiff::restart_with_better_blas(argv);
  // libtorch allocates a fresh buffer for every op result, and a bisection
  // makes the same shapes layer after layer, run after run: buffers of at
  // least 256 KiB come from a cache of freed blocks (ref/block_cache.h),
  // whose pages stay mapped instead of being faulted in and zeroed again.
  // Its size trades reuse against peak memory: a smaller cache reuses fewer
  // blocks, a larger one only raises the peak (docs/PERFORMANCE.md, "What
  // changed what").
  llmdiff::ref::use_block_cache(int64_t(512) << 20);
  // The rest (the impl's and compare's vectors): glibc's heap serves buffers
  // under 8 MB, instead of mapping and unmapping each (the kernel zeroes
  // every page again); larger ones are mapped and returned when freed: from
  // the heap, their freed pieces stayed with the process.
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
