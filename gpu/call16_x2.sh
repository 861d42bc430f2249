#!/usr/bin/env bash
# Session 4, first call, on nvidia-h200-x2 (two jobs side by side, ~8 minutes): TMA descriptor loads in flash.py.
#   GPU 0: flash tests natively (TMA on by default on the H200; the pointer path through the TMA/pointer test), then
#          bench.py attention on the ANCHORS shapes and packed documents: ours (TMA) vs ours-noTMA vs cuDNN vs Flex
#   GPU 1: gpu/flash_tune.py tile sweep of the TMA kernels; gpu/flash_host.py (host time per call)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0
 timeout 170 python test_all.py flash gpu > $R/gputests.log 2>&1; echo "gpu tests: exit $?"
 timeout 330 python bench.py attention --parts anchors,varlen --rep 25 --methods ours,ours-noTMA,sdpa-cudnn,flex \
    --json $R/attention.json > $R/attention.md 2> $R/attention.log; echo "attention: exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 360 python gpu/flash_tune.py > $R/tune.log 2>&1; echo "tune: exit $?"
 timeout 100 python gpu/flash_host.py > $R/flash_host.txt 2>&1; echo "flash host: exit $?") &
wait
tail -4 $R/gputests.log; grep -i "fail\|error" $R/gputests.log | head
tail -2 $R/attention.log; grep "^|" $R/attention.md
grep "^|" $R/tune.log; grep "failed" $R/tune.log | head -5
grep "^|" $R/flash_host.txt
tar -czf $O/res.tar.gz -C $R .
