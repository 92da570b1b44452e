#!/usr/bin/env bash
# Builds the whole project (every library: dumps, impl, compare, ref, bisect,
# synth, cli) and its tests with AddressSanitizer and UndefinedBehaviorSanitizer
# into build-sanitize/ (-O1, no debug info: a build that fits the CI time), and
# runs the C++ test suite through ctest under them. Debian's libtorch is not
# instrumented itself, but every allocation it makes goes through ASan's
# allocator and every call into it from llmdiff is checked. Non-zero on any
# build error, test failure or sanitizer report (leaks included).
# JOBS sets the parallelism (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}

cmake -S . -B build-sanitize -DLLMDIFF_SANITIZE=ON -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="-O1" \
  -DCMAKE_C_FLAGS="-O1" >/dev/null
cmake --build build-sanitize -j"$JOBS"

# Any sanitizer report aborts the test process, which ctest counts as a failure.
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The writer libraries' tests in other languages (Go, Rust, Python) ran in the
# main suite; here only the C++ (and C) code is under the sanitizers.
ctest --test-dir build-sanitize --output-on-failure --no-tests=error -j"$JOBS" -E '^writers_(go|rust|python)'
