#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ (dumps/' readers: safetensors, the
# llm-dump manifest and names, config.json, GGUF) with clang, AddressSanitizer
# and UndefinedBehaviorSanitizer into build-fuzz/, and runs each for
# FUZZ_SECONDS (default 30) from its checked-in seed corpus fuzz/corpus/NAME
# (new inputs go to a scratch copy, the corpus is not modified). Non-zero on
# any crash, sanitizer report or timeout; the input that caused it is left in
# build-fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${FUZZ_SECONDS:-30}
JOBS=${JOBS:-$(nproc)}

CC=clang CXX=clang++ cmake -S . -B build-fuzz -DLLMDIFF_DUMPS_ONLY=ON -DLLMDIFF_TESTS=OFF -DLLMDIFF_FUZZ=ON \
  -DLLMDIFF_NATIVE=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-fuzz -j"$JOBS"

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
mkdir -p build-fuzz/artifacts
for src in fuzz/fuzz_*.cpp; do
  name=$(basename "$src" .cpp)
  corpus=fuzz/corpus/${name#fuzz_}
  scratch=build-fuzz/corpus/${name#fuzz_}
  rm -rf "$scratch" && mkdir -p "$scratch"
  echo "fuzz: $name for ${SECONDS_EACH}s from $corpus"
  ./build-fuzz/"$name" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -artifact_prefix=build-fuzz/artifacts/"$name"- -print_final_stats=1 "$scratch" "$corpus" \
    > build-fuzz/"$name".log 2>&1 || { tail -40 build-fuzz/"$name".log; echo "fuzz: $name FAILED" >&2; exit 1; }
  grep -E "^stat::number_of_executed_units" build-fuzz/"$name".log || true
done
echo "fuzz: every target ran ${SECONDS_EACH}s without a finding"
