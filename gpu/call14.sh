#!/usr/bin/env bash
# Session 3, seventh call, on one nvidia-h200 (~3 minutes; needs data/shakespeare, carried): train.py end to end
# with the new AdamW and cross-entropy: config/small.py (flash, compiled, grad_accum 4), then a 1-rank torchrun
# with FSDP (our fused AdamW on shards whose gradients are new tensors every step).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R
timeout 130 python train.py config/small.py --max_iters=60 --eval_interval=30 --eval_iters=5 --log_interval=10 \
    --ckpt_interval=100000 --out_dir=/tmp/run-small > $R/train_small.txt 2>&1; echo "train small: exit $?"
tail -9 $R/train_small.txt
timeout 100 torchrun --standalone --nproc_per_node=1 train.py config/small.py --ddp_impl=fsdp --max_iters=20 \
    --eval_interval=20 --eval_iters=3 --log_interval=5 --ckpt_interval=100000 --out_dir=/tmp/run-fsdp \
    > $R/train_fsdp.txt 2>&1; echo "train fsdp: exit $?"
tail -6 $R/train_fsdp.txt
cp /tmp/run-small/loss.png $R/ 2>/dev/null
tar -czf $O/res.tar.gz -C $R .
