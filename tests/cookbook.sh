#!/usr/bin/env bash
# The cookbook's example engines (examples/, docs/COOKBOOK.md) end to end:
# build LANG's tiny Llama, dump a prompt and 3 decode steps of the golden
# llama-gqa, and bisect it: the clean engine must pass (exit 0), the one with
# --bug rope-interleaved must be localised at the RoPE (at attention's output
# for the PyTorch engine, whose hooks see module boundaries only) and named
# (exit 1).
#   tests/cookbook.sh python|torch|cpp|go|rust LLMDIFF WORK_DIR [CPP_BINARY]
set -euo pipefail
lang=$1 llmdiff=$2 work=$3
cd "$(dirname "$0")/.."
root=$PWD
model=$root/tests/golden/llama-gqa
mkdir -p "$work"
localised=step0.layers.0.attn.q_rope
case $lang in
  torch)
    localised=step0.layers.0.attn.ctx
    engine() { /usr/bin/python3 examples/torch/tiny_llama_torch.py "$model" --tokens 1,2,3,4,5 --decode 3 "$@"; } ;;
  python) engine() { /usr/bin/python3 examples/python/tiny_llama.py "$model" --tokens 1,2,3,4,5 --decode 3 "$@"; } ;;
  cpp) cpp_bin=$4; engine() { "$cpp_bin" "$model" --tokens 1,2,3,4,5 --decode 3 "$@"; } ;;
  go)
    (cd examples/go/tinyllama && GOCACHE=$work/go-cache GOPATH=$work/go-path GOPROXY=off GOFLAGS= GO111MODULE=on \
      GOTOOLCHAIN=local go build -o "$work/tinyllama" .)
    engine() {
      local args=() a
      while [ $# -gt 0 ]; do a=$1; shift; args+=("-${a#--}" "$1"); shift; done
      "$work/tinyllama" -model "$model" -tokens 1,2,3,4,5 -decode 3 "${args[@]}"
    } ;;
  rust)
    CARGO_TARGET_DIR=$work/target CARGO_HOME=$work/cargo-home cargo build --offline --quiet --release \
      --manifest-path examples/rust/tiny_llama/Cargo.toml
    engine() { "$work/target/release/tiny_llama" "$model" --tokens 1,2,3,4,5 --decode 3 "$@"; } ;;
  *) echo "cookbook: unknown language $lang" >&2; exit 2 ;;
esac
engine --out "$work/clean.safetensors"
"$llmdiff" bisect --model "$model" "$work/clean.safetensors" > "$work/clean.txt" || {
  cat "$work/clean.txt"; echo "cookbook $lang: the clean engine was not judged correct" >&2; exit 1; }
engine --out "$work/bug.safetensors" --bug rope-interleaved
rc=0
"$llmdiff" bisect --model "$model" "$work/bug.safetensors" --json > "$work/bug.json" || rc=$?
if [ "$rc" -ne 1 ] || ! grep -q "\"localised_at\": \"$localised\"" "$work/bug.json" ||
   ! grep -q '"bug": "rope-interleaved"' "$work/bug.json"; then
  head -c 3000 "$work/bug.json"; echo "cookbook $lang: the RoPE bug was not localised and named (exit $rc)" >&2; exit 1
fi
echo "cookbook $lang: clean engine within the noise floor; --bug rope-interleaved localised at $localised and named"
