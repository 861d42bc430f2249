#!/usr/bin/env bash
# The one-GPU tables of BENCHMARKS.md, regenerated on one NVIDIA H200 in parts that each end within 10 minutes:
#     PART=attention bash gpu/h200.sh    # one part; PART=train,varlen: several in order; PART=all: every part
# Run from the repository root; each step runs under `timeout`, so a part cut short keeps what it wrote. Output
# under ${OUT:-bench_out}: BENCH.md and results.tar.gz (gpu/common.sh). The parts, by BENCHMARKS.md section:
#   goals                                            The goal table: every one-GPU goal, ours beside its peer in
#                                                    one call (GOALS=xl,hf: some), the table printed last
#   attention, attention_sustained, attention_work   Attention: dense and packed, then the batch-1 sweep; at the
#                                                    power limit; D=64, each kernel family by the work per SM
#   train, nanogpt                                   GPT-2-small shape: ours beside a torch.nn GPT-2; beside
#                                                    nanoGPT's own bench.py (NANOGPT_DIR: a karpathy/nanoGPT checkout)
#   xl, xl_graphs, xl_memory                         2.7B shape beside the PyTorch-native peer; as one CUDA graph;
#                                                    with recomputation
#   adamw, varlen, hf, leaderboard                   Our AdamW; variable length; Hugging Face GPT-2; the 8B step
#   train_small, train_pack, train_graphs            train.py (needs data/shakespeare: data/prepare.py shakespeare)
#   sweep, sweep_compiled, suite                     timing sweeps; precision, compile, profile, memory, RMSNorm
#   tests_triton, tests_gluon, tests_model           the GPU tests, natively
#   muon                                             Muon against AdamW, steps to AdamW's final loss
set -u
cd "$(dirname "$0")/.." || exit 1
RUNNER=gpu/h200.sh
ALL_PARTS=(goals attention attention_sustained attention_work train nanogpt xl xl_graphs xl_memory adamw train_small
           train_pack train_graphs varlen hf leaderboard sweep sweep_compiled suite tests_triton tests_gluon
           tests_model muon)
source gpu/common.sh
LIMITS+=([goals]=530 [attention_sustained]=300 [attention_work]=400 [xl_memory]=400 [adamw]=120 [train_graphs]=400 [muon]=440)

GPT2=(model --size gpt2 --vocab_size 50304 --context_length 1024 --batch_size 12 --dtype bf16 --tie_embeddings
      --warmup 10 --steps 20)
XL=(model --size xl --context_length 2048 --batch_size 4 --compile blocks --dtype bf16 --warmup 2 --steps 5)
EIGHT_B=("$TORCHRUN" --standalone --nproc_per_node=1 bench.py model --size 8B --num_layers 4 --vocab_size 151936
         --context_length 32768 --batch_size 1 --dtype bf16 --attn flash --compile blocks --peer native --warmup 2
         --steps 5)
SWEEP=(model --sweep --context_length 256,512,1024 --dtype bf16,fp32 --mode fwd,fwd_bwd,train --warmup 1 --steps 2)

