# Helpers of gpu/h200.sh and gpu/h200x2.sh (sourced). A runner defines part_NAME functions running their steps
# (run_md / run_log) within LIMITS[NAME] seconds (570 unless set); run_parts runs the parts PART names (all: every
# part), after each rewriting $OUT/BENCH.md (every part's Markdown) and $OUT/results.tar.gz (per part NAME.md, the
# steps' JSON, PNG and logs, steps.txt): a cut run keeps what finished. Large artifacts (a trace, a memory snapshot)
# are gzipped beside them as $OUT/NAME-*.gz; $OUT/parts goes at the end (a device call returns few files; KEEP_PARTS=1).

PY=${PYTHON:-python3}
TORCHRUN=${TORCHRUN:-torchrun}
OUT=${OUT:-bench_out}
PARTS="$OUT/parts"
declare -A LIMITS=()
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # sweeps free and re-grow memory: no fragmentation OOMs
[ -f bench.py ] || { echo "run this from the repository root (bench.py not found)" >&2; exit 1; }
mkdir -p "$PARTS"

VERSIONS=$("$PY" -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")')
COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null) &&
    { git diff --quiet HEAD || COMMIT+=", with uncommitted changes"; }
COMMIT=${COMMIT:-${GIT_COMMIT:-"unknown (no git checkout: pass GIT_COMMIT=<commit>)"}}
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | sed 's/^ *\([0-9]*\) /\1 x /' |
       paste -sd, -)

# begin_part NAME LIMIT_S (run_parts calls it): a part whose steps all end within LIMIT_S seconds (PART_LIMIT_S
# overrides it); a rerun into the same $OUT replaces its files.
begin_part() {
    PART_NAME=$1 PART_PNG="" P="$PARTS/$1"
    local limit=${PART_LIMIT_S:-$2}
    PART_END=$(($(date +%s) + limit))
    rm -f "$P".* "$P"-*
    printf '# %s (`PART=%s bash %s`)\n\n- machine: %s\n- date: %s\n- %s\n- git commit: %s\n\n' "$1" "$1" "$RUNNER" \
        "${GPUS:-no GPU seen by nvidia-smi}" "$(date -u '+%Y-%m-%d %H:%M UTC')" "$VERSIONS" "$COMMIT" >"$P.md"
    : >"$P.log"
    echo "== part $PART_NAME (at most $limit s)"
}

# run_md STEP MAX_S COMMAND...: COMMAND under `timeout` (MAX_S, less when the part's time runs out), its stdout
# (bench.py's Markdown) into the part's .md, its stderr into the .log. In COMMAND, @JSON@ and @PNG@ become the step's
# JSON and PNG paths, @P@ the part's path prefix (for extra files: @P@-trace.json), @BUDGET@ MAX_S - 60 (a sweep's
# --time_budget: room for the last row it starts). A step that fails adds its status and last log lines to the .md.
run_md() { _run md "$@"; }
# run_log STEP MAX_S COMMAND...: the same with stdout and stderr both into the .log (train.py, test_all.py).
run_log() { _run log "$@"; }

