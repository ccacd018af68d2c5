#!/usr/bin/env bash
# Issue 31: the capacity planner's pushed-weights model against real runs. For each seed, the
# quickstart job runs twice, with weights pushed (engine.weight_sync = distributed) and through
# the store; `plan calibrate` turns each run into a rates file, and the store run is also
# calibrated with `--weights-bench` (a `bench weights` of the quickstart shape at 1 and 2
# engines, measured first in the same invocation) as "what would pushing cost this job".
# scripts/plan-weights-summary.py then simulates every rates file and prints measured vs
# predicted samples/s. Dynamic sampling is off: the planner does not simulate it.
#
#   scripts/plan-weights.sh OUT_DIR
#
# Environment: SEEDS ("0 1 2"), STEPS (200). Output: OUT_DIR/{distributed,store}-s<S>/ (run dir
# and rates), OUT_DIR/bench-quickstart.json, OUT_DIR/summary.json.
set -euo pipefail
out=${1:?usage: $0 OUT_DIR}
S=.venv/bin/slipstream
common=(--sft.steps=100 --rollout.num_workers=2 "--trainer.steps=${STEPS:-200}"
        --buffer.dynamic_sampling=false)
mkdir -p "$out"
$S bench weights --shape quickstart --engines 1,2 --repeats 5 --out "$out/bench-quickstart.json"
for seed in ${SEEDS:-0 1 2}; do
  for mode in distributed store; do
    d=$out/$mode-s$seed
    $S run -c configs/quickstart.toml "--run.output_dir=$d/run" "--store.url=$d/run/store" \
      "--run.seed=$seed" "${common[@]}" "--engine.weight_sync=$mode" > "$d.log" 2>&1
    $S plan calibrate "$d/run" -c configs/quickstart.toml "${common[@]}" "--run.seed=$seed" \
      "--engine.weight_sync=$mode" -o "$d/rates.toml" > "$d.calibrate.log" 2>&1
    if [ "$mode" = store ]; then
      $S plan calibrate "$d/run" -c configs/quickstart.toml "${common[@]}" "--run.seed=$seed" \
        --weights-bench "$out/bench-quickstart.json" -o "$d/rates-push.toml" \
        > "$d.calibrate-push.log" 2>&1
    fi
    tail -1 "$d.log"
  done
done
.venv/bin/python scripts/plan-weights-summary.py "$out"
