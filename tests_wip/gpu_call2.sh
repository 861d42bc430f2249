#!/usr/bin/env bash
# Second call on nvidia-h200-x4 (issue 8 + what call 1 missed). Needs data/shakespeare (carry it).
#   A (side by side): GPU 0 `train.py config/small.py` on 1 GPU | GPUs 1,2 the same on 2 GPUs (our bucketed DDP) |
#                     GPU 3 bench.py attention
#   B: 4 GPUs, our bucketed DDP;  C: 4 GPUs, torch DDP
#   D (side by side): GPUs 0,1 bench.py ddp (GPT-2 XL shape) | GPU 2 eager model sweep | GPU 3 GPU tests, compile
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
O=${OUT:-out-gpu}
R=/tmp/res; mkdir -p $R/train
STEPS=${STEPS:-200}
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
run 2gpu-bucketed 1,2 2 140 &
(CUDA_VISIBLE_DEVICES=3 timeout 135 python bench.py attention --rep 25 --time_budget 95 --json $R/attention.json \
    --plot $R/attention.png > $R/attention.md 2> $R/attention.log; echo "attention: exit $?") &
wait
run 4gpu-bucketed 0,1,2,3 4 110
run 4gpu-torch 0,1,2,3 4 110 --ddp_impl=torch
(CUDA_VISIBLE_DEVICES=0,1 timeout 170 torchrun --standalone --nproc_per_node=2 bench.py ddp --preset gpt2-xl \
    --batch_size 8 --context_length 1024 --steps 5 --warmup 2 --json $R/ddp2.json --variants local naive flat \
    overlap bucketed-25 bucketed-100 bucketed-25+zero1 fsdp fsdp-bf16 torch-ddp torch-zero torch-fsdp2 \
    > $R/ddp2.md 2> $R/ddp2.log; echo "ddp: exit $?") &
(CUDA_VISIBLE_DEVICES=2 OUT=$R/sweep BUDGET_S=165 ONLY=sweep_eager bash tests_wip/gpu_bench.sh > $R/sweep.log 2>&1
 echo "sweep: exit $?") &
(export CUDA_VISIBLE_DEVICES=3; timeout 90 python -m pytest -q -x tests_wip/test_flash.py tests_wip/test_model.py -k gpu \
    > $R/gputests.log 2>&1; echo "gpu tests: exit $?"; tail -3 $R/gputests.log
 timeout 70 python tests_wip/gpu_adamw.py > $R/adamw.md 2>&1; cat $R/adamw.md) &
wait
python - $R/train <<'PY' | tee $R/train/summary.md
import json, os, sys
out = sys.argv[1]
print("| run | tokens/s (median, steps > 40) | ms/step | MFU | scaling vs 1 GPU | final val loss |\n|---|---|---|---|---|---|")
base = None
for name in ("1gpu-bucketed", "2gpu-bucketed", "4gpu-bucketed", "4gpu-torch"):
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
