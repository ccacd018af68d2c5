#!/bin/bash
cd /work/main
while ! grep -q '^done' /tmp/ab/jobs.txt; do sleep 5; done
for spec in old:a new:a old:b new:b; do
  v=${spec%:*}; r=${spec#*:}
  if [ $v = old ]; then P=/tmp/oldwt/src; else P=/work/main/src; fi
  d=/tmp/ab/rl-$v-$r; rm -rf $d
  t0=$(date +%s.%N)
  PYTHONPATH=$P .venv/bin/slipstream run -c configs/quickstart.toml --model.init_from=/tmp/ab/run-old-s0/sft/checkpoint --run.output_dir=$d > $d.log 2>&1
  t1=$(date +%s.%N)
  echo "$v $r wall=$(echo "$t1 - $t0" | bc) $(grep -A1 '^result' $d.log | tr '\n' ' ')" >> /tmp/ab/rl.txt
done
echo done >> /tmp/ab/rl.txt
