#!/usr/bin/env bash
# Rerun the README's measured rows on this machine, in one go, into OUT_DIR (default
# benchmarks/results/readme-<date>): the quickstart job over seeds 0-2, `bench engine` and
# `bench train` (3 repeats each; both measure `bench limits` in the same run), `bench pipeline`
# 3 times with the lognormal verifier stand-in, and 3 times each on the `code` task verified in
# bwrap sandboxes (single-use sandboxes, 6 steps; reused sandboxes, 18 steps).
#
# Every command's stdout/stderr goes to OUT_DIR/<name>.log and its JSON result next to it; the
# CPU, the load average before and after each command and the start/end times go to
# OUT_DIR/runs.tsv. Run it on a quiet machine: the figures are wall-clock throughput, and
# anything else running moves them. About 35 minutes on a 2-vCPU EPYC (Zen 3, 2026-12-03). Each
# quickstart run dir keeps its checkpoints and weight store (~70 MB); delete those before keeping
# the results. `python3 scripts/quickstart-summary.py OUT_DIR/quickstart-seed{0,1,2} --runs
# OUT_DIR/runs.tsv` tabulates the three runs.
#
#   bash scripts/bench-readme.sh [OUT_DIR] [--only quickstart,engine,train,pipeline,code]
set -euo pipefail
cd "$(dirname "$0")/.."

out="benchmarks/results/readme-$(date -u +%Y-%m-%d)"
only="quickstart,engine,train,pipeline,code"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --only) only="$2"; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "bench-readme: unknown option $1" >&2; exit 2 ;;
        *) out="$1"; shift ;;
    esac
done
slip=.venv/bin/slipstream
[[ -x $slip ]] || { echo "bench-readme: $slip missing; run 'bash scripts/setup.sh' first" >&2; exit 1; }
mkdir -p "$out"
runs="$out/runs.tsv"
[[ -f $runs ]] || printf 'name\tstart_utc\tend_utc\twall_s\tload_start\tload_end\trc\tcommand\n' > "$runs"
{
    grep -m1 'model name' /proc/cpuinfo
    grep -m1 'cpu family' /proc/cpuinfo
    grep -m1 '^model\s' /proc/cpuinfo
    echo "avx512f: $(grep -c -m1 avx512f /proc/cpuinfo || true)"
    echo "nproc: $(nproc)"
    echo "git: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + uncommitted changes')"
} > "$out/machine.txt"

step() {  # step NAME COMMAND...: run one command, log it, record its times and load
    local name=$1; shift
    local t0 l0 rc=0
    t0=$(date +%s.%N); l0=$(cut -d' ' -f1 /proc/loadavg)
    echo "bench-readme: $name: $*" >&2
    "$@" > "$out/$name.log" 2>&1 || rc=$?
    printf '%s\t%s\t%s\t%.1f\t%s\t%s\t%s\t%s\n' "$name" "$(date -u -d "@$t0" +%H:%M:%S)" \
        "$(date -u +%H:%M:%S)" "$(echo "$(date +%s.%N) - $t0" | bc)" "$l0" \
        "$(cut -d' ' -f1 /proc/loadavg)" "$rc" "$*" >> "$runs"
    [[ $rc -eq 0 ]] || echo "bench-readme: $name failed (rc $rc), see $out/$name.log" >&2
}

has() { [[ ",$only," == *",$1,"* ]]; }

if has quickstart; then
    for seed in 0 1 2; do
        step "quickstart-seed$seed" $slip run -c configs/quickstart.toml --run.seed=$seed \
            --run.output_dir="$out/quickstart-seed$seed"
    done
fi
has engine && step engine $slip bench engine --repeats 3 --out "$out/engine.json"
has train && step train $slip bench train --repeats 3 --out "$out/train.json"
if has pipeline; then
    # From the SFT start the quickstart just made (seed 0), as the README's row was measured;
    # without one the benchmark warns and starts from a random init (rewards ~0).
    init=()
    [[ -d "$out/quickstart-seed0/sft/checkpoint" ]] && init=(--init "$out/quickstart-seed0/sft/checkpoint")
    for i in 1 2 3; do
        step "pipeline-$i" $slip bench pipeline -c configs/quickstart.toml "${init[@]}" --steps 40 \
            --out "$out/pipeline-$i.json"
    done
fi
if has code; then
    # The code task's prompts (~210 tokens) need a longer context than the quickstart model's 64
    # positions; random init (no code SFT exists), so these rows are throughput only.
    code=(-c configs/quickstart.toml --task code --sandbox bwrap --model.max_position_embeddings=512
          --engine.max_new_tokens=48 --eval.max_new_tokens=48)
    for i in 1 2 3; do
        step "code-$i" $slip bench pipeline "${code[@]}" --steps 6 --out "$out/code-$i.json"
    done
    for i in 1 2 3; do
        step "code-reuse-$i" $slip bench pipeline "${code[@]}" --steps 18 --sandbox.reuse=true \
            --out "$out/code-reuse-$i.json"
    done
fi
echo "bench-readme: done; $runs" >&2
column -t -s $'\t' "$runs" >&2
