#!/usr/bin/env bash
# Session 2, first call, on nvidia-h200-x2 (two jobs side by side, ~9 minutes):
#   GPU 0: bench.py gpt2 (ours sdpa / flash / flash tied, fused AdamW, vs the torch.nn peer), then the compiled
#          (per-block) sweep with the time left
#   GPU 1: gpu/adamw.py (fused kernel check + timing), gpu/varlen_probe.py, gpu/flash_tune.py
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
(CUDA_VISIBLE_DEVICES=0 OUT=$R/g0 BUDGET_S=540 ONLY=gpt2,sweep_compiled bash gpu/h200_bench.sh > $R/g0.log 2>&1
 echo "g0: exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 100 python gpu/adamw.py > $R/adamw.txt 2>&1; echo "adamw: exit $?"
 timeout 220 python gpu/varlen_probe.py $R > $R/varlen_probe.txt 2>&1; echo "varlen_probe: exit $?"
 timeout 200 python gpu/flash_tune.py > $R/flash_tune.txt 2>&1; echo "flash_tune: exit $?") &
wait
tail -8 $R/adamw.txt; grep "^|\|^{" $R/varlen_probe.txt; tail -9 $R/flash_tune.txt
cat $R/g0/BENCH.md 2>/dev/null | grep -A8 "^| model"
tar -czf $O/res.tar.gz -C $R .
