#!/usr/bin/env bash
# Issue 34, item 1: the quickstart's learning per second, one knob at a time, over seeds, from ONE
# SFT start (so the RL phase is all that differs). Each setting is the quickstart config plus its
# overrides; settings are interleaved within a seed (seed outer, setting inner) so the host's
# drift falls on all of them alike. Every run evaluates held-out greedy pass@1 every
# $EVAL_EVERY steps; scripts/quickstart-summary.py --curve turns the runs into time-to-accuracy
# (seconds of RL loop without the evaluations' own time, recorded as eval_s) per setting.
#
#   scripts/rl-knobs.sh INIT OUT_DIR [SETTING ...]
#   e.g. scripts/rl-knobs.sh runs/quickstart/sft/checkpoint /tmp/knobs
#        scripts/rl-knobs.sh runs/quickstart/sft/checkpoint /tmp/knobs baseline minibatches2
#
# INIT: the SFT checkpoint every run starts from. SETTING: names from the table below (default:
# all). Environment: SEEDS ("0 1 2"), EVAL_EVERY (100), STEPS (default: the config's, 500 since
# dynamic sampling became the quickstart's default; the table in docs/rl.md from before that ran
# STEPS=1000 with dynamic sampling off unless named).
# Output: OUT_DIR/runs/<setting>-seed<S>/ (a run dir each), OUT_DIR/runs.tsv (wall, load, rc).
set -euo pipefail
usage="usage: $0 INIT OUT_DIR [SETTING ...]"
init=${1:?$usage}; out=${2:?$usage}
shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
bin="$here/.venv/bin/slipstream"
seeds=${SEEDS:-0 1 2}; eval_every=${EVAL_EVERY:-100}
steps=(); [[ -n ${STEPS:-} ]] && steps=("--trainer.steps=$STEPS")

declare -A knobs=(
    [baseline]=""                          # the quickstart: async, max_staleness 2, dynamic sampling
    [sync]="--trainer.mode=sync"
    [one_step_off]="--trainer.mode=one_step_off"
    [dynamic_sampling]="--buffer.dynamic_sampling=true"   # the default since issue 34; kept to rerun the table
    [no_dynamic_sampling]="--buffer.dynamic_sampling=false"
    [minibatches2]="--trainer.num_minibatches=2"
    [minibatches4]="--trainer.num_minibatches=4"
    [seq_mean]="--trainer.aggregation=seq_mean"
    [constant_lr]="--trainer.lr_schedule=constant"
    [lr2e-4]="--trainer.lr=2e-4"
)
order=(baseline sync one_step_off no_dynamic_sampling minibatches2 minibatches4 seq_mean constant_lr lr2e-4)
(( $# )) && order=("$@")
for name in "${order[@]}"; do
    [[ -v "knobs[$name]" ]] || { echo "$0: unknown setting '$name' (known: ${!knobs[*]})" >&2; exit 2; }
done
[[ -f $init/config.json ]] || { echo "$0: INIT '$init' has no config.json (an HF-format checkpoint, e.g. runs/quickstart/sft/checkpoint)" >&2; exit 2; }

mkdir -p "$out/runs"
out=$(cd "$out" && pwd)
[[ -f $out/runs.tsv ]] || printf 'name\tstart_utc\twall_s\tload_start\tload_end\trc\n' > "$out/runs.tsv"
for s in $seeds; do
    for name in "${order[@]}"; do
        run="$name-seed$s"
        [[ -f $out/runs/$run/report.md ]] && continue  # done in an earlier invocation
        rm -rf "${out:?}/runs/$run"
        t0=$EPOCHREALTIME; l0=$(cut -d' ' -f1 /proc/loadavg); rc=0
        # shellcheck disable=SC2086  # the overrides are words
        (cd "$here" && "$bin" run -c configs/quickstart.toml --plain --model.init_from="$init" \
            --run.seed="$s" --run.output_dir="$out/runs/$run" "${steps[@]}" \
            --trainer.eval_every="$eval_every" ${knobs[$name]}) > "$out/runs/$run.log" 2>&1 || rc=$?
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$run" "$(date -u -d "@${t0%.*}" +%H:%M:%S)" \
            "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')" \
            "$l0" "$(cut -d' ' -f1 /proc/loadavg)" "$rc" >> "$out/runs.tsv"
        echo "$run rc=$rc"
    done
done
