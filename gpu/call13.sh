#!/usr/bin/env bash
# Session 3, sixth call, on one nvidia-h200 (~3.5 minutes): the AdamW and cross-entropy tests natively, then
# bench.py gpt2 again (a second same-day measurement of call 12's table).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
timeout 40 python test_all.py adamw cross_entropy > $R/gputests.log 2>&1; echo "gpu tests: exit $?"
tail -3 $R/gputests.log; grep -i "fail" $R/gputests.log | head -3
timeout 200 python bench.py gpt2 --variants sdpa:tied,flash:tied --json $R/gpt2.json \
    --plot $R/gpt2.png > $R/gpt2.md 2> $R/gpt2.log; echo "gpt2: exit $?"
grep "^|" $R/gpt2.md
tar -czf $O/res.tar.gz -C $R .
