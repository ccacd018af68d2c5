#!/usr/bin/env bash
# Old code against this tree on the same CPU, old and new interleaved so that the host's drift
# (load, thermals, neighbours) falls on both alike: the measurement behind an "old -> new" claim
# in docs/performance.md. What it measures, per run: wall seconds and the load average before and
# after, of
#  - SFT: `slipstream sft --sft.steps=$SFT_STEPS` from scratch, $ROUNDS rounds (seed 0);
#  - RL: the RL phase alone (`slipstream run --model.init_from=$INIT`, so no SFT in it), once per
#    seed of $SEEDS.
# Step times and samples/s are in each run's metrics (runs/<name>/); runs.tsv has the walls.
#
#   scripts/ab.sh OLD OUT_DIR [--section.key=value ...]
#   e.g. scripts/ab.sh cb7bb75 /tmp/ab    (issue 16's start against HEAD, the quickstart)
#
# OLD: a git ref (checked out once into OUT_DIR/old-tree, a detached worktree; remove it with
# `git worktree remove OUT_DIR/old-tree`) or the directory of an old source tree. The old code
# runs through PYTHONPATH=OLD/src in this venv (same torch), from its own directory, so each side
# reads its own configs/. Overrides go to both sides. Environment: CONFIG (configs/quickstart.toml),
# ROUNDS (3), SFT_STEPS (300), SEEDS ("0 1 2"), INIT (the RL phase's start checkpoint; default:
# the new code's first SFT round's checkpoint, so set it to a full SFT for the usual start).
set -euo pipefail
usage="usage: $0 OLD OUT_DIR [--section.key=value ...]"
old_spec=${1:?$usage}; out=${2:?$usage}
shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
bin="$here/.venv/bin/slipstream"
config=${CONFIG:-configs/quickstart.toml}
rounds=${ROUNDS:-3}; sft_steps=${SFT_STEPS:-300}; seeds=${SEEDS:-0 1 2}
mkdir -p "$out/runs"
out=$(cd "$out" && pwd)
if [[ -d $old_spec/src/slipstream ]]; then
    old=$(cd "$old_spec" && pwd)
else
    old="$out/old-tree"
    [[ -d $old ]] || git -C "$here" worktree add --detach "$old" "$old_spec" >/dev/null
fi

slip() {  # slip old|new ARGS...: the slipstream CLI of one side, run from that side's tree
    if [[ $1 == old ]]; then
        shift; (cd "$old" && PYTHONPATH="$old/src" "$bin" "$@")
    else
        shift; (cd "$here" && PYTHONPATH="$here/src" "$bin" "$@")
    fi
}

printf 'name\tstart_utc\twall_s\tload_start\tload_end\trc\n' > "$out/runs.tsv"
timed() {  # timed NAME CMD...: one run, its log in runs/NAME.log, a row of runs.tsv
    local name=$1 t0 l0 rc=0
    shift
    t0=$EPOCHREALTIME; l0=$(cut -d' ' -f1 /proc/loadavg)
    "$@" > "$out/runs/$name.log" 2>&1 || rc=$?
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$(date -u -d "@${t0%.*}" +%H:%M:%S)" \
        "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')" \
        "$l0" "$(cut -d' ' -f1 /proc/loadavg)" "$rc" >> "$out/runs.tsv"
}

for r in $(seq 1 "$rounds"); do
    for side in old new; do
        timed "sft-$side-$r" slip "$side" sft -c "$config" --sft.steps="$sft_steps" \
            --run.output_dir="$out/runs/sft-$side-$r" "$@"
    done
done
init=$(realpath -m "${INIT:-$out/runs/sft-new-1/sft/checkpoint}")  # each side runs from its tree
for s in $seeds; do
    for side in old new; do
        timed "rl-$side-seed$s" slip "$side" run -c "$config" --run.seed="$s" \
            --model.init_from="$init" --run.output_dir="$out/runs/rl-$side-seed$s" "$@"
    done
done
column -t -s $'\t' "$out/runs.tsv"
