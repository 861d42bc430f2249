#!/usr/bin/env bash
# GPU checks for train.py, in ONE device call (about 8 minutes on nvidia-h200-x2; fewer runs on one GPU):
#   1. our AdamW step vs torch.optim.AdamW(fused=True) and (foreach=True) on GPT-2-small-sized parameters
#      (issue 3: ours must be within 1.2x of fused);
#   2. `train.py config/small.py` on 1 GPU, then `torchrun --nproc_per_node=N` with our bucketed DDP and with torch
#      DDP (issue 8 on the GPUs available: N = 2 on nvidia-h200-x2, 4 on nvidia-h200-x4), tokens/s and scaling.
# Usage (repo root): bash gpu/train.sh   (writes summaries, log.jsonl files and loss PNGs under $OUT).
# data/shakespeare is prepared on first use (carry it to skip that: carry ["data/shakespeare"]).
set -uo pipefail
OUT=${OUT:-out-gpu}
STEPS=${STEPS:-150}
mkdir -p "$OUT"
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
nvidia-smi -L | tee "$OUT/gpus.txt"
export NCCL_NVLS_ENABLE=0

python gpu/adamw.py 2>&1 | tee "$OUT/adamw.txt"

run() {  # name, nproc, extra args...
    local name=$1 nproc=$2; shift 2
    local dir=/tmp/train-$name
    if [ "$nproc" = 1 ]; then
        timeout 170 python train.py config/small.py --out_dir=$dir --max_iters=$STEPS --ckpt_interval=100000 "$@" \
            > "$OUT/$name.txt" 2>&1
    else
        timeout 170 torchrun --standalone --nproc_per_node=$nproc train.py config/small.py --out_dir=$dir \
            --max_iters=$STEPS --ckpt_interval=100000 "$@" > "$OUT/$name.txt" 2>&1
    fi
    echo "$name: exit $?"; tail -4 "$OUT/$name.txt"
    cp $dir/log.jsonl "$OUT/$name.log.jsonl" 2>/dev/null; cp $dir/loss.png "$OUT/$name.loss.png" 2>/dev/null
}
run small-1gpu 1
if [ "$NGPU" -ge 2 ]; then
    run small-${NGPU}gpu-bucketed $NGPU --ddp_impl=bucketed
    run small-${NGPU}gpu-torch $NGPU --ddp_impl=torch
fi

python - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import glob, json, os, sys, time
out = sys.argv[1]
print(f"train.py config/small.py (GPT-2-small shape, vocab 2048, ctx 1024, 64k tokens/step), {time.strftime('%Y-%m-%d')}")
print("| run | tokens/s (median of logged steps after 30) | ms/step | MFU | final val loss |\n|---|---|---|---|---|")
base = None
for path in sorted(glob.glob(os.path.join(out, "*.log.jsonl")), key=lambda p: ("1gpu" not in p, p)):
    rows = [json.loads(l) for l in open(path)]
    steps = [r for r in rows if "tokens_per_s" in r and r["step"] > 30] or [r for r in rows if "tokens_per_s" in r]
    if not steps:
        continue
    tok = sorted(r["tokens_per_s"] for r in steps)[len(steps) // 2]
    ms = sorted(r["ms_per_step"] for r in steps)[len(steps) // 2]
    mfu = sorted((r["mfu"] or 0) for r in steps)[len(steps) // 2]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    name = os.path.basename(path).replace(".log.jsonl", "")
    base = base or tok
    print(f"| {name} | {tok:,.0f} ({tok / base:.2f}x of 1 GPU) | {ms:.1f} | {100 * mfu:.1f}% | {val[-1] if val else float('nan'):.3f} |")
EOF
