#!/usr/bin/env bash
# One candidate bisected in shards under a real scheduler, then merged, and
# the merge checked against the whole run (docs/SHARDS.md):
#   scripts/shards.sh parallel|slurm LLMDIFF MODEL CANDIDATE SHARDS WORK_DIR
# The model's layers are split into SHARDS contiguous ranges; each range is
# `bisect --layers A:B --json` in a process of its own, started by
#   parallel: GNU parallel, SHARDS jobs at once on this machine;
#   slurm:    a Slurm array job (sbatch --array) on a single-node Slurm that
#             this script starts on localhost (munged, slurmctld and slurmd
#             with their state in a temporary directory, their own ports) and
#             shuts down when it ends.
# `merge` joins the parts; the whole run is `bisect --json` of the same
# candidate. Prints each phase's wall time; exit 0 when the merge says what
# the whole run says (verdict, first divergence, first local failure, where
# it is localised, the diagnosis, the names compared), 1 when it does not,
# 2 on an error (a shard exiting 2), 77 when the scheduler does not start
# here.
set -euo pipefail
mode=$1 llmdiff=$(realpath "$2") model=$(realpath "$3") candidate=$(realpath "$4") shards=$5 work=$6
mkdir -p "$work"
work=$(realpath "$work")
rm -f "$work"/part-*.json "$work"/merged.json "$work"/whole.json

die() { echo "shards: $*" >&2; exit 2; }
# A scheduler that does not start here (a user whose slurmd may not launch
# tasks, a sandbox without the daemons' rights): exit 77, which the test
# suite counts as skipped, with the daemon's own words. What the shards
# compute is never skipped: a shard or a merge that fails is exit 2 or 1.
no_daemon() {
  echo "shards: the scheduler is not available here: $*" >&2
  exit 77
}
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f} s')" "$1" "$(now)"; }

# The layer ranges, one per line: SHARDS contiguous ranges tiling the model.
layers=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" "$model/config.json")
[ "$shards" -ge 1 ] && [ "$shards" -le "$layers" ] || die "$shards shards of a $layers-layer model"
python3 - "$layers" "$shards" >"$work/ranges.txt" <<'EOF'
import sys
L, n = int(sys.argv[1]), int(sys.argv[2])
for i in range(n):
    print(f"{i * L // n}:{(i + 1) * L // n}")
EOF

