#!/usr/bin/env bash
# Does the SFT warm start depend on CPU rounding? Runs the same SFT twice on this machine, once
# with the default CPU kernels and once with other kernels (ATen's scalar kernels and MKL limited
# to AVX without FMA: different rounding in every GEMM and elementwise op, as another CPU would
# give), side by side (1 thread each), then evaluates both checkpoints on the held-out split.
#
#   scripts/sft-rounding.sh OUT_DIR SEED [--section.key=value ...]
#   e.g. scripts/sft-rounding.sh /tmp/rounding 0 --sft.lr=1e-3
#
# Prints one line per kernel set: held-out greedy pass@1, SFT final loss and time. A recipe whose
# two lines differ by many points is at the mercy of the CPU (docs/rl.md, "SFT and CPU rounding").
set -euo pipefail
out=${1:?usage: $0 OUT_DIR SEED [overrides]}; seed=${2:?usage: $0 OUT_DIR SEED [overrides]}
shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
bin="$here/.venv/bin/slipstream"
mkdir -p "$out"
"$bin" sft -c "$here/configs/quickstart.toml" --run.seed="$seed" --run.output_dir="$out/default" "$@" \
  > "$out/default.log" 2>&1 &
ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX \
  "$bin" sft -c "$here/configs/quickstart.toml" --run.seed="$seed" --run.output_dir="$out/other" "$@" \
  > "$out/other.log" 2>&1 &
wait
for k in default other; do
  acc=$("$bin" eval -c "$here/configs/quickstart.toml" --run.output_dir="$out/$k" "$@" --eval.k=1 2>&1 \
        | grep "pass@1 (greedy)" | tr -d '│ ' | sed 's/pass@1(greedy)//')
  done_line=$(grep "sft done" "$out/$k.log" | sed 's/ -> .*//')
  echo "kernels=$k seed=$seed $* | held-out greedy pass@1 $acc | $done_line"
done | tee "$out/summary.txt"
