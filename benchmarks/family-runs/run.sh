#!/bin/bash
# run.sh FAMILY: quickstart SFT (2400 steps, the file's) then RL (500 steps, the file's), tiny random init
cd /work/main
fam=$1; out=/tmp/fam47/q-$fam
case $fam in
  gpt_oss) model=$(.venv/bin/python benchmarks/family-runs/overrides.py gpt-oss-quickstart | grep -v rope_scaling | tr '\n' ' ')
           model="$model --model.rope_scaling={factor=32.0,original_max_position_embeddings=4096,truncate=false}";;
  *) model=$(.venv/bin/python benchmarks/family-runs/overrides.py $fam-quickstart | tr '\n' ' ');;
esac
rm -rf $out
t0=$(date +%s); l0=$(cut -d' ' -f1-3 /proc/loadavg)
timeout 1200 .venv/bin/slipstream run --plain -c configs/quickstart.toml $model --run.output_dir=$out > $out.log 2>&1; rc=$?
t1=$(date +%s); l1=$(cut -d' ' -f1-3 /proc/loadavg)
echo "family=$fam rc=$rc wall_s=$((t1-t0)) load start=$l0 end=$l1 $(grep -A1 '^result' $out.log | tr '\n' ' ')" >> /tmp/fam47/summary.txt
