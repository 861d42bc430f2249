#!/usr/bin/env bash
# Issue 8 on nvidia-h200-x4: `train.py config/small.py` on 1, 2 and 4 GPUs (our bucketed DDP) and on 4 GPUs with
# torch's DDP, in one call; the 1- and 2-GPU runs go side by side on separate GPUs (GPU 3 meanwhile runs the eager
# bench.py sweep), then the two 4-GPU runs one after the other. Needs data/shakespeare (carry it).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=${OUT:-out-gpu}
mkdir -p $O/train
STEPS=${STEPS:-300}
run() {  # name, gpus, nproc, extra args...
    local name=$1 gpus=$2 nproc=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpus timeout ${MAXS:-200} torchrun --standalone --nproc_per_node=$nproc train.py \
        config/small.py --out_dir=/tmp/run-$name --max_iters=$STEPS --ckpt_interval=100000 "$@" > $O/train/$name.txt 2>&1
    echo "$name: exit $?"; tail -3 $O/train/$name.txt
    cp /tmp/run-$name/log.jsonl $O/train/$name.log.jsonl 2>/dev/null
    cp /tmp/run-$name/loss.png $O/train/$name.loss.png 2>/dev/null
}
run 1gpu-bucketed 0 1 &
run 2gpu-bucketed 1,2 2 &
(export CUDA_VISIBLE_DEVICES=3; OUT=$O/sweep BUDGET_S=190 ONLY=sweep_eager bash tests_wip/gpu_bench.sh > $O/sweep.log 2>&1;
 timeout 120 python -m pytest -q tests_wip/test_flash.py tests_wip/test_model.py -k gpu > $O/gputests.log 2>&1) &
wait
run 4gpu-bucketed 0,1,2,3 4
run 4gpu-torch 0,1,2,3 4 --ddp_impl=torch
CUDA_VISIBLE_DEVICES=0,1,2,3 timeout 60 torchrun --standalone --nproc_per_node=4 bench.py allreduce > $O/train/allreduce4.md 2>&1
python - $O/train <<'PY' | tee $O/train/summary.md
import glob, json, os, sys
out = sys.argv[1]
print("| run | tokens/s (median, steps > 50) | ms/step | MFU | scaling vs 1 GPU | final val loss |\n|---|---|---|---|---|---|")
base = None
for name in ("1gpu-bucketed", "2gpu-bucketed", "4gpu-bucketed", "4gpu-torch"):
    path = os.path.join(out, name + ".log.jsonl")
    if not os.path.exists(path):
        print(f"| {name} | (no log) | | | | |"); continue
    rows = [json.loads(l) for l in open(path)]
    steps = [r for r in rows if "tokens_per_s" in r and r["step"] > 50] or [r for r in rows if "tokens_per_s" in r]
    med = lambda key: sorted((r.get(key) or 0) for r in steps)[len(steps) // 2]
    tok, ms, mfu = med("tokens_per_s"), med("ms_per_step"), med("mfu")
    n = int(name[0])
    base = base or tok
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    print(f"| {name} | {tok:,.0f} | {ms:.1f} | {100 * mfu:.1f}% | {tok / base / n:.1%} | {val[-1] if val else float('nan'):.3f} |")
PY
tail -3 $O/train/allreduce4.md
cd $O && tar -czf train.tar.gz train sweep.log gputests.log && ls -la
