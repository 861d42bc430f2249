#!/usr/bin/env bash
# Session 5, third call, on nvidia-h200 (~3 minutes): what flash.py's autotuner picks on the ANCHORS shapes after the
# backward changes (call 22 timed D=128, S=4096 slower than its kernels add up to), against each config forced.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
timeout 240 python gpu/autotune_check.py > $R/autotune.log 2>&1; echo "autotune check: exit $?"
cat $R/autotune.log | grep -v "^|"
grep "^|" $R/autotune.log | tail -20
tar -czf $O/res.tar.gz -C $R .
