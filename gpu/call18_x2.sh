#!/usr/bin/env bash
# Session 4, third call, on nvidia-h200-x2 (two jobs side by side, ~6 minutes).
#   GPU 0: gpu/bwd_probe.py (flash.py's dK/dV now in FlexAttention's load order; dQ variants), then bench.py
#          attention on the ANCHORS shapes and packed documents: ours vs cuDNN vs Flex
#   GPU 1: flash, TMA and GPU tests natively
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0
 timeout 120 python gpu/bwd_probe.py > $R/probe.log 2>&1; echo "probe: exit $?"
 timeout 240 python bench.py attention --parts anchors,varlen --rep 25 --methods ours,sdpa-cudnn,flex \
    --json $R/attention.json > $R/attention.md 2> $R/attention.log; echo "attention: exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 340 python test_all.py flash tma gpu > $R/gputests.log 2>&1; echo "gpu tests: exit $?") &
wait
grep "^|\|failed" $R/probe.log
tail -2 $R/attention.log; grep "^|" $R/attention.md
tail -3 $R/gputests.log; grep -B2 -A12 "^FAIL\|Traceback" $R/gputests.log | head -40
tar -czf $O/res.tar.gz -C $R .
