#!/usr/bin/env bash
# docs/SHARDS.md's recipes run for real (scripts/shards.sh): a candidate of
# the golden deepseek-v3-mla (HF's decode scenario replayed by the impl with
# mla-rope-layout injected) bisected in 3 shards, one per layer, under GNU
# parallel or a Slurm array job on a single-node Slurm started on localhost;
# the merge must be the whole run's result and name the bug.
#   tests/shards_scheduler.sh parallel|slurm LLMDIFF WORK_DIR
set -euo pipefail
mode=$1 llmdiff=$2 work=$3
cd "$(dirname "$0")/.."
model=$PWD/tests/golden/deepseek-v3-mla
mkdir -p "$work"
"$llmdiff" dump --engine impl --model "$model" --replay "$model/decode.safetensors" --inject mla-rope-layout \
  --out "$work/candidate.safetensors" >/dev/null
scripts/shards.sh "$mode" "$llmdiff" "$model" "$work/candidate.safetensors" 3 "$work/$mode"
python3 - "$work/$mode/merged.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
assert m["exit_code"] == 1, m["exit_code"]
assert len(m["shards"]) == 3, m["shards"]
assert m["diagnosis"]["bug"] == "mla-rope-layout", m["diagnosis"]
assert m["localised_at"].startswith("step0.layers.0.attn."), m["localised_at"]
PY
