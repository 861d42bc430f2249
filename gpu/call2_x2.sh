#!/usr/bin/env bash
# Second call, on nvidia-h200-x2 (x4 was withdrawn). Needs data/shakespeare (carry it).
#   A (side by side): GPU 0 `train.py config/small.py` on 1 GPU | GPU 1 eager bench.py model sweep
#   B: `torchrun --nproc_per_node=2 train.py config/small.py` (our bucketed DDP)
#   C (side by side): GPU 0 bench.py attention | GPU 1 GPU tests of flash and model, AdamW step timing
#   D: bench.py ddp on 2 GPUs (GPT-2 XL shape)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R/train
STEPS=${STEPS:-150}
T0=$(date +%s)
run() {  # name, gpus, nproc, max seconds, extra args...
    local name=$1 gpus=$2 nproc=$3 max=$4; shift 4
    CUDA_VISIBLE_DEVICES=$gpus timeout $max torchrun --standalone --nproc_per_node=$nproc train.py \
        config/small.py --out_dir=/tmp/run-$name --max_iters=$STEPS --ckpt_interval=100000 "$@" > $R/train/$name.txt 2>&1
    echo "$name: exit $? at $(( $(date +%s) - T0 )) s"; tail -2 $R/train/$name.txt
    cp /tmp/run-$name/log.jsonl $R/train/$name.log.jsonl 2>/dev/null
    cp /tmp/run-$name/loss.png $R/train/$name.loss.png 2>/dev/null
}
run 1gpu-bucketed 0 1 140 &
(CUDA_VISIBLE_DEVICES=1 OUT=$R/sweep BUDGET_S=135 ONLY=sweep_eager bash gpu/h200_bench.sh > $R/sweep.log 2>&1
 echo "sweep: exit $?") &
wait
run 2gpu-bucketed 0,1 2 110
(CUDA_VISIBLE_DEVICES=0 timeout 105 python bench.py attention --rep 25 --time_budget 70 --json $R/attention.json \
    --plot $R/attention.png > $R/attention.md 2> $R/attention.log; echo "attention: exit $?") &
(export CUDA_VISIBLE_DEVICES=1; timeout 60 python test_all.py gpu \
    > $R/gputests.log 2>&1; echo "gpu tests: exit $?"; tail -3 $R/gputests.log
 timeout 40 python gpu/adamw.py > $R/adamw.md 2>&1; cat $R/adamw.md) &
wait
CUDA_VISIBLE_DEVICES=0,1 timeout 170 torchrun --standalone --nproc_per_node=2 bench.py ddp --preset gpt2-xl \
    --batch_size 8 --context_length 1024 --steps 5 --warmup 2 --json $R/ddp2.json --variants local naive flat \
    overlap bucketed-25 bucketed-100 bucketed-25+zero1 fsdp fsdp-bf16 torch-ddp torch-zero torch-fsdp2 \
    > $R/ddp2.md 2> $R/ddp2.log; echo "ddp: exit $?"
wait
python - $R/train <<'PY' | tee $R/train/summary.md
import json, os, sys
out = sys.argv[1]
print("| run | tokens/s (median, steps > 40) | ms/step | MFU | scaling vs 1 GPU | final val loss |\n|---|---|---|---|---|---|")
base = None
for name in ("1gpu-bucketed", "2gpu-bucketed"):
    path = os.path.join(out, name + ".log.jsonl")
    if not os.path.exists(path):
        print(f"| {name} | (no log) | | | | |"); continue
    rows = [json.loads(l) for l in open(path)]
    steps = [r for r in rows if "tokens_per_s" in r and r["step"] > 40] or [r for r in rows if "tokens_per_s" in r]
    med = lambda key: sorted((r.get(key) or 0) for r in steps)[len(steps) // 2]
    tok, ms, mfu = med("tokens_per_s"), med("ms_per_step"), med("mfu")
    base = base or tok
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    print(f"| {name} | {tok:,.0f} | {ms:.1f} | {100 * mfu:.1f}% | {tok / base / int(name[0]):.1%} | {val[-1] if val else float('nan'):.3f} |")
PY
tail -22 $R/ddp2.md
cd /tmp && tar -czf $O/res.tar.gz res && ls -la $O && echo "total $(( $(date +%s) - T0 )) s"
