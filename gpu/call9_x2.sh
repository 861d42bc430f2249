#!/usr/bin/env bash
# Session 3, second call, on nvidia-h200-x2 (two jobs side by side, ~6 minutes).
#   GPU 0: bench.py gpt2: written-out cross-entropy backward and pair-swap RoPE, fused and unfused projections
#   GPU 1: gpu/gpt2_profile.py fused and unfused; GPU tests of the model paths
# The ':unfused' variant flag and gpu/gpt2_profile.py --unfused belonged to the fused-projection trial, since
# removed (BENCHMARKS.md, Model training throughput).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0
 timeout 420 python bench.py gpt2 --variants sdpa:tied,sdpa:tied:unfused,flash:tied,sdpa --json $R/gpt2.json \
    --plot $R/gpt2.png > $R/gpt2.md 2> $R/gpt2.log; echo "gpt2: exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 150 python gpu/gpt2_profile.py > $R/gpt2_profile.txt 2>&1; echo "profile: exit $?"
 timeout 100 python gpu/gpt2_profile.py --unfused > $R/gpt2_profile_unfused.txt 2>&1; echo "profile unfused: exit $?"
 timeout 150 python test_all.py gpu fused cross_entropy rope > $R/gputests.log 2>&1; echo "gpu tests: exit $?") &
wait
grep "^|" $R/gpt2.md; tail -2 $R/gpt2.log; tail -4 $R/gputests.log; grep -i "fail" $R/gputests.log | head
for f in $R/gpt2_profile.txt $R/gpt2_profile_unfused.txt; do grep -A16 "^## ours" $f; done
tar -czf $O/res.tar.gz -C $R .
