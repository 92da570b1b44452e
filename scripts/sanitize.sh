#!/usr/bin/env bash
# Builds dumps/ and its tests (no libtorch) with AddressSanitizer and
# UndefinedBehaviorSanitizer in Debug into build-asan/, and runs them through
# ctest. Non-zero on any build error, test failure or sanitizer report.
# JOBS sets the parallelism (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}

cmake -S . -B build-asan -DLLMDIFF_DUMPS_ONLY=ON -DLLMDIFF_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build-asan --target test_dumps -j"$JOBS"

# Any sanitizer report aborts the test process, which ctest counts as a failure.
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir build-asan --output-on-failure --no-tests=error -j"$JOBS"
