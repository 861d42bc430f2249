#!/usr/bin/env bash
# Session 4, fourth call, on nvidia-h200-x2 (two jobs side by side, ~6 minutes): flash.py's backward after the
# probe (dK/dV in FlexAttention's load order, GROUP a constexpr, no ragged-tile loop for even lengths; dQ loads V
# after P at D <= 64).
#   GPU 0: gpu/bwd_probe.py; bench.py attention (ANCHORS shapes and packed documents, ours vs cuDNN vs Flex);
#          bench.py gpt2 (flash vs sdpa inside the compiled GPT-2-small model)
#   GPU 1: flash, TMA and GPU tests natively
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0
 timeout 90 python gpu/bwd_probe.py > $R/probe.log 2>&1; echo "probe: exit $?"
 timeout 150 python bench.py attention --parts anchors,varlen --rep 25 --methods ours,sdpa-cudnn,flex \
    --json $R/attention.json > $R/attention.md 2> $R/attention.log; echo "attention: exit $?"
 timeout 200 python bench.py gpt2 --variants sdpa:tied,flash:tied --json $R/gpt2.json > $R/gpt2.md \
    2> $R/gpt2.log; echo "gpt2: exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 330 python test_all.py flash tma gpu > $R/gputests.log 2>&1; echo "gpu tests: exit $?") &
wait
grep "^|\|failed" $R/probe.log
tail -1 $R/attention.log; grep "^|" $R/attention.md
grep "^|" $R/gpt2.md; tail -2 $R/gpt2.log
tail -2 $R/gputests.log; grep -B2 -A12 "^FAIL\|Traceback" $R/gputests.log | head -40
tar -czf $O/res.tar.gz -C $R .
