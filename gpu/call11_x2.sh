#!/usr/bin/env bash
# Session 3, fourth call, on nvidia-h200-x2 (~3 minutes). GPU 0: gpu/adamw_host.py; GPU 1: GPU tests.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0
 timeout 150 python gpu/adamw_host.py > $R/adamw_host.txt 2>&1; echo "adamw host: exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 200 python test_all.py gpu cross_entropy adamw > $R/gputests.log 2>&1; echo "gpu tests: exit $?") &
wait
grep -v "^\s*$" $R/adamw_host.txt | grep -v Warn | head -45; tail -6 $R/gputests.log; grep -i "fail" $R/gputests.log | head
tar -czf $O/res.tar.gz -C $R .
