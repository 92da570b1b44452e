#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite through
# ctest, then the whole project and its C++ tests again under ASan+UBSan
# (scripts/sanitize.sh), then the libFuzzer targets of fuzz/ for
# FUZZ_SECONDS each. Non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
ctest --test-dir build --output-on-failure -j"${JOBS:-$(nproc)}"
./scripts/sanitize.sh
./scripts/fuzz.sh
