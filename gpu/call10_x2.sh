#!/usr/bin/env bash
# Session 3, third call, on nvidia-h200-x2 (two jobs side by side, ~5 minutes).
#   GPU 0: bench.py gpt2 (separate projections, written-out cross-entropy backward, pair-swap RoPE)
#   GPU 1: gpu/gpt2_profile.py with sdpa and with flash (host vs GPU time per phase); GPU tests
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0
 timeout 330 python bench.py gpt2 --variants sdpa:tied,flash:tied,sdpa --json $R/gpt2.json \
    --plot $R/gpt2.png > $R/gpt2.md 2> $R/gpt2.log; echo "gpt2: exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 130 python gpu/gpt2_profile.py > $R/gpt2_profile.txt 2>&1; echo "profile: exit $?"
 timeout 100 python gpu/gpt2_profile.py --attn flash > $R/gpt2_profile_flash.txt 2>&1; echo "profile flash: exit $?"
 timeout 100 python test_all.py gpu cross_entropy adamw > $R/gputests.log 2>&1; echo "gpu tests: exit $?") &
wait
grep "^|" $R/gpt2.md; tail -4 $R/gputests.log; grep -i "fail" $R/gputests.log | head
for f in $R/gpt2_profile.txt $R/gpt2_profile_flash.txt; do grep -A7 "^## " $f; done
tar -czf $O/res.tar.gz -C $R .