_run() {
    local how=$1 step=$2 max=$3 left=$((PART_END - $(date +%s))) args=() a t0 rc
    shift 3
    ((max > left)) && max=$left
    if ((max < 20)); then
        printf '\n**%s: not run, the part reached its time limit.**\n' "$step" >>"$P.md"
        echo "$PART_NAME/$step: not run (part time limit)" >>"$PARTS/steps.txt"
        return 1
    fi
    local json="$P.$step.json" png="$P.$step.png" budget=$((max > 120 ? max - 60 : max / 2))
    [ -z "$PART_PNG" ] && png="$P.png"
    for a in "$@"; do
        [[ $a == *@PNG@* ]] && PART_PNG=$png
        a=${a//@JSON@/$json} a=${a//@PNG@/$png} a=${a//@P@/$P}
        args+=("${a//@BUDGET@/$budget}")
    done
    echo "-- $step (at most $max s): ${args[*]}" | tee -a "$P.log"
    t0=$(date +%s)
    timeout -k 10 "$max" "${args[@]}" >>"$P.$how" 2>>"$P.log"
    rc=$?
    echo "$PART_NAME/$step: exit $rc after $(($(date +%s) - t0)) s" | tee -a "$PARTS/steps.txt"
    if ((rc != 0)); then
        { printf '\n**%s: exit status %s%s. Last lines of %s.log:**\n\n```\n' "$step" "$rc" \
              "$( ((rc == 124 || rc == 137)) && echo ', cut by its time limit')" "$PART_NAME"
          tail -n 8 "$P.log"
          printf '```\n'; } >>"$P.md"
    fi
    [ "$how" = md ] && echo >>"$P.md"
    return $rc
}

run_parts() {
    local want=${PART:-all} name f
    [ "$want" = all ] && want=$(IFS=,; echo "${ALL_PARTS[*]}")
    for name in ${want//,/ }; do
        [[ " ${ALL_PARTS[*]} " == *" $name "* ]] || { echo "unknown part '$name'; the parts: all ${ALL_PARTS[*]}" >&2
                                                       exit 2; }
    done
    for name in ${want//,/ }; do
        begin_part "$name" "${LIMITS[$name]:-570}"
        "part_$name"
        for f in "$P"-*; do  # large artifacts gzipped outside the tarball
            [ -f "$f" ] && gzip -c "$f" >"$OUT/$(basename "$f").gz" && rm -f "$f"
        done
        : >"$OUT/BENCH.md"
        for f in "${ALL_PARTS[@]}"; do
            [ -f "$PARTS/$f.md" ] && { cat "$PARTS/$f.md"; echo; } >>"$OUT/BENCH.md"
        done
        tar -czf "$OUT/results.tar.gz" -C "$PARTS" .
    done
    cat "$PARTS/steps.txt" 2>/dev/null
    [ "${KEEP_PARTS:-0}" = 1 ] || rm -rf "$PARTS"
    ls -la "$OUT"
}

# train_runs "NAME NPROC [train.py options]"...: one `torchrun train.py config/small.py --max_iters=150` per
# argument, then a Markdown table of them (medians of the logged steps after step 40; scaling against the first run)
# in the part's .md and .json. Needs data/shakespeare. TRAIN_CONFIG=FILE: another config (empty: train.py's defaults).
train_runs() {
    if [ ! -f data/shakespeare/meta.json ]; then
        printf '**data/shakespeare is missing: run `python data/prepare.py shakespeare` and carry it.**\n' >>"$P.md"
        return 1
    fi
    local tmp spec names=() config=${TRAIN_CONFIG-config/small.py}
    tmp=$(mktemp -d)  # the runs' out_dirs: their checkpoints stay out of the results
    for spec in "$@"; do
        set -- $spec
        names+=("$1:$2")
        run_log "$1" 185 "$TORCHRUN" --standalone --nproc_per_node="$2" train.py $config --max_iters=150 \
            --save_interval=100000 --out_dir="$tmp/$1" "${@:3}"
        cp "$tmp/$1/log.jsonl" "$P.$1.jsonl" 2>/dev/null
        cp "$tmp/$1/loss.png" "$P.$1.png" 2>/dev/null
    done
    rm -rf "$tmp"
    "$PY" - "$P" "$config" "${names[@]}" >>"$P.md" <<'PYEOF'
import json, os, statistics, sys
prefix, config, runs = sys.argv[1], sys.argv[2], [r.split(":") for r in sys.argv[3:]]
command = " ".join(filter(None, ["train.py", config, "--max_iters=150"]))
shape = ("(12 layers, d_model 768, context 1024, 64k tokens per step at any world size, vocab 2048, bf16, compiled; "
         "attention as the config says unless the run names another)" if config == "config/small.py"
         else "with each run's options")
print(f"`{command}` under torchrun {shape}. Medians of the logged steps after step 40; per GPU vs the first run: "
      f"tokens/s per GPU over the first run's.\n")
print("| run | GPUs | tokens/s | ms/step | MFU | per GPU vs the first run | final val loss | last train loss |")
print("|---|---|---|---|---|---|---|---|")
rows, fmt = [], lambda x: "-" if x is None else f"{x:.3f}"
for name, gpus in runs:
    path = f"{prefix}.{name}.jsonl"
    log = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    steps = [r for r in log if "tokens_per_s" in r]
    late = [r for r in steps if r["step"] > 40] or steps
    if not late:
        print(f"| {name} | {gpus} | (no logged steps) | | | | | |")
        continue
    med = lambda key: statistics.median_high(r.get(key) or 0 for r in late)
    val = [r["val_loss"] for r in log if "val_loss" in r]
    rows.append(dict(run=name, gpus=int(gpus), tokens_per_s=med("tokens_per_s"), ms_per_step=med("ms_per_step"),
                     mfu=med("mfu"), final_val_loss=val[-1] if val else None, last_train_loss=steps[-1].get("loss")))
    r = rows[-1]
    r["scaling"] = r["tokens_per_s"] / r["gpus"] / (rows[0]["tokens_per_s"] / rows[0]["gpus"])
    print(f"| {name} | {gpus} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | {100 * r['mfu']:.1f}% | "
          f"{r['scaling']:.1%} | {fmt(r['final_val_loss'])} | {fmt(r['last_train_loss'])} |")
json.dump(dict(command=command, rows=rows), open(prefix + ".json", "w"), indent=1)
PYEOF
}
