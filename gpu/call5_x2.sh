#!/usr/bin/env bash
# Session 2, second call, on nvidia-h200-x2 (two jobs side by side, ~9 minutes):
#   GPU 0: bench.py varlen (compiled, 32k-token batches), then bench.py gpt2 (tied variants)
#   GPU 1: gpu/adamw.py, the rest of the eager sweep (gpt2-xl, xl, 10B), the compiled sweep of large..xl
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
SWEEP="model --sweep --context_lengths 256,512,1024 --dtypes bf16,fp32 --modes fwd,fwd_bwd,train --warmup 1 --steps 2"
(export CUDA_VISIBLE_DEVICES=0
 timeout 330 python bench.py varlen --json $R/varlen.json --plot $R/varlen.png > $R/varlen.md 2> $R/varlen.log
 echo "varlen: exit $?"
 timeout 200 python bench.py gpt2 --warmup 6 --steps 15 --variants sdpa,sdpa:tied,flash:tied --json $R/gpt2.json \
    --plot $R/gpt2.png > $R/gpt2.md 2> $R/gpt2.log; echo "gpt2: exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 80 python gpu/adamw.py > $R/adamw.txt 2>&1; echo "adamw: exit $?"
 timeout 170 python bench.py $SWEEP --sizes gpt2-xl,xl,10B --compile_options none --time_budget 140 \
    --json $R/sweep_eager2.json --plot $R/sweep_eager2.png > $R/sweep_eager2.md 2> $R/sweep_eager2.log
 echo "sweep eager: exit $?"
 timeout 280 python bench.py $SWEEP --sizes large,gpt2-xl,xl --compile_options blocks --time_budget 240 \
    --json $R/sweep_compiled2.json --plot $R/sweep_compiled2.png > $R/sweep_compiled2.md 2> $R/sweep_compiled2.log
 echo "sweep compiled: exit $?") &
wait
tail -9 $R/adamw.txt; grep "^|" $R/varlen.md; grep "^|" $R/gpt2.md
tail -3 $R/sweep_eager2.log $R/sweep_compiled2.log
tar -czf $O/res.tar.gz -C $R .
