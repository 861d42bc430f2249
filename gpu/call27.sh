#!/usr/bin/env bash
# Session 5, seventh call, on nvidia-h200 (~2 minutes): packed documents, flash.py vs the fourth session's flash.py
# (gpu/flash_prev.py = `git show 0e34615:flash.py`, made before the call), forward and backward, short documents.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
timeout 200 python gpu/varlen_prev.py gpu/flash_prev.py > $O/varlen_prev.log 2>&1; echo "varlen prev: exit $?"
cat $O/varlen_prev.log | tail -30
