#!/usr/bin/env bash
# Session 5, first call, on nvidia-h200 (~7 minutes): (1) gpu/ws_probe.py, Triton's Hopper warp specialization on
# stripped forward and dK/dV kernels vs flash.py and cuDNN; (2) gpu/bwd_probe.py with flash.py's dK/dV kernel now
# proving its L/Delta rows aligned (full-tile loop from start_n + BLOCK_N, L offsets written as multiples of 128);
# (3) bench.py attention on the ANCHORS shapes and packed documents, ours vs cuDNN vs Flex.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
timeout 200 python gpu/ws_probe.py > $R/ws.log 2>&1; echo "ws probe: exit $?"
timeout 100 python gpu/bwd_probe.py > $R/probe.log 2>&1; echo "bwd probe: exit $?"
timeout 170 python bench.py attention --parts anchors,varlen --rep 25 --methods ours,sdpa-cudnn,flex \
    --json $R/attention.json > $R/attention.md 2> $R/attention.log; echo "attention: exit $?"
grep "^|\|failed" $R/ws.log
grep "^|\|failed" $R/probe.log
tail -1 $R/attention.log; grep "^|" $R/attention.md
tar -czf $O/res.tar.gz -C $R .
