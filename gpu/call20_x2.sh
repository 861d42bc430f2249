#!/usr/bin/env bash
# Session 4, fifth call, on nvidia-h200-x2 (two jobs side by side, ~5 minutes). It measured a pointer-layout trial
# since reverted (_rows keeping one row of pointers instead of a whole tile across the loops: fewer spills in a local
# sm_90 compile, same time on the GPU); rerun now, it measures the current kernels.
#   GPU 0: gpu/bwd_probe.py; bench.py attention (ANCHORS shapes and packed documents, ours vs cuDNN vs Flex)
#   GPU 1: flash, TMA and GPU tests natively
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0
 timeout 80 python gpu/bwd_probe.py > $R/probe.log 2>&1; echo "probe: exit $?"
 timeout 130 python bench.py attention --parts anchors,varlen --rep 25 --methods ours,sdpa-cudnn,flex \
    --json $R/attention.json > $R/attention.md 2> $R/attention.log; echo "attention: exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 265 python test_all.py flash tma gpu > $R/gputests.log 2>&1; echo "gpu tests: exit $?") &
wait
grep "^|\|failed" $R/probe.log
tail -1 $R/attention.log; grep "^|" $R/attention.md
tail -2 $R/gputests.log; grep -B2 -A12 "^FAIL\|Traceback" $R/gputests.log | head -40
tar -czf $O/res.tar.gz -C $R .
