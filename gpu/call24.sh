#!/usr/bin/env bash
# Session 5, fourth call, on nvidia-h200 (~7 minutes): the committed kernels, call 22's with the lengths specialized
# in the dK/dV pass too; the same steps as call 22 (backward probe, bench.py attention, flash/TMA/GPU tests).
exec bash "$(dirname "$0")/call22.sh"
