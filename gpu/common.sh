# Helpers shared by gpu/h200.sh and gpu/h200x2.sh. Sourced by them, not run on its own.
#
# A runner defines one function per part, part_NAME, which calls begin_part NAME LIMIT_S and then its steps
# (run_md / run_log). run_parts then runs the parts PART names, and after every part rewrites
#   $OUT/BENCH.md          every part's Markdown, one after the other
#   $OUT/results.tar.gz    everything under $OUT/parts: per part NAME.md, NAME.json, NAME.png, NAME.log, steps.txt
# so a run that is cut keeps what the parts before it finished. Large artifacts (a profiler trace, a memory
# snapshot) are gzipped next to them as $OUT/NAME-*.gz instead of going into the tarball.
# $OUT/parts is removed at the end (the device returns at most 8 files); KEEP_PARTS=1 keeps it.

PY=${PYTHON:-python3}
TORCHRUN=${TORCHRUN:-torchrun}
OUT=${OUT:-bench_out}
PARTS="$OUT/parts"

export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # sweeps free and re-grow memory; avoids fragmentation OOMs

[ -f bench.py ] || { echo "run this from the repository root (bench.py not found)" >&2; exit 1; }
mkdir -p "$PARTS"

# Versions and commit, read once: every part's .md starts with them.
VERSIONS=$("$PY" - <<'EOF'
import importlib
out = []
for name in ("torch", "triton", "transformers"):
    try:
        out.append(f"{name} {importlib.import_module(name).__version__}")
    except Exception:
        out.append(f"{name} not installed")
print(", ".join(out))
EOF
)
if COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null); then
    git diff --quiet HEAD 2>/dev/null || COMMIT="$COMMIT, with uncommitted changes"
else
    COMMIT=${GIT_COMMIT:-"unknown (no git checkout here: pass GIT_COMMIT=<commit>)"}
fi
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c |
       sed 's/^ *\([0-9]*\) \(.*\)$/\1 x \2/' | paste -sd, -)
GPUS=${GPUS:-"no GPU seen by nvidia-smi"}

header() {
    cat <<EOF
# $PART_NAME (\`PART=$PART_NAME bash $RUNNER\`)

- machine: $GPUS
- date: $(date -u '+%Y-%m-%d %H:%M UTC')
- $VERSIONS
- git commit: $COMMIT

EOF
}

# begin_part NAME LIMIT_S: starts part NAME, whose steps must all end within LIMIT_S seconds (PART_LIMIT_S
# overrides it). A rerun into the same $OUT replaces the part's files.
begin_part() {
    PART_NAME=$1
    local limit=${PART_LIMIT_S:-$2}
    PART_END=$(($(date +%s) + limit))
    PART_PNG=""
    P="$PARTS/$PART_NAME"
    rm -f "$P".* "$P"-*
    header >"$P.md"
    : >"$P.log"
    echo "== part $PART_NAME (at most $limit s)"
}

# run_md STEP MAX_S COMMAND...: runs COMMAND under `timeout` (MAX_S, less when the part's time runs out); its stdout
# (bench.py's Markdown) goes to the part's .md, its stderr to the part's .log. In COMMAND, @JSON@ and @PNG@ become
# the step's JSON and PNG paths (NAME.json when the step is named like its part, NAME.png for the part's first plot),
# @P@ the part's path prefix (for extra files: @P@-trace.json) and @BUDGET@ MAX_S - 60 (for a sweep's
# --time_budget: room for the last row it starts). A step that fails or is cut adds its status and the log's last
# lines to the .md.
run_md() { _run md "$@"; }

# run_log STEP MAX_S COMMAND...: the same, with stdout and stderr both to the part's .log (train.py, test_all.py);
# the part writes its own Markdown from it.
run_log() { _run log "$@"; }

