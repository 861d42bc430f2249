#!/usr/bin/env bash
# Session 3, fifth call, on one nvidia-h200 (~6 minutes), after the AdamW fix (chunk table built once, gradient
# offsets sent per step): bench.py gpt2, then gpu/adamw_host.py, gpu/adamw.py and gpu/gpt2_profile.py.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
timeout 230 python bench.py gpt2 --variants sdpa:tied,flash:tied --json $R/gpt2.json \
    --plot $R/gpt2.png > $R/gpt2.md 2> $R/gpt2.log; echo "gpt2: exit $?"
grep "^|" $R/gpt2.md
timeout 80 python gpu/adamw_host.py > $R/adamw_host.txt 2>&1; echo "adamw host: exit $?"
grep "host ms\|builds\|synchronizing" $R/adamw_host.txt
timeout 40 python gpu/adamw.py > $R/adamw.txt 2>&1; echo "adamw: exit $?"
tail -12 $R/adamw.txt
tar -czf $O/res.tar.gz -C $R .
timeout 100 python gpu/gpt2_profile.py > $R/gpt2_profile.txt 2>&1; echo "profile: exit $?"
grep -A8 "^## " $R/gpt2_profile.txt | grep -v "^  top\|nvjet"
tar -czf $O/res.tar.gz -C $R .
