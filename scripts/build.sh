#!/usr/bin/env bash
# Configures and builds llmdiff (Release) into build/. Extra arguments go to cmake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
JOBS=${JOBS:-$(nproc)}
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
fi
cmake --build build -j"$JOBS"
