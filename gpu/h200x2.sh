#!/usr/bin/env bash
# The two-GPU tables of BENCHMARKS.md, regenerated on two NVIDIA H200s of one host in parts that each end within 10
# minutes (PART=ddp bash gpu/h200x2.sh; PART=all: every part), output as gpu/h200.sh's. The parts (Data parallel):
# ddp, our DDPs, ZeRO-1 and FSDP beside torch's; allreduce, NCCL 1 to 1000 MiB; train2, train.py config/small.py on
# 1 and 2 GPUs (needs data/shakespeare); and leaderboard (the 8B step): all 34 layers, one sequence per GPU.
set -u
cd "$(dirname "$0")/.." || exit 1
# NVLink multicast stays off: on shared hosts a program using it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RUNNER=gpu/h200x2.sh
ALL_PARTS=(ddp allreduce train2 leaderboard)
source gpu/common.sh
TR=("$TORCHRUN" --standalone --nproc_per_node=2)

part_ddp() { run_md ddp 560 "${TR[@]}" bench.py ddp --preset gpt2-xl --batch_size 8 --context_length 1024 --steps 5 \
    --warmup 2 --variants none naive flat overlap bucketed-25 bucketed-100 bucketed-25+zero1 fsdp fsdp+bf16 \
    torch torch+zero_redundancy torch_fsdp+bf16 --json @JSON@; }
part_allreduce() { run_md allreduce 300 "${TR[@]}" bench.py allreduce --warmup 5 --steps 20 --json @JSON@; }
part_train2() { train_runs "1gpu 1" "2gpu_bucketed 2 --ddp_impl=bucketed" "2gpu_torch 2 --ddp_impl=torch"; }
# one sequence per GPU, our FSDP in bf16; 26 of 34 blocks recompute their activations, so the sharded states and the
# activations of the other 8 fit a GPU
part_leaderboard() { run_md leaderboard 560 "${TR[@]}" bench.py model --size 8B --vocab_size 151936 \
    --context_length 32768 --batch_size 1 --dtype bf16 --attn flash --compile blocks --act_ckpt_every 1 \
    --act_ckpt_layers 26 --peer native --warmup 2 --steps 5 --json @JSON@; }

run_parts
