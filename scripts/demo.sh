#!/usr/bin/env bash
# Sets up and builds llmdiff, then shows its main job on a bundled tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
echo
echo "== llmdiff inspect tests/golden/qwen3-qknorm/prefill.safetensors"
build/llmdiff inspect tests/golden/qwen3-qknorm/prefill.safetensors
