#!/usr/bin/env bash
# Session 2, fourth call, on one nvidia-h200 (~5 minutes): host overhead after the eager fast path, the GPU tests
# (flash, varlen, AdamW, packed model) natively, and the packed-documents attention cases.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
timeout 60 python gpu/overhead.py > $R/overhead.txt 2>&1; echo "overhead: exit $?"
timeout 200 python test_all.py flash varlen adamw packed gpu > $R/gputests.log 2>&1; echo "gpu tests: exit $?"
timeout 60 python bench.py attention --parts varlen --rep 25 --json $R/attention_varlen.json > $R/attention_varlen.md \
    2> $R/attention_varlen.log; echo "attention varlen: exit $?"
cat $R/overhead.txt; grep -v "^ok" $R/gputests.log | tail -25; grep "^|" $R/attention_varlen.md
tar -czf $O/res.tar.gz -C $R .
