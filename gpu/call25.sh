#!/usr/bin/env bash
# Session 5, fifth call, on nvidia-h200 (~4 minutes): GPT-2-small training throughput with attn_impl=flash vs sdpa
# (compiled model) on the committed kernels.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
timeout 280 python bench.py gpt2 --variants sdpa:tied,flash:tied --json $R/gpt2.json > $R/gpt2.md 2> $R/gpt2.log
echo "gpt2: exit $?"
grep "^|" $R/gpt2.md; tail -3 $R/gpt2.log
tar -czf $O/res.tar.gz -C $R .
