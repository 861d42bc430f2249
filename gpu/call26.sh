#!/usr/bin/env bash
# Session 5, sixth call, on nvidia-h200 (~2 minutes): gpu/bwd_gap.py, the backward through autograd vs the direct call.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
timeout 150 python gpu/bwd_gap.py > $O/gap.log 2>&1; echo "gap: exit $?"
cat $O/gap.log | cut -c1-200
