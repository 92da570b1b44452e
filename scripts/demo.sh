#!/usr/bin/env bash
# Sets up and builds llmdiff, then runs its main job on a bundled tiny model
# (tests/golden/qwen3-qknorm, with dumps written by HF transformers):
#   1. inspect an HF dump,
#   2. check llmdiff's own engines against HF (regress),
#   3. write a dump from an implementation with a classic bug (the impl with
#      --inject rope-interleaved), then let `llmdiff bisect` find and name it.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh >/dev/null
MODEL=tests/golden/qwen3-qknorm
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

echo "== llmdiff inspect $MODEL/prefill.safetensors"
build/llmdiff inspect "$MODEL/prefill.safetensors"

echo
echo "== llmdiff regress --golden tests/golden   (ref and impl against the HF dumps)"
build/llmdiff regress --golden tests/golden

echo
echo "== a buggy implementation: llmdiff dump --engine impl --inject rope-interleaved"
build/llmdiff dump --engine impl --inject rope-interleaved --model "$MODEL" \
  --replay "$MODEL/decode.safetensors" --out "$OUT/buggy.safetensors"

echo
echo "== llmdiff bisect --model $MODEL buggy.safetensors"
set +e
build/llmdiff bisect --model "$MODEL" "$OUT/buggy.safetensors" --report "$OUT/report.md"
rc=$?
set -e
echo
echo "bisect exit code: $rc (1 = divergence found and diagnosed)"
[ "$rc" -eq 1 ]
