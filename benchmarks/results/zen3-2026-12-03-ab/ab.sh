#!/usr/bin/env bash
# Issue-time code (cb7bb75, the commit before issue 16's first change) against HEAD on this CPU,
# interleaved, on the same shapes: configs/quickstart.toml resolves to the same model, batches and
# task in both; the old code's defaults differ in sft.lr (3e-3 vs 1e-3) and trainer.steps (2000 vs
# 1000), which change the numbers learned, not the cost of a step:
#  - SFT: `slipstream sft --sft.steps=300` from scratch, 3 rounds (seed 0);
#  - RL: the whole 1000-step RL phase from one SFT start (HEAD's seed-0 quickstart SFT checkpoint,
#    model.init_from), seeds 0-2.
# Old code runs from a git worktree through PYTHONPATH, in the same venv (same torch).
set -euo pipefail
cd /work/main
out=benchmarks/results/zen3-2026-12-03-ab
init=benchmarks/results/zen3-2026-12-03/quickstart-seed0/sft/checkpoint
old=/tmp/old-cb7bb75
slip() {  # slip old|new ARGS...
    local which=$1; shift
    if [[ $which == old ]]; then (cd $old && PYTHONPATH=$old/src /work/main/.venv/bin/slipstream "$@")
    else .venv/bin/slipstream "$@"; fi
}
printf 'name\tstart_utc\twall_s\tload_start\tload_end\trc\n' > $out/runs.tsv
step() {
    local name=$1; shift; local t0 l0 rc=0
    t0=$(date +%s.%N); l0=$(cut -d' ' -f1 /proc/loadavg)
    "$@" > $out/$name.log 2>&1 || rc=$?
    printf '%s\t%s\t%.1f\t%s\t%s\t%s\n' $name "$(date -u -d @$t0 +%H:%M:%S)" "$(echo "$(date +%s.%N) - $t0" | bc)" $l0 "$(cut -d' ' -f1 /proc/loadavg)" $rc >> $out/runs.tsv
}
for r in 1 2 3; do
    step sft-old-$r slip old sft -c configs/quickstart.toml --sft.steps=300 --run.output_dir=/tmp/ab/sft-old-$r
    step sft-new-$r slip new sft -c configs/quickstart.toml --sft.steps=300 --run.output_dir=/tmp/ab/sft-new-$r
done
for s in 0 1 2; do
    for w in old new; do
        step rl-$w-seed$s slip $w run -c configs/quickstart.toml --run.seed=$s \
            --model.init_from=/work/main/$init --run.output_dir=/tmp/ab/rl-$w-seed$s
    done
done
echo done >> $out/runs.tsv