_run() {
    local how=$1 step=$2 max=$3
    shift 3
    local left=$((PART_END - $(date +%s)))
    ((max > left)) && max=$left
    if ((max < 20)); then
        printf '\n**%s: not run, the part reached its time limit.**\n' "$step" >>"$P.md"
        echo "$PART_NAME/$step: not run (part time limit)" >>"$PARTS/steps.txt"
        return 1
    fi
    local json="$P.$step.json" png="$P.$step.png" budget=$((max > 120 ? max - 60 : max / 2))
    [ "$step" = "$PART_NAME" ] && json="$P.json"
    [ -z "$PART_PNG" ] && png="$P.png"
    local args=() a
    for a in "$@"; do
        [[ $a == *@PNG@* ]] && PART_PNG=$png
        a=${a//@JSON@/$json}
        a=${a//@PNG@/$png}
        a=${a//@P@/$P}
        args+=("${a//@BUDGET@/$budget}")
    done
    echo "-- $step (at most $max s): ${args[*]}" | tee -a "$P.log"
    local t0 rc
    t0=$(date +%s)
    if [ "$how" = md ]; then
        timeout -k 10 "$max" "${args[@]}" >>"$P.md" 2>>"$P.log"
    else
        timeout -k 10 "$max" "${args[@]}" >>"$P.log" 2>&1
    fi
    rc=$?
    local took=$(($(date +%s) - t0))
    echo "$PART_NAME/$step: exit $rc after $took s" | tee -a "$PARTS/steps.txt"
    if ((rc != 0)); then
        local why=""
        ((rc == 124 || rc == 137)) && why=", cut by its time limit"
        { printf '\n**%s: exit status %s%s after %s s. Last lines of %s.log:**\n\n```\n' "$step" "$rc" "$why" \
              "$took" "$PART_NAME"
          tail -n 8 "$P.log"
          printf '```\n'; } >>"$P.md"
    fi
    [ "$how" = md ] && echo >>"$P.md"
    return $rc
}

# end_part: several steps' JSON files become one NAME.json keyed by step; large artifacts are gzipped into $OUT.
end_part() {
    if compgen -G "$P.*.json" >/dev/null; then
        "$PY" - "$P" <<'EOF'
import glob, json, os, sys
prefix = sys.argv[1]
merged = {}
if os.path.exists(prefix + ".json"):  # a step named like its part, beside others
    merged[os.path.basename(prefix)] = json.load(open(prefix + ".json"))
for path in sorted(glob.glob(prefix + ".*.json")):
    step = path[len(prefix) + 1:-len(".json")]
    try:
        merged[step] = json.load(open(path))
    except (OSError, ValueError) as e:
        merged[step] = {"error": f"unreadable: {e}"}
    os.remove(path)
with open(prefix + ".json", "w") as f:
    json.dump(merged, f, indent=1)
EOF
    fi
    local f gz
    for f in "$P"-*; do
        [ -f "$f" ] || continue
        gz="$OUT/$(basename "$f").gz"
        gzip -c "$f" >"$gz" && rm -f "$f"
        if (($(stat -c %s "$gz") > 16 * 1024 * 1024)); then
            echo "$(basename "$gz"): $(($(stat -c %s "$gz") >> 20)) MiB, over the 16 MiB a device call returns" \
                | tee -a "$PARTS/steps.txt"
        fi
    done
}

pack() {
    local name
    : >"$OUT/BENCH.md"
    for name in "${ALL_PARTS[@]}"; do
        [ -f "$PARTS/$name.md" ] && { cat "$PARTS/$name.md"; echo; } >>"$OUT/BENCH.md"
    done
    tar -czf "$OUT/results.tar.gz" -C "$PARTS" .
}

# run_parts: PART=all runs ALL_PARTS in order; PART=a,b runs those.
run_parts() {
    local want=${PART:-all} name
    [ "$want" = all ] && want=$(IFS=,; echo "${ALL_PARTS[*]}")
    for name in ${want//,/ }; do
        if [[ " ${ALL_PARTS[*]} " != *" $name "* ]]; then
            echo "unknown part '$name'; the parts are: all ${ALL_PARTS[*]}" >&2
            exit 2
        fi
    done
    for name in ${want//,/ }; do
        "part_$name"
        end_part
        pack
    done
    cat "$PARTS/steps.txt" 2>/dev/null
    [ "${KEEP_PARTS:-0}" = 1 ] || rm -rf "$PARTS"
    ls -la "$OUT"
}

# train_runs "NAME NPROC [train.py options]"...: one `torchrun train.py config/small.py --max_iters=150` per
# argument (each at most 185 s), then a Markdown table of them (tokens/s, ms/step, MFU: medians of the logged steps
# after step 40; scaling against the first run) in the part's .md and .json. Needs data/shakespeare.
# TRAIN_CONFIG=FILE runs another config file instead (TRAIN_CONFIG= : train.py's own defaults).
train_runs() {
    if [ ! -f data/shakespeare/meta.json ]; then
        printf '**data/shakespeare is missing: run `python data/prepare.py shakespeare` and carry it.**\n' >>"$P.md"
        return 1
    fi
    local tmp spec name nproc names=() config=${TRAIN_CONFIG-config/small.py}
    tmp=$(mktemp -d)  # each run's out_dir: its checkpoint (1.4 GB) stays out of the results
    for spec in "$@"; do
        set -- $spec
        name=$1
        nproc=$2
        shift 2
        names+=("$name:$nproc")
        run_log "$name" 185 "$TORCHRUN" --standalone --nproc_per_node="$nproc" train.py $config \
            --max_iters=150 --save_interval=100000 --out_dir="$tmp/$name" "$@"
        cp "$tmp/$name/log.jsonl" "$P.$name.jsonl" 2>/dev/null
        cp "$tmp/$name/loss.png" "$P.$name.png" 2>/dev/null
    done
    rm -rf "$tmp"
    "$PY" - "$P" "$config" "${names[@]}" >>"$P.md" <<'PYEOF'
import json, os, sys
prefix, config, runs = sys.argv[1], sys.argv[2], [r.split(":") for r in sys.argv[3:]]
command = " ".join(["train.py", config, "--max_iters=150"] if config else ["train.py", "--max_iters=150"])
shape = ("(12 layers, d_model 768, context 1024, 64k tokens per step at any world size, vocab 2048, bf16, compiled; "
         "attention as the config says (auto: sdpa) unless the run names another)" if config == "config/small.py"
         else "with each run's options")
print(f"`{command}` under torchrun {shape}. Medians of the logged steps after step 40; the first run's tokens/s per "
      f"GPU is the base of the last-but-two column.\n")
print("| run | GPUs | tokens/s | ms/step | MFU | per GPU vs the first run | final val loss | last train loss |")
print("|---|---|---|---|---|---|---|---|")
rows, base = [], None
fmt = lambda x, f: "-" if x is None else format(x, f)
for name, gpus in runs:
    gpus, path = int(gpus), f"{prefix}.{name}.jsonl"
    log = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    steps = [r for r in log if "tokens_per_s" in r]
    late = [r for r in steps if r["step"] > 40] or steps
    if not late:
        print(f"| {name} | {gpus} | (no logged steps) | | | | | |")
        continue
    med = lambda key: sorted((r.get(key) or 0) for r in late)[len(late) // 2]
    tok, ms, mfu = med("tokens_per_s"), med("ms_per_step"), med("mfu")
    if base is None:
        base = (tok, gpus)
    val = [r["val_loss"] for r in log if "val_loss" in r]
    row = dict(run=name, gpus=gpus, tokens_per_s=tok, ms_per_step=ms, mfu=mfu,
               scaling=tok / base[0] * base[1] / gpus, final_val_loss=val[-1] if val else None,
               last_train_loss=steps[-1].get("loss"))
    rows.append(row)
    print(f"| {name} | {gpus} | {tok:,.0f} | {ms:.1f} | {100 * mfu:.1f}% | {row['scaling']:.1%} | "
          f"{fmt(row['final_val_loss'], '.3f')} | {fmt(row['last_train_loss'], '.3f')} |")
with open(prefix + ".json", "w") as f:
    json.dump(dict(command=command, rows=rows), f, indent=1)
PYEOF
}
