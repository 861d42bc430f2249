#!/usr/bin/env bash
# Session 2, third call, on nvidia-h200-x2 (two jobs side by side, ~8.5 minutes). Needs data/shakespeare (carry).
#   GPU 0: bench.py attention: ANCHORS shapes, packed documents, then the SPEC §7.5 sweep with the time left
#   GPU 1: gpu/overhead.py; the flash / varlen / AdamW / model tests natively; a short packed training run
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0
 timeout 500 python bench.py attention --rep 25 --time_budget 440 --json $R/attention.json --plot $R/attention.png \
    > $R/attention.md 2> $R/attention.log; echo "attention: exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 60 python gpu/overhead.py > $R/overhead.txt 2>&1; echo "overhead: exit $?"
 timeout 260 python test_all.py flash varlen adamw packed gpu > $R/gputests.log 2>&1; echo "gpu tests: exit $?"
 timeout 150 python train.py config/small.py config/pack.py --max_iters=30 --eval_interval=15 --eval_iters=5 \
    --log_interval=5 --out_dir=/tmp/run-pack > $R/train_pack.txt 2>&1; echo "train pack: exit $?") &
wait
cat $R/overhead.txt; tail -5 $R/gputests.log; grep -i "fail" $R/gputests.log | head; tail -6 $R/train_pack.txt
tail -2 $R/attention.log; grep -c "^|" $R/attention.md
tar -czf $O/res.tar.gz -C $R .
