#!/usr/bin/env bash
# Session 5, fourth call, on nvidia-h200 (~7 minutes): the committed kernels, call 22's with the lengths specialized
# in the dK/dV pass too.
#   gpu/bwd_probe.py; bench.py attention (ANCHORS shapes and packed documents, ours vs cuDNN vs Flex);
#   flash, TMA and GPU tests natively
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
timeout 90 python gpu/bwd_probe.py > $R/probe.log 2>&1; echo "bwd probe: exit $?"
timeout 150 python bench.py attention --parts anchors,varlen --rep 25 --methods ours,sdpa-cudnn,flex \
    --json $R/attention.json > $R/attention.md 2> $R/attention.log; echo "attention: exit $?"
timeout 300 python test_all.py flash tma gpu > $R/gputests.log 2>&1; echo "gpu tests: exit $?"
grep "^|\|failed" $R/probe.log
tail -1 $R/attention.log; grep "^|" $R/attention.md
tail -2 $R/gputests.log; grep -B2 -A12 "^FAIL\|Traceback" $R/gputests.log | head -40
tar -czf $O/res.tar.gz -C $R .
