#!/bin/bash
cd /work/main
for spec in old:0 new:1 old:1 new:2 old:2; do
  v=${spec%:*}; s=${spec#*:}
  if [ $v = old ]; then P=/tmp/oldwt/src; else P=/work/main/src; fi
  d=/tmp/ab/run-$v-s$s; rm -rf $d
  t0=$(date +%s.%N)
  PYTHONPATH=$P .venv/bin/slipstream run -c configs/quickstart.toml --run.seed=$s --run.output_dir=$d > $d.log 2>&1
  t1=$(date +%s.%N)
  echo "$v s$s rc=$? wall=$(echo "$t1 - $t0" | bc) $(grep -o 'sft done.*tok/s)' $d.log | head -1) $(grep -A1 '^result' $d.log | tr '\n' ' ')" >> /tmp/ab/jobs.txt
done
echo done >> /tmp/ab/jobs.txt
