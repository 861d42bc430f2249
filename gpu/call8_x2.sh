#!/usr/bin/env bash
# Session 3, first call, on nvidia-h200-x2 (two jobs side by side, ~9 minutes).
#   GPU 0: bench.py gpt2 with fused and unfused projections; gpu/gpt2_profile.py (ours vs the peer, by kernel)
#   GPU 1: flash tests natively (both backward modes); bench.py attention on the ANCHORS shapes and packed documents
# It ran two trials since removed: fused q/k/v and w1/w3 projections (':unfused' variants) and a single-pass
# flash backward (the 'ours-nondet' rows); BENCHMARKS.md has their results. To rerun now, drop the ':unfused'
# variant (bench.py no longer has it).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0
 timeout 330 python bench.py gpt2 --variants sdpa:tied,sdpa:tied:unfused,flash:tied --json $R/gpt2.json \
    --plot $R/gpt2.png > $R/gpt2.md 2> $R/gpt2.log; echo "gpt2: exit $?"
 timeout 200 python gpu/gpt2_profile.py > $R/gpt2_profile.txt 2>&1; echo "profile: exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 150 python test_all.py flash fused gpu > $R/gputests.log 2>&1; echo "gpu tests: exit $?"
 timeout 380 python bench.py attention --parts anchors,varlen --rep 25 --json $R/attention.json \
    > $R/attention.md 2> $R/attention.log; echo "attention: exit $?") &
wait
grep "^|" $R/gpt2.md; tail -3 $R/gpt2.log; tail -5 $R/gputests.log; grep -i "fail" $R/gputests.log | head
tail -2 $R/attention.log; grep "^|" $R/attention.md | grep -v "naive\|efficient"
grep -A12 "^## " $R/gpt2_profile.txt | head -60
tar -czf $O/res.tar.gz -C $R .
