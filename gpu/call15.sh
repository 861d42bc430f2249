#!/usr/bin/env bash
# Session 3, eighth call, on one nvidia-h200 (~1.5 minutes): gpu/flash_host.py (host time of flash.py calls).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
timeout 120 python gpu/flash_host.py > $O/flash_host.txt 2>&1; echo "flash host: exit $?"
grep "^|" $O/flash_host.txt
