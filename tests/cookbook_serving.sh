#!/usr/bin/env bash
# The cookbook's PyTorch serving engine (examples/torch/serving_engine.py,
# docs/COOKBOOK.md "a PyTorch serving engine") end to end on one golden model:
# three sequences joining at iterations 0, 1 and 2, chunked prefill, a paged
# KV cache of 4-position blocks, recorded by writers/python/llmdump_serving.py.
# The clean engine (its rows padded to a multiple of 4, logits for each
# sequence's last row only, as vLLM computes them) must pass sequence by
# sequence (exit 0); each engine bug given must be localised to its sequence,
# step and op and named (exit 1); block-table-order (the paged-attention
# kernel reading two blocks swapped) must be localised to its sequence, step
# and op.
#   tests/cookbook_serving.sh MODEL_DIR LLMDIFF WORK_DIR [BUG ...]
set -euo pipefail
model=$1 llmdiff=$2 work=$3
shift 3
cd "$(dirname "$0")/.."
mkdir -p "$work"
name=$(basename "$model")
engine() { /usr/bin/python3 examples/torch/serving_engine.py "$model" "$@"; }

engine --pad-to 4 --last-logits --out "$work/clean.safetensors" > "$work/clean.log"
"$llmdiff" bisect --model "$model" "$work/clean.safetensors" > "$work/clean.txt" || {
  cat "$work/clean.txt"; echo "cookbook_serving $name: the clean engine was not judged correct" >&2; exit 1; }

# expect BUG SEQ STEP LOCALISED NAME: the bisect's first divergent sequence,
# its step, the site it is localised at and the bug it names ("-": none asked).
expect() {
  local bug=$1 seq=$2 step=$3 at=$4 named=$5 rc=0
  engine --bug "$bug" --out "$work/$bug.safetensors" > "$work/$bug.log"
  "$llmdiff" bisect --model "$model" "$work/$bug.safetensors" --json > "$work/$bug.json" || rc=$?
  if [ "$rc" -ne 1 ]; then
    head -c 3000 "$work/$bug.json"; echo "cookbook_serving $name: --bug $bug: bisect exit $rc, expected 1" >&2; exit 1
  fi
  /usr/bin/python3 - "$work/$bug.json" "$seq" "$step" "$at" "$named" "$bug" "$name" <<'EOF'
import json, sys
path, seq, step, at, named, bug, model = sys.argv[1:]
j = json.load(open(path))
b = j["first_divergent_sequence"]
s = next(s for s in j["sequences"] if s["seq"] == b)
got = (b, s["step"], s["bisect"]["localised_at"], (s["bisect"]["diagnosis"].get("bug") or "none"))
want = (int(seq), int(step), at, named)
if got[:3] != want[:3] or (named != "-" and got[3] != named):
    sys.exit("cookbook_serving %s: --bug %s: got seq%d step %d at %s named %s, expected seq%d step %d at %s named %s"
             % ((model, bug) + got + want))
print("cookbook_serving %s: --bug %s localised to seq%d step %d at %s, named %s (iteration %s)"
      % ((model, bug) + got + (s["iteration"],)))
EOF
}
for bug in "$@"; do
  case $bug in
    slot-mapping-off-by-one) expect "$bug" 0 0 step0.layers.0.attn.k_cache "$bug" ;;
    batch-positions) expect "$bug" 0 2 step2.positions "$bug" ;;
    context-len-plus-one) expect "$bug" 0 0 step0.layers.0.attn.k_cache "$bug" ;;
    # The kernel reads the pool through its table with two blocks swapped; the
    # recorder gathers the pool in the table's order, so the first wrong value
    # it sees is the attention's output of the chunk whose queries see part of
    # those blocks (seq2's third prompt chunk, positions 6-8).
    block-table-order) expect "$bug" 2 2 step2.layers.0.attn.ctx - ;;
    *) echo "cookbook_serving: unknown bug $bug" >&2; exit 2 ;;
  esac
done
echo "cookbook_serving $name: clean engine within the noise floor sequence by sequence; engine bugs localised: $*"
