#!/usr/bin/env bash
# bench.py's measurements for BENCHMARKS.md on one H200, in ONE device call of at most ~9 minutes.
#
#     bash gpu/h200_bench.sh                   # call 1: every measurement, most important first
#     PART=compiled bash gpu/h200_bench.sh     # optional call 2: the compiled (per-block) sweep, every size
#
# Run from the repository root. Steps, in order of priority: gpt2 (issue 3 §6), varlen (issue 7 §4), the eager
# sweep (every size x context 256/512/1024 x fp32/bf16 x fwd/fwd_bwd/train, peak memory), the --profile breakdown
# of the small model, the memory snapshot of xl, precision, compile, then the compiled sweep with whatever time is
# left. Each step runs under `timeout` with what remains of a BUDGET_S deadline (default 530 s); the sweeps write
# their JSON after every row and stop starting rows at --time_budget, so a step that is cut keeps what it finished.
#
# What comes back under $OUT (the device returns at most 8 files):
#   BENCH.md               every step's Markdown (command, date, device, tables), appended as each step ends
#   results.tar.gz         every step's JSON, PNG and stderr log (progress lines, errors), plus steps.txt
#   small_trace.json.gz    Chrome trace of the profiled small-model steps (chrome://tracing, ui.perfetto.dev)
#   xl_snapshot.pickle.gz  memory snapshot of the xl train step (gunzip, then pytorch.org/memory_viz)
set -u
PY=${PYTHON:-python3}
OUT=${OUT:-bench_out}
PART=${PART:-all}
mkdir -p "$OUT"
WORK=$(mktemp -d)
START=$(date +%s)
DEADLINE=$((START + ${BUDGET_S:-530}))
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # sweeps free and re-grow memory; avoid fragmentation OOMs
[ -f bench.py ] || { echo "run from the repository root (bench.py not found)"; exit 1; }
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" | tee "$WORK/steps.txt"

# step NAME MAX_S SUBCOMMAND ARGS...: runs bench.py under timeout (MAX_S, cut to the time left before the
# deadline less 20 s for packing); @BUDGET@ in ARGS becomes MAX_S - 45 (a sweep's --time_budget: room for the last
# configuration it starts); @W@ becomes the work folder. Markdown -> NAME.md (appended to BENCH.md), JSON ->
# NAME.json, stderr -> NAME.log.
step() {
    local name=$1 max=$2
    shift 2
    local left=$((DEADLINE - $(date +%s) - 20))
    ((max > left)) && max=$left
    if ((max < 30)); then
        echo "$name: skipped, deadline reached" | tee -a "$WORK/steps.txt"
        return
    fi
    local args=() a
    for a in "$@"; do
        a=${a//@BUDGET@/$((max - 45))}
        args+=("${a//@W@/$WORK}")
    done
    local t0=$(date +%s)
    echo "== $name (at most ${max}s): bench.py ${args[*]}"
    timeout -k 10 "$max" "$PY" bench.py "${args[@]}" --json "$WORK/$name.json" >"$WORK/$name.md" 2>"$WORK/$name.log"
    local rc=$?
    cat "$WORK/$name.md" >>"$OUT/BENCH.md"
    ((rc != 0)) && { echo "**$name: exit status $rc (124: cut by the deadline); last log lines:**"; echo '```';
                     tail -n 5 "$WORK/$name.log"; echo '```'; } >>"$OUT/BENCH.md"
    echo "$name: exit $rc after $(($(date +%s) - t0)) s (elapsed $(($(date +%s) - START)) s)" | tee -a "$WORK/steps.txt"
}

SIZES=small,medium,large,gpt2-xl,xl,10B
SWEEP=(model --sweep --context_lengths 256,512,1024 --dtypes bf16,fp32 --modes fwd,fwd_bwd,train --warmup 1 --steps 2)

# ONLY=name,name,... runs just those steps (e.g. to spread them over several GPUs of one machine); default: all.
want() { [ -z "${ONLY:-}" ] || [[ ",$ONLY," == *",$1,"* ]]; }
if [ "$PART" = all ]; then
    want gpt2 && step gpt2 320 gpt2 --warmup 6 --steps 15 --plot @W@/gpt2.png
    want varlen && step varlen 90 varlen --plot @W@/varlen.png
    want sweep_eager && step sweep_eager 150 "${SWEEP[@]}" --sizes $SIZES --compile_options none \
        --time_budget @BUDGET@ --plot @W@/sweep_eager.png
    want profile_small && step profile_small 60 model --size small --context_length 512 --mode train --warmup 3 \
        --steps 2 --profile @W@/small_trace.json
    want memory_xl && step memory_xl 60 model --size xl --context_length 512 --mode train --warmup 1 --steps 1 \
        --memory_snapshot @W@/xl_snapshot.pickle
    want precision && step precision 45 precision --sizes small,medium --context_length 512 --warmup 2 --steps 3 \
        --plot @W@/precision.png
    want compile && step compile 100 compile --sizes small --modes fwd,train --attn_d 16,64,128 \
        --attn_T 256,1024,4096,16384 --warmup 2 --steps 5 --plot @W@/compile.png
    want sweep_compiled && step sweep_compiled 600 "${SWEEP[@]}" --sizes small,medium --compile_options blocks \
        --time_budget @BUDGET@ --plot @W@/sweep_compiled.png
    want attention && step attention 420 attention --rep 30 --time_budget @BUDGET@ --plot @W@/attention.png
elif [ "$PART" = compiled ]; then
    step sweep_compiled 600 "${SWEEP[@]}" --sizes small,medium,large,gpt2-xl,xl --compile_options blocks \
        --time_budget @BUDGET@ --plot @W@/sweep_compiled.png
else
    echo "PART must be all or compiled, got $PART"
    exit 1
fi

for f in small_trace.json xl_snapshot.pickle; do
    [ -f "$WORK/$f" ] && gzip -c "$WORK/$f" >"$OUT/$f.gz" && rm "$WORK/$f"
done
tar -czf "$OUT/results.tar.gz" -C "$WORK" .
ls -la "$OUT"
cat "$WORK/steps.txt"
