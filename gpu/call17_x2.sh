#!/usr/bin/env bash
# Session 4, second call, on nvidia-h200-x2 (two jobs side by side, ~5 minutes).
#   GPU 0: gpu/bwd_probe.py (backward kernel variants: FlexAttention's loop order, transposed tile loads, one loop,
#          a fused dQ + dK/dV launch)
#   GPU 1: flash and GPU tests natively with the pointer loads (the default again) and the TMA test
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0
 timeout 300 python gpu/bwd_probe.py > $R/probe.log 2>&1; echo "probe: exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 330 python test_all.py flash tma gpu > $R/gputests.log 2>&1; echo "gpu tests: exit $?") &
wait
grep "^|\|failed" $R/probe.log
tail -3 $R/gputests.log; grep -B2 -A12 "^FAIL\|Traceback" $R/gputests.log | head -60
tar -czf $O/res.tar.gz -C $R .