# goals: a group of steps per goal, most important first (GOALS=xl,hf: those alone), each step capped so that one
# slow step leaves time to the next; then the table from what finished (gpu/goals.py, stdlib only: python3)
GOALS_ALL=attention,nanogpt,train,xl,adamw,rmsnorm,leaderboard,hf GOALS=${GOALS:-}
part_goals() {
    local goal goals=${GOALS:-$GOALS_ALL}
    rm -f "$OUT/goals.md"
    for goal in ${goals//,/ }; do "goal_$goal"; done
    python3 gpu/goals.py "$P" "$PARTS/steps.txt" --machine "${GPUS:-no GPU seen by nvidia-smi}" --commit "$COMMIT" \
        --versions "$VERSIONS" >"$OUT/goals.md"
    cat "$OUT/goals.md" >>"$P.md"
}
skip() {  # skip STEP WHY: a step that cannot run, said in the part's .md and steps.txt
    printf '\n**%s: not run, %s.**\n' "$1" "$2" >>"$P.md"
    echo "$PART_NAME/$1: not run ($2)" | tee -a "$PARTS/steps.txt"
}
goal_attention() {  # then the same code again, ours and cuDNN only: the noise
    run_md attention 170 "$PY" bench.py attention --parts anchors,varlen --methods ours,sdpa-cudnn,flex --rep 25 \
        --json @JSON@
    run_md attention_2 70 "$PY" bench.py attention --parts anchors --methods ours,sdpa-cudnn --rep 25 --json @JSON@
}
goal_nanogpt() {  # nanoGPT's own bench.py, then ours (its tokens/s the reference: a ratio in ours's table too)
    local ref=""
    if [ -f "${NANOGPT_DIR:-}/bench.py" ]; then
        run_log nanogpt 110 "$PY" gpu/nanogpt_peer.py "$NANOGPT_DIR"
        grep '^nanoGPT: ' "$P.log" >>"$P.md"
        ref=$(sed -n 's|^nanoGPT tokens/s \([0-9]*\)$|\1|p' "$P.log")
    else
        skip nanogpt "NANOGPT_DIR names no nanoGPT checkout"
    fi
    run_md gpt2 100 "$PY" bench.py "${GPT2[@]}" --attn flash --compile model --cuda_graphs \
        ${ref:+--reference_tokens_per_s "$ref"} --json @JSON@
}
goal_train() {  # train.py's loop (data, logging, evaluation), then the bare step at its micro-batch's shape
    local vocab
    if [ ! -f data/shakespeare/meta.json ]; then
        skip train_small "data/shakespeare is missing: run \`python data/prepare.py shakespeare\` and carry it"
        return
    fi
    train_runs "train_small 1"
    vocab=$(python3 -c 'import json; print(json.load(open("data/shakespeare/meta.json"))["vocab_size"])')
    run_md bare_small 80 "$PY" bench.py model --size small --vocab_size "${vocab:-2048}" --context_length 1024 \
        --batch_size 16 --dtype bf16 --attn sdpa --compile model --warmup 5 --steps 20 --json @JSON@
}
goal_xl() { run_md xl 200 "$PY" bench.py "${XL[@]}" --attn flash --peer native --json @JSON@; }
goal_adamw() { run_md adamw 60 "$PY" bench.py adamw --json @JSON@; }
goal_rmsnorm() { run_md rmsnorm 45 "$PY" bench.py rmsnorm --shapes 32768x4096 --methods ours,inductor,copy \
    --json @JSON@; }
goal_leaderboard() { run_md leaderboard 150 "${EIGHT_B[@]}" --json @JSON@; }
goal_hf() { run_md hf 130 "$PY" bench.py hf --strategies sdpa:pad,sdpa:pad:compiled,ours:pack:compiled --warmup 2 \
    --steps 5 --json @JSON@; }

part_attention() { run_md attention 560 "$PY" bench.py attention --rep 25 --methods ours,ours-triton,sdpa-cudnn,flex \
    --time_budget 400 --json @JSON@; }
part_attention_sustained() {  # two rounds: a difference that does not hold in both is noise
    local round; for round in 1 2; do run_md "attention_sustained_$round" 140 "$PY" bench.py attention \
        --parts sustained --methods ours,sdpa-cudnn,flex --sustain 1 --json @JSON@; done; }
part_attention_work() { run_md attention_work 390 "$PY" bench.py attention --parts work --rep 25 --json @JSON@; }
part_train() {
    run_md gpt2 250 "$PY" bench.py "${GPT2[@]}" --attn sdpa,flash --compile model --peer gpt2 --json @JSON@
    run_md gpt2_graphs 150 "$PY" bench.py "${GPT2[@]}" --attn flash --compile graphs --json @JSON@
    run_md gpt2_step_graph 150 "$PY" bench.py "${GPT2[@]}" --attn flash --compile model --cuda_graphs --json @JSON@
}
part_nanogpt() {
    # nanoGPT's own bench.py, then ours with its tokens/s as the reference, twice over: ratio and peaks in one call
    if [ ! -f "${NANOGPT_DIR:-}/bench.py" ]; then
        printf '\n**nanogpt: not run, NANOGPT_DIR names no nanoGPT checkout.**\n' | tee -a "$P.md"
        return 1
    fi
    local round ref
    for round in 1 2; do
        run_log "nanogpt_$round" 150 "$PY" gpu/nanogpt_peer.py "$NANOGPT_DIR"
        grep '^nanoGPT: ' "$P.log" | tail -n 1 >>"$P.md"
        ref=$(sed -n 's|^nanoGPT tokens/s \([0-9]*\)$|\1|p' "$P.log" | tail -n 1)
        [ -n "$ref" ] || return 1
        run_md "gpt2_$round" 200 "$PY" bench.py "${GPT2[@]}" --attn flash --compile model --cuda_graphs --peer gpt2 \
            --reference_tokens_per_s "$ref" --json @JSON@
    done
}
part_xl() {
    run_md xl_flash_peer 300 "$PY" bench.py "${XL[@]}" --attn flash --peer native --json @JSON@
    run_md xl_sdpa 180 "$PY" bench.py "${XL[@]}" --attn sdpa --json @JSON@
}
part_xl_graphs() {
    run_md xl_graph_peer 330 "$PY" bench.py "${XL[@]}" --warmup 3 --attn flash --peer native --cuda_graphs \
        --json @JSON@
    run_md xl_eager_peer 240 "$PY" bench.py "${XL[@]}" --attn flash --peer native --json @JSON@
}
part_xl_memory() {
    run_md xl_selective 180 "$PY" bench.py "${XL[@]}" --attn flash --selective_recompute --json @JSON@
    run_md xl_selective_full8 180 "$PY" bench.py "${XL[@]}" --attn flash --selective_recompute --act_ckpt_every 1 \
        --act_ckpt_layers 8 --json @JSON@
}
part_adamw() { run_md adamw 110 "$PY" bench.py adamw --json @JSON@; }
part_train_small() { train_runs "1gpu 1" "flash 1 --attn_impl=flash" "graphs 1 --cuda_graphs=True"; }
part_train_graphs() { TRAIN_CONFIG= train_runs "compiled 1 --device=cuda --compile=True" \
    "graphs 1 --device=cuda --compile=True --cuda_graphs=True"; }
part_train_pack() { train_runs "pack 1 --batching=pack" "pack_static 1 --batching=pack --pack_static=True" \
    "pack_graphs 1 --batching=pack --pack_static=True --cuda_graphs=True"; }
part_varlen() {
    run_md varlen 430 "$PY" bench.py varlen --json @JSON@ --plot @PNG@
    run_md varlen_attention 120 "$PY" bench.py attention --parts varlen --methods \
        ours,flex,sdpa-pad,sdpa-dynamic,fa2-varlen --rep 25 --json @JSON@
}
part_hf() { run_md hf 560 "$PY" bench.py hf --json @JSON@ --plot @PNG@; }
# 4 layers fit one GPU without recomputation (the 34-layer run on two GPUs needs it: gpu/h200x2.sh)
part_leaderboard() { run_md leaderboard 560 "${EIGHT_B[@]}" --json @JSON@; }
part_sweep() { run_md sweep 560 "$PY" bench.py "${SWEEP[@]}" --size small,medium,large,gpt2-xl,xl,10B --compile none \
    --time_budget @BUDGET@ --json @JSON@ --plot @PNG@; }
part_sweep_compiled() { run_md sweep_compiled 560 "$PY" bench.py "${SWEEP[@]}" --size small,medium,large,gpt2-xl,xl \
    --compile blocks --time_budget @BUDGET@ --json @JSON@ --plot @PNG@; }
part_suite() {
    run_md precision 90 "$PY" bench.py model --size small,medium --context_length 512 --dtype fp32,bf16 \
        --mode fwd,fwd_bwd,train --compare dtype --warmup 2 --steps 3 --json @JSON@ --plot @PNG@
    run_md compile 150 "$PY" bench.py model --size small --context_length 512 --mode fwd,train --compile none,model \
        --compare compile --warmup 2 --steps 5 --json @JSON@
    run_md compile_attention 60 "$PY" bench.py attention --parts compile --json @JSON@
    run_md profile_small 120 "$PY" bench.py model --size small --context_length 512 --warmup 3 --steps 2 \
        --profile @P@-small_trace.json --json @JSON@
    run_md memory_xl 120 "$PY" bench.py model --size xl --context_length 512 --warmup 1 --steps 1 \
        --memory_snapshot @P@-xl_snapshot.pickle --json @JSON@
    run_md rmsnorm 60 "$PY" bench.py rmsnorm --json @JSON@
}

# Muon against AdamW on config/small.py's 300 steps, evaluated every 25: the step at which each Muon run first
# reaches AdamW's final validation loss, and its ms/step against AdamW's (medians of the logged steps after 40)
MUON_RUNS=("adamw" "muon_lr0.02 --optimizer=muon --muon_lr=0.02" "muon_lr0.05 --optimizer=muon --muon_lr=0.05"
           "muon_lr0.01 --optimizer=muon --muon_lr=0.01")
part_muon() {
    local tmp spec
    tmp=$(mktemp -d)
    for spec in "${MUON_RUNS[@]}"; do
        set -- $spec
        run_log "$1" 150 "$TORCHRUN" --standalone --nproc_per_node=1 train.py config/small.py --eval_interval=25 \
            --save_interval=100000 --out_dir="$tmp/$1" "${@:2}"
        cp "$tmp/$1/log.jsonl" "$P.$1.jsonl" 2>/dev/null
    done
    rm -rf "$tmp"
    "$PY" - "$P" "${MUON_RUNS[@]%% *}" >>"$P.md" <<'PYEOF'
import json, os, statistics, sys
prefix, names = sys.argv[1], sys.argv[2:]
def read(name):
    path = f"{prefix}.{name}.jsonl"
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []
def val(log):
    return [(r["step"], r["val_loss"]) for r in log if "val_loss" in r]
def ms(log):
    late = [r["ms_per_step"] for r in log if "ms_per_step" in r and r["step"] > 40]
    return statistics.median(late) if late else None
base = read(names[0])
target = val(base)[-1] if val(base) else None
print("`train.py config/small.py --eval_interval=25` on one GPU, 300 steps of 64k tokens, same seed.")
print(f"AdamW's final validation loss: {target[1]:.4f} at step {target[0]}.\n" if target else "AdamW gave no result.\n")
print("| run | final val loss | first step at AdamW's final val loss | of AdamW's steps | ms/step | vs AdamW |")
print("|---|---|---|---|---|---|")
for name in names:
    log = read(name)
    vals = val(log)
    if not vals or target is None:
        print(f"| {name} | (no result) | | | | |")
        continue
    first = next((s for s, v in vals if v <= target[1]), None)
    share = f"{first / target[0]:.0%}" if first else "not reached"
    step_ms, base_ms = ms(log), ms(base)
    speed = f"{step_ms / base_ms:.3f}x" if step_ms and base_ms else "-"
    print(f"| {name} | {vals[-1][1]:.4f} | {first or '-'} | {share} | {step_ms or 0:.1f} | {speed} |")
PYEOF
}

# The GPU tests in three parts: tests_part WORDS... runs the tests whose names hold a word (test_all.py's rule)
tests_part() {
    run_log "$PART_NAME" 560 "$PY" test_all.py "$@"
    { echo '```'; grep -E '^(ok|FAIL|SKIP) |^failed: |passed, [0-9]+ failed|s in all$' "$P.log"; echo '```'; } >>"$P.md"
}
part_tests_triton() { tests_part flash_reference flash_triton flash_delta flash_compiles flash_rejects \
    flash_kernels_take adamw; }
part_tests_gluon() { tests_part 'flash_gpu_kernels_match_reference[gluon]'; }
part_tests_model() { tests_part 'flash_gpu_kernels_match_reference[triton]' flash_gpu_gluon_compiles flash_d64 \
    flash_gpu_mixed rms_norm attention_impls_match gpu_flash_model gpu_whole_step gpu_cuda_graphs \
    gpu_bench triton_norm_block loss_curves; }

for goal in ${GOALS//,/ }; do
    declare -F "goal_$goal" >/dev/null || { echo "unknown goal '$goal'; the goals: $GOALS_ALL" >&2; exit 2; }
done
run_parts
if [[ ,${PART:-all}, == *,goals,* && -f $OUT/goals.md ]]; then  # last, where a device call's output ends
    cat "$OUT/goals.md"
fi