# One shard: exit 1 (it diverges) is a result, not a failed task.
cat >"$work/shard.sh" <<EOF
#!/usr/bin/env bash
[ \$# -ge 1 ] || set -- "\$SLURM_ARRAY_TASK_ID"  # GNU parallel passes the index, Slurm sets it
range=\$(sed -n "\$((\$1 + 1))p" "$work/ranges.txt")
"$llmdiff" bisect --model "$model" "$candidate" --layers "\$range" --threads 1 --json >"$work/part-\$1.json.tmp"
rc=\$?
[ \$rc -le 1 ] && mv "$work/part-\$1.json.tmp" "$work/part-\$1.json"
[ \$rc -le 1 ]
EOF
chmod +x "$work/shard.sh"

run_parallel() {
  # The recipe of docs/SHARDS.md.
  parallel --will-cite -j"$shards" "$work/shard.sh" {} ::: $(seq 0 $((shards - 1)))
}

run_slurm() {
  for p in munged slurmctld slurmd sbatch scontrol; do command -v $p >/dev/null || die "$p not found (scripts/setup.sh installs slurm-wlm and munge)"; done
  local state
  state=$(mktemp -d /tmp/llmdiff-slurm.XXXXXX)  # short: a unix socket's path is limited
  chmod 755 "$state"
  local port=$((20000 + RANDOM % 20000)) user
  user=$(id -un)
  dd if=/dev/urandom of="$state/munge.key" bs=128 count=1 status=none
  chmod 400 "$state/munge.key"
  mkdir -p "$state/spool" "$state/ctld"
  cat >"$state/slurm.conf" <<EOF
ClusterName=llmdiff
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=$user
SlurmdUser=$user
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$state/munge.socket
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=llmdiff-shards NodeHostname=$(hostname) NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=shards Nodes=llmdiff-shards Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$state/slurm.conf
  # shellcheck disable=SC2064
  trap "scontrol shutdown >/dev/null 2>&1 || true; munged -s --socket=$state/munge.socket >/dev/null 2>&1 || true; sleep 1; rm -rf $state" EXIT
  munged -f --socket="$state/munge.socket" --key-file="$state/munge.key" --log-file="$state/munged.log" \
    --pid-file="$state/munged.pid" --seed-file="$state/munged.seed" || no_daemon "munged did not start"
  slurmctld -f "$SLURM_CONF" || no_daemon "slurmctld did not start: $(tail -3 "$state/slurmctld.log" 2>/dev/null)"
  slurmd -f "$SLURM_CONF" -N llmdiff-shards || no_daemon "slurmd did not start: $(tail -3 "$state/slurmd.log" 2>/dev/null)"
  local up=0
  for _ in $(seq 1 30); do
    if sinfo -h -o %t 2>/dev/null | grep -qx idle; then up=1; break; fi
    sleep 1
  done
  [ $up -eq 1 ] || no_daemon "the Slurm node did not come up: $(tail -3 "$state/slurmd.log" 2>/dev/null)"
  echo "slurm: node llmdiff-shards of $(nproc) CPUs up (state in $state)"
  sbatch --wait --quiet --array=0-$((shards - 1)) --cpus-per-task=1 --chdir="$work" \
    --output="$work/slurm-%a.out" "$work/shard.sh" || true
  # sbatch --wait passes the array's exit code; the part files say which shard failed.
  local i
  for i in $(seq 0 $((shards - 1))); do
    [ -f "$work/slurm-$i.out" ] || continue
    sed "s/^/slurm task $i: /" "$work/slurm-$i.out" >&2
  done
}

t0=$(now)
case $mode in
  parallel) run_parallel || true ;;
  slurm) run_slurm ;;
  *) die "mode '$mode' is neither parallel nor slurm" ;;
esac
echo "$mode: $shards shards of $layers layers ($(tr '\n' ' ' <"$work/ranges.txt")) in $(since "$t0")"
for i in $(seq 0 $((shards - 1))); do
  [ -f "$work/part-$i.json" ] || die "shard $i ($(sed -n "$((i + 1))p" "$work/ranges.txt")) wrote no result"
done

rc=0
"$llmdiff" merge "$work"/part-*.json --json >"$work/merged.json" || rc=$?
[ $rc -le 1 ] || die "merge exited $rc"
t1=$(now)
rc=0
"$llmdiff" bisect --model "$model" "$candidate" --threads 1 --json >"$work/whole.json" || rc=$?
[ $rc -le 1 ] || die "the whole run exited $rc"
echo "whole run in one process: $(since "$t1")"

python3 - "$work/merged.json" "$work/whole.json" <<'EOF'
import json, sys
merged, whole = (json.load(open(p)) for p in sys.argv[1:3])
diag = lambda j: {k: (j.get("diagnosis") or {}).get(k) for k in ("bug", "hypothesis", "focus")}
checks = {k: (merged.get(k), whole.get(k)) for k in
          ("ok", "exit_code", "first_divergence", "first_local_failure", "localised_at", "compared")}
checks["diagnosis"] = (diag(merged), diag(whole))
bad = [k for k, (a, b) in checks.items() if a != b]
for k in bad:
    print(f"merge differs from the whole run at {k}: {checks[k][0]!r} vs {checks[k][1]!r}")
print(f"merge of {len(merged.get('shards', []))} shards: exit {merged.get('exit_code')}, "
      f"localised at {merged.get('localised_at')}, bug {diag(merged)['bug']}; "
      + ("the whole run's result" if not bad else f"{len(bad)} keys differ"))
sys.exit(1 if bad else 0)
EOF
