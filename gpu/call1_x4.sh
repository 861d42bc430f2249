#!/usr/bin/env bash
# One call on nvidia-h200-x4: independent measurements side by side on separate GPUs of one host.
#   GPU 0: bench.py gpt2, varlen, profile of small, memory snapshot of xl
#   GPU 1: bench.py attention, precision, compile
#   GPUs 2,3: bench.py allreduce and ddp (2 ranks), then the AdamW step comparison on GPU 2
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=${OUT:-out-gpu}
mkdir -p $O/g0 $O/g1 $O/ddp
nvidia-smi -L > $O/gpus.txt
B=${BUDGET_S:-400}
(CUDA_VISIBLE_DEVICES=0 OUT=$O/g0 BUDGET_S=$B ONLY=gpt2,varlen,profile_small,memory_xl bash gpu/h200_bench.sh > $O/g0.log 2>&1) &
(CUDA_VISIBLE_DEVICES=1 OUT=$O/g1 BUDGET_S=$B ONLY=attention,precision,compile bash gpu/h200_bench.sh > $O/g1.log 2>&1) &
(
  export CUDA_VISIBLE_DEVICES=2,3
  timeout 60 torchrun --standalone --nproc_per_node=2 bench.py allreduce --json $O/ddp/allreduce2.json > $O/ddp/allreduce2.md 2>&1
  timeout $((B - 90)) torchrun --standalone --nproc_per_node=2 bench.py ddp --preset gpt2-xl --batch_size 8 \
      --context_length 1024 --steps 6 --warmup 2 --json $O/ddp/ddp2.json > $O/ddp/ddp2.md 2>&1
  CUDA_VISIBLE_DEVICES=2 timeout 90 python gpu/adamw.py > $O/ddp/adamw.md 2>&1
) > $O/ddp.log 2>&1 &
wait
cd $O && tar -czf extra.tar.gz ddp g0.log g1.log gpus.txt g0/results.tar.gz g1/results.tar.gz 2>/dev/null
ls -la $O $O/g0 $O/g1
cat $O/ddp/ddp2.md | tail -30; cat $O/ddp/allreduce2.md | tail -10; cat $O/ddp/adamw.md
echo; tail -5 $O/g0.log $O/g1.log
