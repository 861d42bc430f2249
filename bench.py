"""Benchmarks and profilers (SPEC §7): where the time and the memory of training go.

One script, one subcommand per question. Each prints Markdown on stdout (headed by the command, the date and the
device), writes its numbers to --json FILE, and draws --plot FILE.png when matplotlib is installed.

    python bench.py model --size small --context_length 512 --mode train --dtype bf16 --compile
    python bench.py model --sweep --sizes small,medium,large,xl --context_lengths 256,512,1024 \\
        --dtypes fp32,bf16 --modes fwd,fwd_bwd,train --compile_options none,blocks --json sweep.json --plot sweep.png
    nsys profile --trace=cuda,nvtx -o small python bench.py model --size small --nvtx   # NVTX ranges (README)
    python bench.py model --size small --profile trace.json      # top kernels per phase + a Chrome trace
    python bench.py model --size xl --memory_snapshot xl.pickle   # for pytorch.org/memory_viz
    python bench.py precision --sizes small,medium                # fp32 vs bf16 autocast + accumulation demo
    python bench.py compile --sizes small                         # eager vs torch.compile, model and attention
    python bench.py gpt2                                          # GPT-2-small training throughput vs a peer
    python bench.py varlen                                        # pad / dynamic_pad / pack on the same documents
    python bench.py attention                                     # our FlashAttention-2 vs SDPA backends, Flex, naive
    torchrun --nproc_per_node=2 bench.py allreduce                # all-reduce 1 MB .. 1 GB: ms, algbw, busbw
    torchrun --nproc_per_node=2 bench.py ddp --preset gpt2-xl     # our DDP / ZeRO-1 / FSDP vs torch's, one run

Every subcommand runs on CPU at tiny sizes (`--size tiny`, or the tiny defaults of varlen) and on CUDA.
Timing: warm-up steps, then timed steps with the device synchronized after every step (and every phase), mean and
standard deviation in ms (SPEC §7.1). Peak memory is the allocator's peak (torch.cuda.max_memory_allocated) per
phase; the CPU has no such counter, so CPU rows leave it empty.
"""
import argparse
import contextlib
import datetime
import gc
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
import timeit
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ddp
import flash
import model as model_py  # the module itself: --nvtx swaps its attention function for an annotated one
from flash import flash_attn_varlen
from model import ATTN_IMPLS, PRESETS, TransformerLM, count_params, cross_entropy, flops_per_token
from train import AdamW, pack_batch, pad_batch, sample_documents

SIZES = dict(PRESETS, tiny=dict(d_model=64, d_ff=192, num_layers=2, num_heads=4))  # tiny: CPU tests and smoke runs
MODES = ("fwd", "fwd_bwd", "train")
PHASES = ("forward", "backward", "optimizer_step")
DTYPES = ("fp32", "bf16")
COMPILE_CHOICES = ("none", "model", "blocks")  # see compiled()
H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H100/H200 SXM, the MFU denominator (../shared/ANCHORS.md)
NANOGPT_TOKENS_PER_S = 463e3  # nanoGPT GPT-2 124M on one H200 (../shared/ANCHORS.md)


# ---------------------------------------------------------------------------------------------------------------
# common: device, timing, output
# ---------------------------------------------------------------------------------------------------------------

def add_common_args(p, plot_help=None):
    """--device, --seed, --json and --plot, taken by every model-level subcommand."""
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png", help=plot_help)


def pick_device(name):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine")
    return device


def describe_device(device):
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def run_info(command, argv, device):
    """What every report starts with (STYLE: every table says the command, the date and the device)."""
    return dict(command="python bench.py " + " ".join([command] + list(argv)),
                date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), device=describe_device(device))


def print_header(title, info):
    print(f"## {title}\n\n`{info['command']}`  \n{info['date']} · {info['device']}\n", flush=True)


def fmt(x, digits=2):
    """Table cell: numbers rounded, None as a dash, strings (OOM, skipped) as they are."""
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if isinstance(x, float) and abs(x) >= 1000:
        return f"{x:,.0f}"
    if isinstance(x, float) and 0 < abs(x) < 0.1:
        return f"{x:.2g}"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_json(path, payload):
    """Atomic (temp file + os.replace), so a sweep that is killed part-way leaves the rows it finished."""
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def save_plot(path, draw):
    """draw(plt) -> figure. matplotlib is optional: without it say so and go on."""
    if not path:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return
    fig = draw(plt)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"plot written to {path}", file=sys.stderr)


def progress(done, total, t_start, text):
    """A line per finished configuration on stderr (stdout stays Markdown), with the rate and an ETA."""
    elapsed = timeit.default_timer() - t_start
    eta = elapsed / done * (total - done) if done else 0.0
    print(f"[{done}/{total}] {text} | {elapsed:.0f}s elapsed, ETA {eta:.0f}s", file=sys.stderr, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(dtype, device):
    """bf16 autocast around forward and loss (SPEC §3.7); fp32 runs with no context at all."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def mib(nbytes):
    return nbytes / 2**20


def millions(n):
    return "—" if n is None else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def csv_list(text, choices=None, cast=str):
    """'a,b,c' -> [a, b, c]; each item checked against choices, so a typo is an error naming it."""
    items = [cast(t) for t in text.split(",") if t]
    for item in items:
        if choices is not None and item not in choices:
            raise SystemExit(f"unknown value {item!r}: expected one of {', '.join(map(str, choices))}")
    return items


def is_oom(error):
    """The caching allocator raises torch.OutOfMemoryError; cuBLAS / cuDNN workspace allocations that fail surface
    as a plain RuntimeError saying so. Both mean "this configuration does not fit"."""
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


def failure(error):
    """The status of a row whose run raised: "OOM" when it did not fit, else "error" with the exception named on
    stderr (traceback included), so one failing configuration does not take the rest of a long run down."""
    if is_oom(error):
        return "OOM"
    print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
    traceback.print_exception(error, file=sys.stderr)
    return "error"


def allow_recompiles():
    """A sweep compiles one model under several shapes, dtypes and grad modes; the default limit of 8 compiled
    variants per function would silently fall back to eager for the rest."""
    torch._dynamo.config.cache_size_limit = 64


@contextlib.contextmanager
def nvtx_range(name, enabled):
    """An NVTX range for Nsight Systems (SPEC §7.2); push/pop are looked up at call time (the tests observe them)."""
    if not enabled:
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def check_nvtx():
    try:
        torch.cuda.nvtx.range_push("nvtx_check")
        torch.cuda.nvtx.range_pop()
    except RuntimeError as e:
        raise SystemExit(f"--nvtx needs a CUDA build of torch ({e}); use --profile for a per-phase breakdown "
                         f"that works everywhere")


def annotated_attention(q, k, v, mask=None):
    """model.scaled_dot_product_attention with an NVTX range around each of its three parts (SPEC §7.2): the
    same math (fp32 scores, masked_fill, model.softmax, cast back, P V); a test holds it to the original."""
    with nvtx_range("attention_scores", True):
        scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
    with nvtx_range("softmax", True):
        probs = model_py.softmax(scores, dim=-1)
    with nvtx_range("final_matmul", True):
        return probs.to(v.dtype) @ v


@contextlib.contextmanager
def annotated_naive_attention():
    """Swap the model module's attention function for the annotated one (naive attn_impl only), then restore."""
    original = model_py.scaled_dot_product_attention
    model_py.scaled_dot_product_attention = annotated_attention
    try:
        yield
    finally:
        model_py.scaled_dot_product_attention = original


class Phases:
    """Times the phases of a step (forward, backward, optimizer_step), synchronizing at the end of each, and on
    CUDA records each phase's peak allocated memory (the peak counter is reset when a phase starts). Optionally
    wraps every phase in an NVTX range (--nvtx) and a profiler range (--profile)."""

    def __init__(self, device, nvtx=False, profiling=False):
        self.device, self.nvtx, self.profiling = device, nvtx, profiling
        self.reset()

    def reset(self):
        self.ms = {p: [] for p in PHASES}
        self.peak = {p: None for p in PHASES}

    @contextlib.contextmanager
    def __call__(self, name):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        label = torch.profiler.record_function(name) if self.profiling else contextlib.nullcontext()
        t0 = timeit.default_timer()
        with nvtx_range(name, self.nvtx), label:
            yield
            sync(self.device)  # inside the ranges: the phase's kernels finish within its window
        self.ms[name].append((timeit.default_timer() - t0) * 1e3)
        if cuda:
            peak = mib(torch.cuda.max_memory_allocated(self.device))
            self.peak[name] = max(self.peak[name] or 0.0, peak)


def measure(step, warmup, steps, device, phases, nvtx=False, profiler=None, snapshot=None):
    """Run warmup untimed-for-the-mean steps, then `steps` timed ones, synchronizing after each (SPEC §7.1).
    The first warm-up step's time is kept: it shows the one-off costs (allocator growth, lazy optimizer state,
    cuBLAS heuristics, compilation). profiler: a torch.profiler.profile around the timed steps only; snapshot: a
    path to dump a CUDA memory-history snapshot of the timed steps to."""
    first_ms = None
    with nvtx_range("warmup", nvtx):
        for i in range(warmup):
            t0 = timeit.default_timer()
            step()
            sync(device)
            if i == 0:
                first_ms = (timeit.default_timer() - t0) * 1e3
    phases.reset()
    if snapshot:
        # Python frames only: symbolizing C++ frames at dump time can take minutes on a large model
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    times = []
    try:
        with profiler if profiler is not None else contextlib.nullcontext():
            for _ in range(steps):
                with nvtx_range("step", nvtx):
                    t0 = timeit.default_timer()
                    step()
                    sync(device)
                    times.append((timeit.default_timer() - t0) * 1e3)
        if snapshot:
            torch.cuda.memory._dump_snapshot(snapshot)
    finally:
        if snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
    peaks = [v for v in phases.peak.values() if v is not None]
    return dict(mean_ms=statistics.fmean(times), std_ms=statistics.stdev(times) if len(times) > 1 else 0.0,
                first_step_ms=first_ms,
                phase_ms={p: statistics.fmean(v) for p, v in phases.ms.items() if v},
                phase_peak_mib={p: v for p, v in phases.peak.items() if v is not None},
                peak_mib=max(peaks) if peaks else None)


# ---------------------------------------------------------------------------------------------------------------
# model: end-to-end step timing, sweep, NVTX, profiler, memory (SPEC §7.1-7.3)
# ---------------------------------------------------------------------------------------------------------------

def model_dims(size, args):
    """The preset's dims with any explicit --d_model / --d_ff / --num_layers / --num_heads on top."""
    dims = dict(SIZES[size])
    for key in dims:
        if getattr(args, key, None) is not None:
            dims[key] = getattr(args, key)
    return dims


def build_model(dims, vocab_size, context_length, attn, device):
    return TransformerLM(vocab_size, context_length, dims["d_model"], dims["num_layers"], dims["num_heads"],
                         dims["d_ff"], attn_impl=attn, device=device)


def compiled(net, how):
    """none: the model as it is; model: torch.compile(model) (SPEC §7.6); blocks: every TransformerBlock compiled in
    place (regional compilation: the blocks share one compiled code, so compile time does not grow with depth)."""
    if how == "model":
        return torch.compile(net)
    if how == "blocks":
        for layer in net.layers:
            layer.compile()
    return net


def random_batch(vocab_size, batch_size, context_length, device, generator):
    """Random tokens: inputs and next-token targets (B, T) int64 on the device."""
    seq = torch.randint(vocab_size, (batch_size, context_length + 1), generator=generator)
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def run_step(net, runner, optimizer, x, y, mode, dtype, phases):
    """One step of `mode`: fwd = inference forward and loss (no_grad); fwd_bwd adds backward; train adds the AdamW
    step. net owns the parameters, runner is net or its torch.compile wrapper."""
    if mode != "fwd":
        net.zero_grad(set_to_none=True)
    grad = torch.no_grad() if mode == "fwd" else contextlib.nullcontext()
    with phases("forward"), grad, autocast(dtype, x.device):
        loss = cross_entropy(runner(x), y)
    if mode == "fwd":
        return
    with phases("backward"):
        loss.backward()
    if mode == "train":
        with phases("optimizer_step"):
            optimizer.step()


def step_flops(dims, vocab_size, context_length, batch_size, mode, attn):
    """Model FLOPs of one step per SPEC §2.9: forward = flops_per_token / 3; naive attention computes every T^2
    score (counted in full), sdpa and flash skip the masked half (counted causal)."""
    per_token = flops_per_token(vocab_size, context_length, dims["d_model"], dims["num_layers"], dims["d_ff"],
                                causal=attn != "naive")
    return per_token / 3 * (1 if mode == "fwd" else 3) * batch_size * context_length


def run_config(net, runner, cfg, device, generator, warmup, steps, nvtx=False, profiler=None, snapshot=None):
    """Measure one configuration (cfg: size, dims, vocab_size, context_length, batch_size, dtype, compile, attn,
    mode) and return its row; out-of-memory becomes a row with status "OOM" (memory freed) instead of a crash."""
    row = dict(cfg, params=count_params(net), status="ok")
    x, y = random_batch(cfg["vocab_size"], cfg["batch_size"], cfg["context_length"], device, generator)
    optimizer = AdamW(net.parameters(), lr=1e-4) if cfg["mode"] == "train" else None
    phases = Phases(device, nvtx=nvtx, profiling=profiler is not None)
    step = lambda: run_step(net, runner, optimizer, x, y, cfg["mode"], cfg["dtype"], phases)
    try:
        row.update(measure(step, warmup, steps, device, phases, nvtx=nvtx, profiler=profiler, snapshot=snapshot))
    except Exception as e:
        row["status"] = failure(e)
    del optimizer, x, y, step
    net.zero_grad(set_to_none=True)
    free_memory(device)  # after the except block, so the traceback's frames no longer hold the step's tensors
    if row["status"] != "ok":
        return row
    tokens = cfg["batch_size"] * cfg["context_length"]
    row["tokens_per_s"] = tokens / (row["mean_ms"] / 1e3)
    flops = step_flops(cfg["dims"], cfg["vocab_size"], cfg["context_length"], cfg["batch_size"], cfg["mode"],
                       cfg["attn"])
    row["tflops"] = flops / (row["mean_ms"] / 1e3) / 1e12
    return row


def row_cells(row):
    if row["status"] != "ok":
        return [row["status"]] * 6
    phase = row["phase_ms"]
    split = " / ".join(fmt(phase.get(p)) for p in PHASES if p in phase)
    return [f"{row['mean_ms']:.2f} ± {row['std_ms']:.2f}", row["first_step_ms"], split, row["peak_mib"],
            row["tokens_per_s"], row["tflops"]]


def print_model_rows(rows):
    header = ["size", "params", "ctx", "batch", "dtype", "compile", "attn", "mode", "ms/step", "first step ms",
              "fwd / bwd / opt ms", "peak MiB", "tokens/s", "TFLOP/s"]
    body = [[r["size"], millions(r["params"]), r["context_length"], r["batch_size"], r["dtype"],
             r["compile"], r["attn"], r["mode"]] + row_cells(r) for r in rows]
    print(markdown_table(header, body))


def sweep_table(rows):
    """The SPEC §7 table: one line per size x context x dtype x compile, the modes side by side."""
    cell = {}
    for r in rows:
        key = (r["size"], r["context_length"], r["dtype"], r["compile"])
        cell.setdefault(key, {})[r["mode"]] = r
    header = ["size", "params", "ctx", "dtype", "compile", "fwd ms", "fwd+bwd ms", "train ms", "peak fwd MiB",
              "peak train MiB", "train tokens/s", "train TFLOP/s"]
    body = []
    for (size, ctx, dtype, how), by_mode in cell.items():
        def get(mode, field):
            r = by_mode.get(mode)
            if r is None:
                return ""
            return r.get(field) if r["status"] == "ok" else r["status"]
        params = next(iter(by_mode.values()))["params"]
        body.append([size, millions(params), ctx, dtype, how,
                     get("fwd", "mean_ms"), get("fwd_bwd", "mean_ms"), get("train", "mean_ms"),
                     get("fwd", "peak_mib"), get("train", "peak_mib"), get("train", "tokens_per_s"),
                     get("train", "tflops")])
    return markdown_table(header, body)


def draw_sweep(rows):
    """Time and peak memory against context length, one line per size, dtype and compile option."""
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]

    def draw(plt):
        fig, axes = plt.subplots(2, len(modes), figsize=(5 * len(modes), 8), squeeze=False)
        series = {}
        for r in rows:
            if r["status"] == "ok":
                series.setdefault((r["mode"], r["size"], r["dtype"], r["compile"]), []).append(r)
        for (mode, size, dtype, how), rs in series.items():
            col = modes.index(mode)
            rs.sort(key=lambda r: r["context_length"])
            ctx = [r["context_length"] for r in rs]
            style = {"none": "-", "model": "--", "blocks": ":"}[how]
            label = f"{size} {dtype}" + ("" if how == "none" else f" compile {how}")
            axes[0][col].plot(ctx, [r["mean_ms"] for r in rs], style, marker="o", label=label)
            if rs[0]["peak_mib"] is not None:
                axes[1][col].plot(ctx, [r["peak_mib"] / 1024 for r in rs], style, marker="o", label=label)
        for col, mode in enumerate(modes):
            ctxs = sorted({r["context_length"] for r in rows})
            for ax in (axes[0][col], axes[1][col]):
                ax.set_xscale("log", base=2)
                ax.set_xticks(ctxs, [str(c) for c in ctxs])
                ax.set_xlabel("context length")
            axes[0][col].set(title=f"{mode}: ms per step", yscale="log")
            axes[1][col].set(title=f"{mode}: peak memory (GiB)")
            axes[0][col].legend(fontsize=6)
        fig.tight_layout()
        return fig
    return draw


def run_sweep(args, device, info):
    """Every size x compile x dtype x context x mode; one model per size (built for the longest context, reused),
    OOM rows marked, and configurations past --time_budget seconds marked "skipped" rather than run."""
    sizes = csv_list(args.sizes, SIZES)
    ctxs = csv_list(args.context_lengths, cast=int)
    dtypes, modes = csv_list(args.dtypes, DTYPES), csv_list(args.modes, MODES)
    compile_opts = csv_list(args.compile_options, COMPILE_CHOICES)
    if compile_opts != ["none"]:
        allow_recompiles()
    total = len(sizes) * len(compile_opts) * len(dtypes) * len(ctxs) * len(modes)
    rows, done, t_start = [], 0, timeit.default_timer()
    generator = torch.Generator().manual_seed(args.seed)
    for size, how in itertools.product(sizes, compile_opts):
        dims = model_dims(size, args)
        configs = [dict(size=size, dims=dims, vocab_size=args.vocab_size, context_length=ctx,
                        batch_size=args.batch_size, dtype=dtype, compile=how, attn=args.attn, mode=mode)
                   for dtype, ctx, mode in itertools.product(dtypes, ctxs, modes)]
        net, runner, build_status = None, None, "skipped"
        if how != "none":
            torch._dynamo.reset()  # drop the previous model's compiled code (and its guards) before compiling anew
        if timeit.default_timer() - t_start <= args.time_budget:
            try:  # a fresh model per compile option: "blocks" compiles the model's blocks in place
                net = build_model(dims, args.vocab_size, max(ctxs), args.attn, device)
                runner = compiled(net, how)
            except RuntimeError as e:  # torch.OutOfMemoryError included
                if not is_oom(e):
                    raise
                build_status = "OOM"  # the weights alone do not fit: every row of this size is OOM
            free_memory(device)
        for cfg in configs:
            if net is None or timeit.default_timer() - t_start > args.time_budget:
                row = dict(cfg, params=None, status=build_status if net is None else "skipped")
            else:
                row = run_config(net, runner, cfg, device, generator, args.warmup, args.steps)
            rows.append(row)
            done += 1
            result = f"{row['mean_ms']:.2f} ms, peak {fmt(row['peak_mib'], 0)} MiB" if row["status"] == "ok" \
                else row["status"]
            progress(done, total, t_start, f"{size} ctx {cfg['context_length']} {cfg['dtype']} compile "
                                           f"{how} {cfg['mode']}: {result}")
            write_json(args.json, dict(info, rows=rows))
        del net, runner
        free_memory(device)
    print(f"batch {args.batch_size}, vocab {args.vocab_size}, attn {args.attn}; warm-up {args.warmup}, timed steps "
          f"{args.steps}; fwd = inference forward + loss under no_grad; TFLOP/s per SPEC §2.9 "
          f"({'all T^2 terms counted: naive attention computes them' if args.attn == 'naive' else 'causal half'})\n")
    print(sweep_table(rows))
    save_plot(args.plot, draw_sweep(rows))
    return rows


def profile_tables(prof, device, top=8):
    """Top kernels (CUDA) or top ops by self time (CPU) per phase: an event belongs to the phase whose profiler
    range its start falls in (each phase synchronizes before its range closes, so its kernels run inside it)."""
    events = prof.events()
    windows = {p: [] for p in PHASES}
    for e in events:
        if e.name in windows and e.device_type == torch.autograd.DeviceType.CPU:
            windows[e.name].append((e.time_range.start, e.time_range.end))
    on_cuda = device.type == "cuda"
    tables = {}
    for phase, spans in windows.items():
        if not spans:
            continue
        totals = {}
        for e in events:
            if e.name in PHASES or e.name.startswith("ProfilerStep"):
                continue
            if on_cuda:
                if e.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                us = e.time_range.end - e.time_range.start
            else:
                if e.device_type != torch.autograd.DeviceType.CPU:
                    continue
                us = e.self_cpu_time_total
            if any(a <= e.time_range.start < b for a, b in spans):
                calls, total = totals.get(e.name, (0, 0.0))
                totals[e.name] = (calls + 1, total + us)
        phase_us = sum(t for _, t in totals.values()) or 1.0
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
        tables[phase] = dict(total_ms=phase_us / 1e3, steps=len(spans),
                             top=[dict(name=name, calls=calls, total_ms=us / 1e3, share=us / phase_us)
                                  for name, (calls, us) in ranked])
    return tables


def print_profile_tables(tables, device, trace_path):
    what = "GPU kernels by total time" if device.type == "cuda" else "CPU ops by self time"
    print(f"### torch.profiler: top {what}, per phase (timed steps; Chrome trace: {trace_path})\n")
    for phase, table in tables.items():
        print(f"**{phase}**: {table['total_ms']:.2f} ms in all over {table['steps']} steps\n")
        body = [[i + 1, r["name"][:90], r["calls"], r["total_ms"], f"{100 * r['share']:.1f}%"]
                for i, r in enumerate(table["top"])]
        print(markdown_table(["#", "kernel" if device.type == "cuda" else "op", "calls", "total ms", "% of phase"],
                             body))


def cpu_memory_by_phase(net, x, y, mode, dtype):
    """What the CPU allows instead of allocator peaks: live tensor bytes at the end of each phase of one step.
    forward: parameters + tensors saved for backward (counted once each, parameters skipped) + logits;
    backward: parameters + gradients; optimizer_step: + AdamW's m and v (2 x parameters, fp32)."""
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    saved = {}

    def pack(t):
        if not isinstance(t, nn.Parameter):
            saved[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    net.zero_grad(set_to_none=True)
    grad = torch.no_grad() if mode == "fwd" else contextlib.nullcontext()
    with grad, autocast(dtype, x.device), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = net(x)
        loss = cross_entropy(logits, y)
    out = dict(forward=mib(params + sum(saved.values()) + logits.numel() * logits.element_size()))
    if mode != "fwd":
        loss.backward()
        out["backward"] = mib(params + sum(p.grad.numel() * p.grad.element_size() for p in net.parameters()
                                           if p.grad is not None))
        if mode == "train":
            out["optimizer_step"] = out["backward"] + mib(2 * sum(p.numel() * 4 for p in net.parameters()))
    net.zero_grad(set_to_none=True)
    return out


def cmd_model(argv):
    p = argparse.ArgumentParser(prog="bench.py model", description="End-to-end step timing (SPEC §7.1-7.3).")
    p.add_argument("--size", default="small", choices=sorted(SIZES), help="model preset (SPEC §2.10); tiny for CPU")
    for key in ("d_model", "d_ff", "num_layers", "num_heads"):
        p.add_argument(f"--{key}", type=int, help="override the preset's value")
    p.add_argument("--vocab_size", type=int, default=10000)
    p.add_argument("--context_length", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--mode", choices=MODES, default="train")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="bf16 = autocast around forward and loss")
    p.add_argument("--compile", nargs="?", const="model", default="none", choices=COMPILE_CHOICES,
                   help="--compile = torch.compile(model); --compile blocks = each block compiled (shared code)")
    p.add_argument("--attn", choices=ATTN_IMPLS, default="naive")
    add_common_args(p, plot_help="sweep only: time and memory by context length")
    p.add_argument("--sweep", action="store_true", help="every --sizes x --context_lengths x --dtypes x --modes x "
                                                        "--compile_options (the SPEC §7 table)")
    p.add_argument("--sizes", default="small,medium,large,xl,gpt2-xl")
    p.add_argument("--context_lengths", default="256,512,1024")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--modes", default="fwd,fwd_bwd,train")
    p.add_argument("--compile_options", default="none", help="any of none,model,blocks (see --compile)")
    p.add_argument("--time_budget", type=float, default=float("inf"),
                   help="sweep: seconds after which the remaining configurations are marked skipped")
    p.add_argument("--nvtx", action="store_true", help="NVTX ranges per phase and inside naive attention (nsys)")
    p.add_argument("--profile", metavar="TRACE.json", help="torch.profiler over the timed steps: top kernels per "
                                                           "phase and a Chrome trace written here")
    p.add_argument("--memory_snapshot", metavar="FILE.pickle", help="CUDA memory history of the timed steps")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.sweep and (args.nvtx or args.profile or args.memory_snapshot):
        raise SystemExit("--nvtx, --profile and --memory_snapshot instrument a single run; drop --sweep")
    if args.plot and not args.sweep:
        raise SystemExit("--plot draws the sweep; add --sweep (a single run is one row)")
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    info = run_info("model", argv, device)
    print_header("bench.py model" + (" --sweep" if args.sweep else ""), info)
    if args.sweep:
        return run_sweep(args, device, info)

    if args.nvtx:
        check_nvtx()
    dims = model_dims(args.size, args)
    cfg = dict(size=args.size, dims=dims, vocab_size=args.vocab_size, context_length=args.context_length,
               batch_size=args.batch_size, dtype=args.dtype, compile=args.compile, attn=args.attn, mode=args.mode)
    net = build_model(dims, args.vocab_size, args.context_length, args.attn, device)
    runner = compiled(net, args.compile)
    profiler = None
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
    snapshot = args.memory_snapshot if device.type == "cuda" else None
    # the annotated attention would split a compiled graph: inner attention ranges are an eager-mode tool
    annotate = args.nvtx and args.attn == "naive" and args.compile == "none"
    with annotated_naive_attention() if annotate else contextlib.nullcontext():
        row = run_config(net, runner, cfg, device, torch.Generator().manual_seed(args.seed), args.warmup,
                         args.steps, nvtx=args.nvtx, profiler=profiler, snapshot=snapshot)
    print_model_rows([row])
    payload = dict(info, rows=[row])
    if args.nvtx and not annotate:
        print("NVTX: phase ranges only (attention_scores / softmax / final_matmul need --attn naive, no --compile)\n")
    if args.profile and row["status"] == "ok":
        profiler.export_chrome_trace(args.profile)
        tables = profile_tables(profiler, device)
        print_profile_tables(tables, device, args.profile)
        payload["profile"] = tables
    if args.memory_snapshot and row["status"] == "ok":
        if device.type == "cuda":
            print(f"### Memory: peak allocated per phase (timed steps; snapshot for pytorch.org/memory_viz: "
                  f"{args.memory_snapshot})\n")
            print(markdown_table(["phase", "peak MiB"], [[p, row["phase_peak_mib"].get(p)] for p in PHASES
                                                          if p in row["phase_peak_mib"]]))
        else:
            x, y = random_batch(args.vocab_size, args.batch_size, args.context_length, device,
                                torch.Generator().manual_seed(args.seed))
            estimate = cpu_memory_by_phase(net, x, y, args.mode, args.dtype)
            print("### Memory\n\nThe memory snapshot (torch.cuda.memory._record_memory_history / _dump_snapshot) and "
                  "allocator peaks need CUDA; no snapshot was written. Instead, live tensor memory at the end of "
                  "each phase of one step (parameters, tensors saved for backward, gradients, AdamW state):\n")
            print(markdown_table(["phase", "live MiB (estimate)"], [[p, v] for p, v in estimate.items()]))
            payload["cpu_memory_estimate_mib"] = estimate
    write_json(args.json, payload)
    return [row]


# ---------------------------------------------------------------------------------------------------------------
# precision: fp32 vs bf16 autocast, and the accumulation demo (SPEC §3.7, §7.1)
# ---------------------------------------------------------------------------------------------------------------

def accumulation_demo():
    """Add 0.01 a thousand times (SPEC §3.7): in fp32, in fp16, fp16 increments into an fp32 accumulator, and the
    same for bf16 (fp32's exponent range, but only 8 bits of mantissa)."""
    cases = [("fp32", torch.float32, torch.float32), ("fp16", torch.float16, torch.float16),
             ("fp16 increments into fp32", torch.float32, torch.float16), ("bf16", torch.bfloat16, torch.bfloat16),
             ("bf16 increments into fp32", torch.float32, torch.bfloat16)]
    rows = []
    for name, acc_dtype, inc_dtype in cases:
        total = torch.tensor(0.0, dtype=acc_dtype)
        for _ in range(1000):
            total += torch.tensor(0.01, dtype=inc_dtype)
        rows.append(dict(case=name, total=float(total), error=float(total) - 10.0))
    return rows


def autocast_dtypes(device):
    """The dtype each stage has under bf16 autocast in our model (SPEC §3.7: matmuls low precision, RMSNorm and
    the loss fp32-computed, parameters and gradients fp32), read with forward hooks on a tiny model."""
    net = build_model(SIZES["tiny"], 64, 16, "naive", device)
    seen = {}

    def record(name):
        def hook(module, inputs, output):  # returns None, so the output is left as it is
            seen.setdefault(name, output.dtype)
        return hook
    layer = net.layers[0]
    hooks = [layer.attn.output_proj.register_forward_hook(record("Linear output")),
             layer.ln1.register_forward_hook(record("RMSNorm output"))]
    x = torch.randint(64, (2, 16), device=device)
    with autocast("bf16", device):
        logits = net(x)
        loss = cross_entropy(logits, x)
    loss.backward()
    for h in hooks:
        h.remove()
    seen.update({"logits": logits.dtype, "loss": loss.dtype, "parameters": net.lm_head.weight.dtype,
                 "gradients": net.lm_head.weight.grad.dtype})
    return {k: str(v).replace("torch.", "") for k, v in seen.items()}


def cmd_precision(argv):
    p = argparse.ArgumentParser(prog="bench.py precision", description="fp32 vs bf16 autocast side by side.")
    p.add_argument("--sizes", default=None, help="default: small,medium,large,xl on CUDA, tiny on CPU")
    p.add_argument("--modes", default="fwd,fwd_bwd,train")
    p.add_argument("--context_length", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=10000)
    p.add_argument("--attn", choices=ATTN_IMPLS, default="naive")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    add_common_args(p)
    args = p.parse_args(argv)
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    sizes = csv_list(args.sizes or ("small,medium,large,xl" if device.type == "cuda" else "tiny"), SIZES)
    modes = csv_list(args.modes, MODES)
    info = run_info("precision", argv, device)
    print_header("bench.py precision", info)
    generator = torch.Generator().manual_seed(args.seed)
    pairs, t_start, total = [], timeit.default_timer(), len(sizes) * len(modes)
    for size in sizes:
        dims = SIZES[size]
        net = build_model(dims, args.vocab_size, args.context_length, args.attn, device)
        for mode in modes:
            pair = {}
            for dtype in DTYPES:
                cfg = dict(size=size, dims=dims, vocab_size=args.vocab_size, context_length=args.context_length,
                           batch_size=args.batch_size, dtype=dtype, compile="none", attn=args.attn, mode=mode)
                pair[dtype] = run_config(net, net, cfg, device, generator, args.warmup, args.steps)
            pairs.append(pair)
            progress(len(pairs), total, t_start, f"{size} {mode}")
        del net
        free_memory(device)
    body = []
    for pair in pairs:
        a, b = pair["fp32"], pair["bf16"]
        ok = a["status"] == "ok" and b["status"] == "ok"
        get = lambda r, f: r.get(f) if r["status"] == "ok" else r["status"]
        body.append([a["size"], a["mode"], get(a, "mean_ms"), get(b, "mean_ms"),
                     f"{a['mean_ms'] / b['mean_ms']:.2f}x" if ok else "—", get(a, "peak_mib"), get(b, "peak_mib")])
    print(f"context {args.context_length}, batch {args.batch_size}, vocab {args.vocab_size}, attn {args.attn}, eager; "
          f"bf16 = torch.autocast around forward and loss, parameters and optimizer state stay fp32\n")
    print(markdown_table(["size", "mode", "fp32 ms", "bf16 ms", "bf16 speedup", "fp32 peak MiB", "bf16 peak MiB"],
                         body))
    demo = accumulation_demo()
    print("### Accumulation precision: 0.01 added 1000 times (exact: 10)\n")
    print(markdown_table(["case", "total", "error"], [[r["case"], f"{r['total']:.6f}", f"{r['error']:+.6f}"]
                                                     for r in demo]))
    dtypes_seen = autocast_dtypes(device)
    print("### dtypes under bf16 autocast (our model)\n")
    print(markdown_table(["tensor", "dtype"], list(dtypes_seen.items())))
    rows = [r for pair in pairs for r in pair.values()]
    write_json(args.json, dict(info, rows=rows, accumulation=demo, autocast_dtypes=dtypes_seen))

    def draw(plt):
        fig, ax = plt.subplots(figsize=(max(6, len(pairs)), 4))
        labels = [f"{pr['fp32']['size']}\n{pr['fp32']['mode']}" for pr in pairs]
        for j, dtype in enumerate(DTYPES):
            ms = [pr[dtype]["mean_ms"] if pr[dtype]["status"] == "ok" else 0 for pr in pairs]
            ax.bar([i + 0.4 * j for i in range(len(pairs))], ms, width=0.4, label=dtype)
        ax.set_xticks([i + 0.2 for i in range(len(pairs))], labels, fontsize=7)
        ax.set(ylabel="ms per step", yscale="log", title="fp32 vs bf16 autocast")
        ax.legend()
        return fig
    save_plot(args.plot, draw)
    return dict(rows=rows, accumulation=demo, autocast_dtypes=dtypes_seen)


# ---------------------------------------------------------------------------------------------------------------
# compile: eager vs torch.compile, whole model and attention alone (SPEC §7.4, §7.6)
# ---------------------------------------------------------------------------------------------------------------

def time_attention(attn, batch_size, seq_len, d, device, warmup, steps):
    """SPEC §7.4: one head, random Q, K, V (B, T, d) with the causal mask; forward ms, memory allocated just
    before backward, backward ms (retain_graph, so each timed backward reuses one forward)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch_size, seq_len, d, generator=g).to(device).requires_grad_() for _ in range(3))
    mask = model_py.causal_mask(seq_len, device)
    fwd = lambda: attn(q, k, v, mask)
    res = dict(fwd_ms=None, bwd_ms=None, mib_before_bwd=None, status="ok")
    try:
        for _ in range(warmup):
            fwd()
        sync(device)
        times = []
        for _ in range(steps):
            t0 = timeit.default_timer()
            fwd()
            sync(device)
            times.append((timeit.default_timer() - t0) * 1e3)
        res["fwd_ms"] = statistics.fmean(times)
        out = fwd()
        if device.type == "cuda":
            res["mib_before_bwd"] = mib(torch.cuda.memory_allocated(device))
        grad = torch.randn_like(out)
        for _ in range(warmup):
            out.backward(grad, retain_graph=True)
        sync(device)
        times = []
        for _ in range(steps):
            t0 = timeit.default_timer()
            out.backward(grad, retain_graph=True)
            sync(device)
            times.append((timeit.default_timer() - t0) * 1e3)
        res["bwd_ms"] = statistics.fmean(times)
    except RuntimeError as e:  # torch.OutOfMemoryError included
        if not is_oom(e):
            raise
        res["status"] = "OOM"
    out = grad = None
    free_memory(device)
    return res


def cmd_compile(argv):
    p = argparse.ArgumentParser(prog="bench.py compile", description="eager vs torch.compile side by side.")
    p.add_argument("--sizes", default=None, help="default: small,medium on CUDA, tiny on CPU")
    p.add_argument("--modes", default="fwd,train")
    p.add_argument("--context_length", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=10000)
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--attn", choices=ATTN_IMPLS, default="naive")
    p.add_argument("--warmup", type=int, default=3, help="the first compiled step compiles; warm-up absorbs it")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--attn_batch", type=int, default=8)
    p.add_argument("--attn_d", default=None, help="head dims of the attention grid (default 16,32,64,128; CPU 16)")
    p.add_argument("--attn_T", default=None, help="sequence lengths (default 256,1024,4096,8192,16384; CPU 64)")
    add_common_args(p)
    args = p.parse_args(argv)
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(args.seed)
    allow_recompiles()
    sizes = csv_list(args.sizes or ("small,medium" if cuda else "tiny"), SIZES)
    modes = csv_list(args.modes, MODES)
    ds = csv_list(args.attn_d or ("16,32,64,128" if cuda else "16"), cast=int)
    Ts = csv_list(args.attn_T or ("256,1024,4096,8192,16384" if cuda else "64"), cast=int)
    info = run_info("compile", argv, device)
    print_header("bench.py compile", info)
    generator = torch.Generator().manual_seed(args.seed)
    pairs, t_start = [], timeit.default_timer()
    total = len(sizes) * len(modes) + len(ds) * len(Ts)
    for size in sizes:
        dims = SIZES[size]
        net = build_model(dims, args.vocab_size, args.context_length, args.attn, device)
        whole = torch.compile(net)
        for mode in modes:
            pair = {}
            for name, runner in (("eager", net), ("compiled", whole)):
                cfg = dict(size=size, dims=dims, vocab_size=args.vocab_size, context_length=args.context_length,
                           batch_size=args.batch_size, dtype=args.dtype, compile="none" if name == "eager" else "model",
                           attn=args.attn, mode=mode)
                pair[name] = run_config(net, runner, cfg, device, generator, args.warmup, args.steps)
            pairs.append(pair)
            progress(len(pairs), total, t_start, f"model {size} {mode}")
        del net, whole
        free_memory(device)
    print(f"### Whole model: eager vs torch.compile(model)\n\ncontext {args.context_length}, batch "
          f"{args.batch_size}, {args.dtype}, attn {args.attn}; first step = the compile (compiled column)\n")
    body = []
    for pair in pairs:
        e, c = pair["eager"], pair["compiled"]
        ok = e["status"] == "ok" and c["status"] == "ok"
        get = lambda r, f: r.get(f) if r["status"] == "ok" else r["status"]
        body.append([e["size"], e["mode"], get(e, "mean_ms"), get(c, "mean_ms"),
                     f"{e['mean_ms'] / c['mean_ms']:.2f}x" if ok else "—", get(c, "first_step_ms"),
                     get(e, "peak_mib"), get(c, "peak_mib")])
    print(markdown_table(["size", "mode", "eager ms", "compiled ms", "speedup", "compiled first step ms",
                          "eager peak MiB", "compiled peak MiB"], body))

    attn_rows = []
    # the timed backward reuses one graph (retain_graph), which compiled autograd's donated buffers forbid
    torch._functorch.config.donated_buffer = False
    compiled_attn = torch.compile(model_py.scaled_dot_product_attention)
    for d, T in itertools.product(ds, Ts):
        row = dict(d=d, T=T)
        for name, fn in (("eager", model_py.scaled_dot_product_attention), ("compiled", compiled_attn)):
            row[name] = time_attention(fn, args.attn_batch, T, d, device, args.warmup, args.steps)
        attn_rows.append(row)
        progress(len(pairs) + len(attn_rows), total, t_start, f"attention d {d} T {T}")
    print(f"### Attention alone: model.scaled_dot_product_attention, eager vs compiled\n\nbatch {args.attn_batch}, "
          f"one head, fp32, causal mask, forward and backward timed separately (SPEC §7.4)\n")
    body = []
    for r in attn_rows:
        e, c = r["eager"], r["compiled"]
        cell = lambda x, f: x[f] if x["status"] == "ok" else x["status"]
        body.append([r["d"], r["T"], cell(e, "fwd_ms"), cell(c, "fwd_ms"), cell(e, "bwd_ms"), cell(c, "bwd_ms"),
                     cell(e, "mib_before_bwd"), cell(c, "mib_before_bwd")])
    print(markdown_table(["d", "T", "eager fwd ms", "compiled fwd ms", "eager bwd ms", "compiled bwd ms",
                          "eager MiB before bwd", "compiled MiB before bwd"], body))
    model_rows = [r for pair in pairs for r in pair.values()]
    write_json(args.json, dict(info, model_rows=model_rows, attention_rows=attn_rows))

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        labels = [f"{pr['eager']['size']}\n{pr['eager']['mode']}" for pr in pairs]
        for j, name in enumerate(("eager", "compiled")):
            ms = [pr[name]["mean_ms"] if pr[name]["status"] == "ok" else 0 for pr in pairs]
            axes[0].bar([i + 0.4 * j for i in range(len(pairs))], ms, width=0.4, label=name)
        axes[0].set_xticks([i + 0.2 for i in range(len(pairs))], labels, fontsize=7)
        axes[0].set(ylabel="ms per step", title="whole model")
        axes[0].legend()
        for d in ds:
            for name, style in (("eager", "-"), ("compiled", "--")):
                pts = [(r["T"], r[name]["fwd_ms"] + r[name]["bwd_ms"]) for r in attn_rows
                       if r["d"] == d and r[name]["status"] == "ok"]
                if pts:
                    axes[1].plot(*zip(*pts), style, marker="o", label=f"d={d} {name}")
        axes[1].set(xlabel="T", ylabel="fwd + bwd ms", xscale="log", yscale="log", title="attention alone")
        axes[1].legend(fontsize=6)
        fig.tight_layout()
        return fig
    save_plot(args.plot, draw)
    return dict(model_rows=model_rows, attention_rows=attn_rows)


# ---------------------------------------------------------------------------------------------------------------
# gpt2: training throughput of our model vs a torch.nn peer of nanoGPT's architecture (issue 3 §6)
# ---------------------------------------------------------------------------------------------------------------

class PeerBlock(nn.Module):
    """GPT-2 block from torch.nn parts: pre-LayerNorm, fused qkv with bias, SDPA causal, GELU MLP of width 4d."""

    def __init__(self, d_model, num_heads, device=None):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(d_model, device=device)
        self.qkv = nn.Linear(d_model, 3 * d_model, device=device)
        self.out = nn.Linear(d_model, d_model, device=device)
        self.norm2 = nn.LayerNorm(d_model, device=device)
        self.up = nn.Linear(d_model, 4 * d_model, device=device)
        self.down = nn.Linear(4 * d_model, d_model, device=device)

    def forward(self, x):
        B, T, d = x.shape
        heads = self.qkv(self.norm1(x)).view(B, T, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(heads[0], heads[1], heads[2], is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(B, T, d))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class PeerGPT(nn.Module):
    """The peer of issue 3 §6: GPT-2's architecture (learned positions, LayerNorm, GELU MLP, tied embeddings)."""

    def __init__(self, vocab_size, context_length, d_model, num_layers, num_heads, device=None):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model, device=device)
        self.pos = nn.Embedding(context_length, d_model, device=device)
        self.blocks = nn.ModuleList(PeerBlock(d_model, num_heads, device) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model, device=device)
        self.head = nn.Linear(d_model, vocab_size, bias=False, device=device)
        self.head.weight = self.tok.weight  # tied input and output embeddings
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias") and "norm" not in name:
                nn.init.zeros_(p)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def peer_flops_per_token(vocab_size, context_length, d_model, num_layers, causal=True):
    """SPEC §2.9's count applied to the peer: per layer qkv + output 8Td^2, scores and P V 4T^2d (half when
    causal), MLP 2 x 2 T d (4d) = 16Td^2; plus lm_head 2TdV; training = 3 x forward. Biases and norms ignored."""
    T, d = context_length, d_model
    attn_t2 = (2 if causal else 4) * T * T * d
    forward = num_layers * (8 * T * d * d + attn_t2 + 16 * T * d * d) + 2 * T * d * vocab_size
    return 3 * forward / T


def cmd_gpt2(argv):
    p = argparse.ArgumentParser(prog="bench.py gpt2", description="Training throughput at GPT-2-small shape: "
                                "our TransformerLM (sdpa, flash) vs a torch.nn GPT-2 peer, one run.")
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--context_length", type=int, default=1024)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--num_layers", type=int, default=12)
    p.add_argument("--num_heads", type=int, default=12)
    p.add_argument("--d_ff", type=int, default=2048, help="ours (SwiGLU): 2048 = 3 matrices with the parameters "
                   "of the peer's 4 x d_model GELU MLP (2 matrices), so both models have GPT-2 small's size")
    p.add_argument("--batch_size", type=int, default=12)
    p.add_argument("--variants", default="sdpa,flash,flash:tied", help="ours to run: attn_impl, with ':tied' for "
                   "tied input/output embeddings (as GPT-2 and the peer)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--peak_tflops", type=float, default=None, help="MFU denominator (default 989 on CUDA)")
    add_common_args(p)
    args = p.parse_args(argv)
    device = pick_device(args.device)
    variants = [v.split(":") for v in args.variants.split(",") if v]
    for v in variants:
        if v[0] not in ATTN_IMPLS or v[1:] not in ([], ["tied"]):
            raise SystemExit(f"--variants: {':'.join(v)!r} is not ATTN[:tied] with ATTN one of {ATTN_IMPLS}")
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (H100_BF16_PEAK if device.type == "cuda" else None)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT does; under bf16 autocast matmuls are bf16 anyway
        torch.backends.cudnn.allow_tf32 = True
    info = run_info("gpt2", argv, device)
    print_header("bench.py gpt2", info)
    V, T, B = args.vocab_size, args.context_length, args.batch_size
    x, y = random_batch(V, B, T, device, torch.Generator().manual_seed(args.seed))
    tokens = B * T

    def bench(name, attn, net, loss_of, optimizer, flops_per_tok):
        loss_fn = torch.compile(loss_of) if args.compile else loss_of

        def step():
            optimizer.zero_grad(set_to_none=True)
            with autocast(args.dtype, device):
                loss = loss_fn(x, y)
            loss.backward()
            optimizer.step()
        phases = Phases(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        row = dict(model=name, attn=attn, params=count_params(net), status="ok")
        try:
            row.update(measure(step, args.warmup, args.steps, device, phases))
        except Exception as e:
            row["status"] = failure(e)
        if row["status"] == "ok":
            row["peak_mib"] = mib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
            row["tokens_per_s"] = tokens / (row["mean_ms"] / 1e3)
            row["tflops"] = flops_per_tok * row["tokens_per_s"] / 1e12
            row["mfu"] = flops_per_tok * row["tokens_per_s"] / peak if peak else None
        print(f"{name} {attn}: {fmt(row.get('mean_ms'))} ms/step, {fmt(row.get('tokens_per_s'))} tokens/s",
              file=sys.stderr, flush=True)
        return row

    rows = []
    for attn, *tied in variants:
        ours = TransformerLM(V, T, args.d_model, args.num_layers, args.num_heads, args.d_ff, attn_impl=attn,
                             tie_embeddings=bool(tied), device=device)
        optimizer = AdamW(ours.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
        ours_flops = flops_per_token(V, T, args.d_model, args.num_layers, args.d_ff, causal=attn != "naive")
        name = "ours: TransformerLM" + (", tied" if tied else "") + " + our AdamW"
        rows.append(bench(name, attn, ours, lambda a, b, net=ours: cross_entropy(net(a), b), optimizer, ours_flops))
        del ours, optimizer
        free_memory(device)
    peer = PeerGPT(V, T, args.d_model, args.num_layers, args.num_heads, device=device)
    decay = [p for p in peer.parameters() if p.dim() >= 2]
    no_decay = [p for p in peer.parameters() if p.dim() < 2]
    peer_opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=no_decay, weight_decay=0.0)],
                                 lr=6e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    peer_loss = lambda a, b: F.cross_entropy(peer(a).flatten(0, 1), b.flatten())
    peer_name = "peer: torch.nn GPT-2 + torch AdamW" + ("(fused)" if device.type == "cuda" else "")
    peer_row = bench(peer_name, "sdpa", peer, peer_loss, peer_opt,
                     peer_flops_per_token(V, T, args.d_model, args.num_layers))
    rows.append(peer_row)
    del peer, peer_opt
    free_memory(device)

    how = "torch.compile of model + loss" if args.compile else "eager"
    print(f"Shape: {args.num_layers} layers, d_model {args.d_model}, {args.num_heads} heads, context {T}, vocab {V}, "
          f"batch {B}; {args.dtype} autocast, {how}, one fixed random batch. Ours: SwiGLU d_ff {args.d_ff}, "
          f"RoPE, RMSNorm, embeddings untied unless marked tied; peer: GELU MLP 4 x d_model, learned positions, LayerNorm, tied "
          f"embeddings. FLOPs per SPEC §2.9 for each architecture, causal convention (T^2 terms halved; naive "
          f"attention counted in full); MFU against {fmt(peak / 1e12 if peak else None, 0)} TFLOP/s. Anchor: nanoGPT "
          f"GPT-2 124M, 463k tokens/s on one H200 (ANCHORS.md).\n")
    body = []
    for r in rows:
        ok = r["status"] == "ok"
        vs_peer = r["tokens_per_s"] / peer_row["tokens_per_s"] if ok and peer_row["status"] == "ok" else None
        body.append([r["model"], r["attn"], millions(r["params"]),
                     f"{r['mean_ms']:.2f} ± {r['std_ms']:.2f}" if ok else r["status"],
                     r.get("tokens_per_s"), r.get("tflops"), f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "—",
                     f"{vs_peer:.2f}x" if vs_peer else "—",
                     f"{r['tokens_per_s'] / NANOGPT_TOKENS_PER_S:.2f}x" if ok and device.type == "cuda" else "—",
                     r.get("peak_mib")])
    print(markdown_table(["model", "attn", "params", "ms/step", "tokens/s", "TFLOP/s", "MFU", "vs peer",
                          "vs 463k anchor", "peak MiB"], body))
    write_json(args.json, dict(info, rows=rows))

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        ok = [r for r in rows if r["status"] == "ok"]
        ax.barh([f"{r['model'].split(':')[0]} {r['attn']}" for r in ok], [r["tokens_per_s"] / 1e3 for r in ok])
        if device.type == "cuda":
            ax.axvline(NANOGPT_TOKENS_PER_S / 1e3, color="k", linestyle="--", label="nanoGPT anchor (H200)")
            ax.legend()
        ax.set(xlabel="thousand tokens/s", title="GPT-2-small training throughput")
        return fig
    save_plot(args.plot, draw)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# varlen: padding strategies on the same documents (issue 7 §4, SPEC §7.10)
# ---------------------------------------------------------------------------------------------------------------

VARLEN_DEFAULTS = dict(  # (CUDA, CPU): a GPT-2-small-ish model in bf16 on the GPU, a tiny one on the CPU
    d_model=(768, 64), num_layers=(12, 2), num_heads=(12, 4), d_ff=(3072, 192), vocab_size=(10000, 512),
    context_length=(1024, 256), median_len=(200.0, 40.0), batch_size=(32, 2), dtype=("bf16", "fp32"),
    attn=("flash", "naive"), num_docs=(20000, 400), warmup=(2, 1), steps=(10, 2))


def document_lengths(num_docs, median_len, sigma, context_length, generator):
    """Long-tailed lengths like TinyStories: log-normal with the given median (exp(mu)) and sigma, rounded and
    clipped to [16, context_length]."""
    z = torch.randn(num_docs, generator=generator, dtype=torch.float64)
    return (median_len * torch.exp(sigma * z)).round().clamp(16, context_length).long()


def padded_layout(cu_seqlens, length):
    """Where each packed row goes in a right-padded (num_docs, length) layout: flat indices, and the lengths."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
    pos = torch.arange(int(cu_seqlens[-1]), device=lens.device) - cu_seqlens[:-1].long()[doc]
    return doc * length + pos, lens


def attention_methods(cu_seqlens, max_seqlen, num_heads, context_length, device, flex):
    """Attention-only contenders on one packed batch; each maps packed q, k, v (N, H, D) to packed (N, H, D).
    Built per batch: the block masks and padding layouts are set up outside the timed calls. flex: the compiled
    flex_attention (compiled once, so batches reuse it)."""
    from torch.nn.attention.flex_attention import create_block_mask
    N = int(cu_seqlens[-1])
    cu = cu_seqlens.to(device)
    methods = {"flash_attn_varlen (ours, packed)":
               lambda q, k, v: flash_attn_varlen(q, k, v, cu, max_seqlen, causal=True)}

    doc = model_py.document_ids(cu, N)
    block_mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (doc[qi] == doc[ki]), None, None, N, N,
                                   device=device)

    def flex_doc(q, k, v):
        out = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=block_mask)
        return out[0].transpose(0, 1)
    methods["FlexAttention document mask (compiled)"] = flex_doc

    def sdpa_padded(length, with_mask):
        index, lens = padded_layout(cu, length)
        B = len(lens)
        keep = torch.arange(length, device=device) < lens[:, None]  # (B, length) real keys
        mask = (keep[:, None, None, :] & model_py.causal_mask(length, device)) if with_mask else None

        def fn(q, k, v):
            def pad(t):
                out = t.new_zeros(B * length, num_heads, t.shape[-1])
                return out.index_copy(0, index, t).view(B, length, num_heads, -1).transpose(1, 2)
            out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, is_causal=not with_mask)
            return out.transpose(1, 2).reshape(B * length, num_heads, -1)[index]
        return fn
    methods["SDPA, padded to context_length, is_causal (pad)"] = sdpa_padded(context_length, False)
    methods["SDPA, padded to batch max, is_causal (dynamic_pad)"] = sdpa_padded(max_seqlen, False)
    methods["SDPA, padded to batch max, causal + padding mask"] = sdpa_padded(max_seqlen, True)
    if device.type == "cuda":
        def torch_varlen(q, k, v):  # PyTorch's internal FA2 varlen kernel (aten op; it has an autograd formula)
            return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True,
                                                           False, scale=q.shape[-1] ** -0.5)[0]
        methods["torch internal FA2 varlen (aten)"] = torch_varlen
    return methods


def cmd_varlen(argv):
    p = argparse.ArgumentParser(prog="bench.py varlen", description="pad vs dynamic_pad vs pack on the same "
                                "documents: train step, eval forward, and attention alone (issue 7 §4).")
    for key, (gpu, cpu) in VARLEN_DEFAULTS.items():
        p.add_argument(f"--{key}", type=type(gpu), default=None, help=f"default {gpu} on CUDA, {cpu} on CPU")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of document lengths")
    p.add_argument("--strategies", default="pad,dynamic_pad,pack")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model with dynamic shapes (batches differ in size); default on CUDA")
    add_common_args(p)
    args = p.parse_args(argv)
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    if args.compile is None:
        args.compile = cuda
    for key, (gpu, cpu) in VARLEN_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, gpu if cuda else cpu)
    if args.dtype not in DTYPES or args.attn not in ATTN_IMPLS:
        raise SystemExit(f"--dtype must be one of {DTYPES} and --attn one of {ATTN_IMPLS}")
    strategies = csv_list(args.strategies, ("pad", "dynamic_pad", "pack"))
    torch.manual_seed(args.seed)
    allow_recompiles()
    info = run_info("varlen", argv, device)
    print_header("bench.py varlen", info)
    ctx = args.context_length

    # the documents: random tokens, long-tailed lengths; every strategy sees the same batches of them
    g = torch.Generator().manual_seed(args.seed)
    lengths = document_lengths(args.num_docs, args.median_len, args.sigma, ctx, g)
    docs = np.concatenate([[0], np.cumsum(lengths.numpy())]).astype(np.int64)
    tokens = torch.randint(args.vocab_size, (int(docs[-1]),), generator=g).numpy().astype(np.int64)
    budget = args.batch_size * ctx
    batches = [sample_documents(docs, budget, ctx, g) for _ in range(args.warmup + args.steps)]
    n_lens = lengths.float()
    print(f"Documents: {args.num_docs}, lengths log-normal with median {args.median_len:g} and sigma {args.sigma:g}, "
          f"clipped to [16, {ctx}] (TinyStories-like: many short, a few long): mean {n_lens.mean():.0f}, "
          f"p90 {n_lens.quantile(0.9):.0f}, max {int(lengths.max())}. Batches: {args.warmup} warm-up + {args.steps} "
          f"timed, each whole documents up to {budget} real tokens (train.sample_documents). Model: d_model "
          f"{args.d_model}, {args.num_layers} layers, {args.num_heads} heads, d_ff {args.d_ff}, vocab "
          f"{args.vocab_size}, {args.dtype}, attn {args.attn}, "
          f"{'torch.compile(dynamic=True)' if args.compile else 'eager'}.\n")

    def make_inputs(strategy, spans):
        if strategy == "pack":
            x, y, cu_seqlens, max_seqlen = pack_batch(tokens, spans)
            kw = dict(cu_seqlens=cu_seqlens.to(device), max_seqlen=int(max_seqlen))
        else:
            length = ctx if strategy == "pad" else max(end - start for start, end in spans)
            x, y = pad_batch(tokens, spans, length, 0)
            kw = {}
        return x.to(device), y.to(device), kw, int((y != -100).sum()), x.numel()

    net = TransformerLM(args.vocab_size, ctx, args.d_model, args.num_layers, args.num_heads, args.d_ff,
                        attn_impl=args.attn, device=device)
    runner = torch.compile(net, dynamic=True) if args.compile else net  # one graph for every batch size
    inputs_of = {strategy: [make_inputs(strategy, spans) for spans in batches] for strategy in strategies}
    rows, t_start, total = [], timeit.default_timer(), 2 * len(strategies)
    for phase in ("eval", "train"):  # every eval first, so the loss column compares the same weights
        for strategy, inputs in inputs_of.items():
            optimizer = AdamW(net.parameters(), lr=1e-4) if phase == "train" else None
            times, first_loss, oom = [], None, False
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            try:
                for i, (x, y, kw, _, _) in enumerate(inputs):
                    t0 = timeit.default_timer()
                    if phase == "eval":
                        with torch.no_grad(), autocast(args.dtype, device):
                            loss = cross_entropy(runner(x, **kw), y)
                    else:
                        net.zero_grad(set_to_none=True)
                        with autocast(args.dtype, device):
                            loss = cross_entropy(runner(x, **kw), y)
                        loss.backward()
                        optimizer.step()
                    sync(device)
                    if i >= args.warmup:
                        times.append(timeit.default_timer() - t0)
                    if i == 0 and phase == "eval":
                        first_loss = float(loss)
                    del loss
            except RuntimeError as e:  # torch.OutOfMemoryError included
                if not is_oom(e):
                    raise
                oom = True
            del optimizer
            net.zero_grad(set_to_none=True)
            free_memory(device)
            timed = inputs[args.warmup:]
            real = sum(t[3] for t in timed)
            row = dict(strategy=strategy, phase=phase, status="OOM" if oom else "ok", real_tokens=real,
                       token_slots=sum(t[4] for t in timed), loss_first_batch=first_loss)
            if not oom:
                row.update(ms_per_batch=1e3 * sum(times) / len(times), tokens_per_s=real / sum(times),
                           peak_mib=mib(torch.cuda.max_memory_allocated(device)) if cuda else None)
            rows.append(row)
            progress(len(rows), total, t_start, f"{strategy} {phase}: {fmt(row.get('tokens_per_s'))} real tokens/s")
    del inputs_of
    for row in rows:
        base = next((r for r in rows if r["strategy"] == "pad" and r["phase"] == row["phase"]), None)
        ok = row["status"] == "ok" and base is not None and base["status"] == "ok"
        row["speedup_vs_pad"] = row["tokens_per_s"] / base["tokens_per_s"] if ok else None
    print("### Model: train step (forward, backward, AdamW) and eval forward, same documents\n")
    body = [[r["phase"], r["strategy"], r.get("ms_per_batch", r["status"]), r.get("tokens_per_s"),
             f"{r['speedup_vs_pad']:.2f}x" if r["speedup_vs_pad"] else "—",
             f"{100 * r['real_tokens'] / r['token_slots']:.0f}%", r.get("peak_mib"), r["loss_first_batch"]]
            for r in sorted(rows, key=lambda r: r["phase"] != "train")]
    print(markdown_table(["phase", "strategy", "ms/batch", "real tokens/s", "speedup vs pad", "real / slots",
                          "peak MiB", "eval loss, batch 1 (same weights: equal)"], body))
    del net, runner
    free_memory(device)

    attn_rows = varlen_attention(args, batches, tokens, device)
    write_json(args.json, dict(info, rows=rows, attention_rows=attn_rows))

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(13, 4))
        for j, phase in enumerate(("train", "eval")):
            rs = [r for r in rows if r["phase"] == phase and r["status"] == "ok"]
            axes[0].bar([i + 0.4 * j for i in range(len(rs))], [r["tokens_per_s"] / 1e3 for r in rs], width=0.4,
                        label=phase)
            axes[0].set_xticks([i + 0.2 for i in range(len(rs))], [r["strategy"] for r in rs])
        axes[0].set(ylabel="thousand real tokens/s", title="model")
        axes[0].legend()
        rs = [r for r in attn_rows if r.get("fwd_ms")]
        axes[1].barh([r["method"] for r in rs], [r["fwd_bwd_tflops"] or 0 for r in rs], label="fwd+bwd")
        axes[1].barh([r["method"] for r in rs], [r["fwd_tflops"] for r in rs], height=0.4, label="fwd")
        axes[1].set(xlabel="useful TFLOP/s (causal work inside documents)", title="attention alone")
        axes[1].tick_params(axis="y", labelsize=7)
        axes[1].legend()
        fig.tight_layout()
        return fig
    save_plot(args.plot, draw)
    return dict(rows=rows, attention_rows=attn_rows)


def mean_time(fn, reps, device):
    """Seconds per call of fn, averaged over reps back-to-back calls between two device synchronizations."""
    sync(device)
    t0 = timeit.default_timer()
    for _ in range(reps):
        fn()
    sync(device)
    return (timeit.default_timer() - t0) / reps


def varlen_attention(args, batches, tokens, device):
    """Attention alone on the packed batches: each method's inference forward and forward+backward time summed
    over the timed batches, useful TFLOP/s (4 H l^2 D / 2 per document forward, x3.5 forward+backward, as in
    ANCHORS.md), and the largest difference on the first batch from SDPA on dynamic padding computed in fp32."""
    from torch.nn.attention.flex_attention import flex_attention
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    H, D = args.num_heads, args.d_model // args.num_heads
    g = torch.Generator().manual_seed(args.seed + 1)
    flex = torch.compile(flex_attention)
    reps = 5 if device.type == "cuda" else 1  # steady state: each shape's first call is untimed, then reps timed
    stats = {}
    for i, spans in enumerate(batches):
        _, _, cu_seqlens, max_seqlen = pack_batch(tokens, spans)
        N = int(cu_seqlens[-1])
        q, k, v = (torch.randn(N, H, D, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
        do = torch.randn(N, H, D, generator=g).to(device, dtype)
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).double()
        useful = float((4 * H * lens * lens * D / 2).sum())
        methods = attention_methods(cu_seqlens, int(max_seqlen), H, args.context_length, device, flex)
        reference = None
        if i == 0:
            with torch.no_grad():
                reference = methods["SDPA, padded to batch max, is_causal (dynamic_pad)"](q.float(), k.float(),
                                                                                          v.float())
        for name, fn in methods.items():
            st = stats.setdefault(name, dict(method=name, fwd_s=0.0, fwd_bwd_s=0.0, useful=0.0, error=None,
                                             max_diff=None, backward=True))
            if st["error"]:
                continue
            qd, kd, vd = q.detach(), k.detach(), v.detach()
            try:
                with torch.no_grad():
                    out = fn(qd, kd, vd)  # untimed first call: compiles, plans, autotunes for this shape
                    if reference is not None:
                        st["max_diff"] = float((out.float() - reference).abs().max())
                    fwd_s = mean_time(lambda: fn(qd, kd, vd), reps, device)
            except Exception as e:  # a contender unavailable here (e.g. Triton without a GPU): a row that says why
                st["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
                continue
            fwd_bwd_s = 0.0
            if st["backward"]:
                try:
                    fn(q, k, v).backward(do)
                    fwd_bwd_s = mean_time(lambda: fn(q, k, v).backward(do), reps, device)
                except (RuntimeError, NotImplementedError):  # forward-only kernels; FlexAttention on CPU
                    st["backward"] = False
            if i >= args.warmup:
                st["fwd_s"] += fwd_s
                st["fwd_bwd_s"] += fwd_bwd_s
                st["useful"] += useful
            q.grad = k.grad = v.grad = None
        del methods, reference
        free_memory(device)
    rows = []
    for st in stats.values():
        ok = st["error"] is None and st["fwd_s"] > 0
        row = dict(method=st["method"], status="ok" if ok else (st["error"] or "no timed batch"),
                   fwd_ms=1e3 * st["fwd_s"] / args.steps if ok else None,
                   fwd_bwd_ms=1e3 * st["fwd_bwd_s"] / args.steps if ok and st["backward"] else None,
                   fwd_tflops=st["useful"] / st["fwd_s"] / 1e12 if ok else None,
                   fwd_bwd_tflops=3.5 * st["useful"] / st["fwd_bwd_s"] / 1e12 if ok and st["backward"] else None,
                   max_diff=st["max_diff"])
        rows.append(row)
    base = next((r for r in rows if r["method"].endswith("(pad)")), None)
    for r in rows:
        r["fwd_bwd_speedup_vs_pad"] = base["fwd_bwd_ms"] / r["fwd_bwd_ms"] \
            if r["fwd_bwd_ms"] and base and base["fwd_bwd_ms"] else None
    print(f"### Attention alone on the same packed batches ({H} heads, head dim {D}, {args.dtype}, causal)\n\n"
          f"Useful FLOPs count only causal work inside documents; times are per batch (mean of {args.steps} batches, "
          f"each timed over {reps} calls after an untimed first call that compiles or plans for its shape); "
          f"max abs diff on real tokens of the first batch against SDPA on dynamic padding in fp32.\n")
    body = [[r["method"], r["fwd_ms"] if r["status"] == "ok" else r["status"], r["fwd_bwd_ms"], r["fwd_tflops"],
             r["fwd_bwd_tflops"], f"{r['fwd_bwd_speedup_vs_pad']:.2f}x" if r["fwd_bwd_speedup_vs_pad"] else "—",
             fmt(r["max_diff"], 4) if r["max_diff"] is not None else "—"] for r in rows]
    print(markdown_table(["method", "fwd ms", "fwd+bwd ms", "fwd useful TFLOP/s", "fwd+bwd useful TFLOP/s",
                          "fwd+bwd speedup vs pad", "max abs diff"], body))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# attention: our FlashAttention-2 vs PyTorch's attention (SPEC §7.5, issue 4)
# ---------------------------------------------------------------------------------------------------------------
#     python bench.py attention --json out.json --plot attention.png
# Ours (flash.flash_attention / flash_attn_varlen) against PyTorch SDPA's flash, cuDNN and memory-efficient backends,
# FlexAttention (compiled) and naive PyTorch; forward, backward and forward+backward with triton.testing.do_bench.
# FLOPs: 4·B·H·S²·D/2 for a causal forward (half of QKᵀ and PV), ×2.5 for backward, ×3.5 for forward+backward
# (ANCHORS.md convention); packed documents count only the useful work, Σ 4·H·L²·D/2.

SWEEP_SEQ = [2 ** i for i in range(7, 17)]
SWEEP_D = [16, 32, 64, 128]
ANCHOR_SHAPES = [(d, s) for d in (64, 128) for s in (1024, 4096, 16384)]  # B·S = 16384, H·D = 2048
PEERS_MAX_SEQ = {"naive": 16384, "flex": 65536, "sdpa-efficient": 65536}  # expensive peers capped at long S


def _bench(fn, rep):
    if torch.cuda.is_available():
        import triton
        return triton.testing.do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def make(q, k, v, doc_ids=None):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return run
    return make


_flex_compiled = None


def _flex(q, k, v, doc_ids=None):
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    if doc_ids is None:
        mask_mod = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    else:
        mask_mod = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (doc_ids[q_idx] == doc_ids[kv_idx])
    block_mask = create_block_mask(mask_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
    return lambda q, k, v: _flex_compiled(q, k, v, block_mask=block_mask)


def dense_methods():
    """name -> make(q, k, v) returning a callable (q, k, v) -> O for causal (B, H, S, D) attention."""
    ours = lambda q, k, v: (lambda q, k, v: flash.flash_attention(q, k, v, causal=True))
    methods = {"ours": ours, "naive": lambda q, k, v: (lambda q, k, v: flash.attention_reference(q, k, v, True)[0])}
    if not torch.cuda.is_available():
        if not flash.INTERPRET:
            del methods["ours"]
        return methods
    from torch.nn.attention import SDPBackend
    methods.update({"sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION),
                    "sdpa-efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION), "flex": _flex})
    return methods


def time_fwd_bwd(make, q, k, v, do, rep, with_bwd=True):
    """(fwd ms, bwd ms, fwd+bwd ms) for make(q, k, v); 'OOM' or 'n/a' (unsupported) instead of numbers."""
    try:
        fn = make(q, k, v)
        o = fn(q, k, v)
        t_f = _bench(lambda: fn(q, k, v), rep)
        if not with_bwd:
            return t_f, None, None
        grad = lambda o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        grad(o)
        t_b = _bench(lambda: grad(o), rep)
        t_fb = _bench(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), rep)
        return t_f, t_b, t_fb
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "OOM", "OOM", "OOM"
    except RuntimeError as e:  # a backend that does not take this dtype / head dim
        if "out of memory" in str(e):
            torch.cuda.empty_cache()
            return "OOM", "OOM", "OOM"
        return "n/a", "n/a", "n/a"


def _tflops(flops, ms):
    return flops / ms / 1e9 if isinstance(ms, float) else ms


def dense_case(b, h, s, d, dtype, methods, rep, tag):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(s * 131 + d)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(q.shape, device=device, dtype=dtype, generator=gen)
    flops = 4 * b * h * s * s * d / 2
    rows = []
    for name, make in methods.items():
        if s > PEERS_MAX_SEQ.get(name, 1 << 30):
            t = ("skipped",) * 3
        elif name in ("sdpa-cudnn", "sdpa-flash") and dtype == torch.float32:
            t = ("n/a",) * 3
        else:
            t = time_fwd_bwd(make, q, k, v, do, rep)
        rows.append(dict(tag=tag, case=f"B={b} H={h} S={s} D={d} {str(dtype)[6:]}", method=name,
                         fwd_ms=t[0], bwd_ms=t[1], fwd_bwd_ms=t[2], fwd_tflops=_tflops(flops, t[0]),
                         bwd_tflops=_tflops(2.5 * flops, t[1]), fwd_bwd_tflops=_tflops(3.5 * flops, t[2])))
    del q, k, v, do
    return rows


def anchor_doc_lengths(total=16384, max_len=4096, gen=None):
    """ANCHORS.md packed-documents case: log-normal lengths in [16, 4096] filling 16384 tokens."""
    lens = []
    while sum(lens) < total:
        lens.append(int(min(max_len, max(16, torch.empty(1).log_normal_(6.0, 1.0, generator=gen).item()))))
    lens[-1] -= sum(lens) - total
    if lens[-1] <= 0:
        lens.pop()
    return lens


VARLEN_AS_DENSE = {"ours varlen": "ours", "flex doc-mask": "flex",
                   "sdpa-flash dyn-pad": "sdpa-flash"}  # the dense method each packed-documents row stands for


def varlen_case(lens, h, d, dtype, rep, with_peers=True, methods=None):
    """Ours (packed) vs FlexAttention with a document mask vs SDPA flash on documents padded to the batch max."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    total, max_len = sum(lens), max(lens)
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
    gen = torch.Generator(device=device).manual_seed(total + d)
    q, k, v = (torch.randn(total, h, d, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(q.shape, device=device, dtype=dtype, generator=gen)
    useful = sum(4 * h * n * n * d / 2 for n in lens)
    case = f"docs={len(lens)} max={max_len} tokens={total} H={h} D={d}"
    ours = lambda q, k, v: (lambda q, k, v: flash.flash_attn_varlen(q, k, v, cu, max_len))
    makes = {"ours varlen": ours}
    if torch.cuda.is_available() and with_peers:
        from torch.nn.attention import SDPBackend
        doc_ids = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
        to_dense = lambda x: x.detach().transpose(0, 1)[None].contiguous().requires_grad_()
        makes["flex doc-mask"] = ("dense", lambda q, k, v: _flex(q, k, v, doc_ids))
        makes["sdpa-flash dyn-pad"] = ("padded", _sdpa(SDPBackend.FLASH_ATTENTION))
    rows = []
    for name, make in makes.items():
        if methods is not None and VARLEN_AS_DENSE[name] not in methods:
            continue
        if isinstance(make, tuple) and make[0] == "dense":
            qq, kk, vv = (to_dense(x) for x in (q, k, v))
            t = time_fwd_bwd(make[1], qq, kk, vv, do.transpose(0, 1)[None].contiguous(), rep)
        elif isinstance(make, tuple):
            shape = (len(lens), h, max_len, d)
            qq, kk, vv = (torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_()
                          for _ in range(3))
            t = time_fwd_bwd(make[1], qq, kk, vv, torch.randn(shape, device=device, dtype=dtype, generator=gen), rep)
        else:
            t = time_fwd_bwd(make, q, k, v, do, rep)
        rows.append(dict(tag="varlen", case=case, method=name, fwd_ms=t[0], bwd_ms=t[1], fwd_bwd_ms=t[2],
                         fwd_tflops=_tflops(useful, t[0]), bwd_tflops=_tflops(2.5 * useful, t[1]),
                         fwd_bwd_tflops=_tflops(3.5 * useful, t[2])))
    return rows


def _fmt(x, digits=0):
    return f"{x:.{digits}f}" if isinstance(x, float) else (x if x is not None else "-")


def attention_table(rows):
    """One line per (case, method): ms and TFLOP/s, plus ours' fwd+bwd speed over the method's (>1: ours faster)."""
    ours = {}
    for r in rows:  # the first "ours" row of each case
        if r["method"].startswith("ours"):
            ours.setdefault(r["case"], r)
    out = ["| case | method | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | ours vs it (fwd / fwd+bwd) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o = ours.get(r["case"])
        ratio = "-"
        if o is not None and r is not o:
            f = [o[key] / r[key] if isinstance(o[key], float) and isinstance(r[key], float) else None
                 for key in ("fwd_tflops", "fwd_bwd_tflops")]
            ratio = " / ".join(f"{x:.2f}x" if x else "-" for x in f)
        out.append(f"| {r['case']} | {r['method']} | {_fmt(r['fwd_ms'], 3)} | {_fmt(r['bwd_ms'], 3)} | "
                   f"{_fmt(r['fwd_bwd_ms'], 3)} | {_fmt(r['fwd_tflops'])} | {_fmt(r['fwd_bwd_tflops'])} | {ratio} |")
    return "\n".join(out)


def plot_attention(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    sweep = [r for r in rows if r["tag"] == "sweep"]
    dims = sorted({int(r["case"].split("D=")[1].split()[0]) for r in sweep})
    dtypes = sorted({r["case"].split()[-1] for r in sweep})
    if not sweep:
        return
    fig, axes = plt.subplots(len(dtypes), len(dims), figsize=(4 * len(dims), 3.2 * len(dtypes)), squeeze=False)
    for i, dt in enumerate(dtypes):
        for j, d in enumerate(dims):
            ax = axes[i][j]
            for method in sorted({r["method"] for r in sweep}):
                pts = [(int(r["case"].split("S=")[1].split()[0]), r["fwd_bwd_tflops"]) for r in sweep
                       if r["method"] == method and f"D={d} " in r["case"] and r["case"].endswith(dt)
                       and isinstance(r["fwd_bwd_tflops"], float)]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=method)
            ax.set_xscale("log", base=2)
            ax.set_title(f"causal fwd+bwd, D={d}, {dt}")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def cmd_attention(argv):
    p = argparse.ArgumentParser(prog="bench.py attention", description="FlashAttention-2 vs PyTorch attention (SPEC §7.5)")
    p.add_argument("--quick", action="store_true", help="a few shapes (CPU: tiny interpreter smoke test)")
    p.add_argument("--json", help="write all rows to this JSON file")
    p.add_argument("--plot", help="write a PNG of the sweep (needs matplotlib)")
    p.add_argument("--rep", type=int, default=50, help="do_bench repetition time per measurement, ms")
    p.add_argument("--time_budget", type=float, default=0, help="seconds; cases that would start later are "
                   "marked skipped (0 = no limit)")
    p.add_argument("--parts", default="anchors,varlen,sweep", help="on CUDA without --quick, which case groups run "
                   "(in this order): the ANCHORS shapes, the packed documents, the SPEC §7.5 sweep")
    p.add_argument("--methods", help="comma list of methods to time (default all: ours, naive, sdpa-cudnn, "
                   "sdpa-flash, sdpa-efficient, flex); packed documents follow the same names")
    args = p.parse_args(argv)
    parts = csv_list(args.parts, ("anchors", "varlen", "sweep"))
    cuda = torch.cuda.is_available()
    allow_recompiles()  # FlexAttention compiles once per shape: past the default 8 it would fall back to eager
    methods = dense_methods()
    wanted = csv_list(args.methods, tuple(methods)) if args.methods else list(methods)
    methods = {n: m for n, m in methods.items() if n in wanted}
    # Most important first (ANCHORS shapes, then packed documents, then the §7.5 sweep), so a time budget cuts the
    # least important rows. FlexAttention compiles once per shape: in the sweep it runs at a few lengths only.
    jobs = []  # (tag, b, h, s, d, dtype) or ("varlen", d)
    if not cuda:
        jobs += [("sweep", 1, 2, s, 16, torch.float32) for s in (16, 40)] + [("varlen", 16)]
    elif args.quick:
        jobs += [("sweep", 1, 16, s, d, torch.bfloat16) for d in (64, 128) for s in (1024, 4096)]
        jobs += [("varlen", 64), ("varlen", 128)]
    else:
        if "anchors" in parts:
            jobs += [("anchors", 16384 // s, 2048 // d, s, d, torch.bfloat16) for d, s in ANCHOR_SHAPES]
        if "varlen" in parts:
            jobs += [("varlen", 64), ("varlen", 128)]
        if "sweep" in parts:
            jobs += [("sweep", 1, 1, s, d, dt) for d in SWEEP_D for s in SWEEP_SEQ
                     for dt in (torch.bfloat16, torch.float32)]
    rows, t0 = [], time.time()
    gen = torch.Generator().manual_seed(1)
    for i, job in enumerate(jobs):
        if args.time_budget and time.time() - t0 > args.time_budget:
            print(f"time budget reached: {len(jobs) - i} cases skipped", flush=True)
            break
        if job[0] == "varlen":
            d = job[1]
            lens = anchor_doc_lengths(gen=gen) if cuda else [1, 5, 17, 9]
            rows += varlen_case(lens, 2048 // d if cuda else 2, d, torch.bfloat16 if cuda else torch.float32,
                                args.rep, methods=methods)
        else:
            tag, b, h, s, d, dt = job
            flex_ok = dt != torch.float32 and d >= 64 and (tag == "anchors" or s in (1024, 16384))
            rows += dense_case(b, h, s, d, dt, {n: m for n, m in methods.items() if n != "flex" or flex_ok},
                               args.rep, tag)
        el = time.time() - t0
        print(f"[{i + 1}/{len(jobs)}] {job}: {el:.0f}s elapsed, ETA {el / (i + 1) * (len(jobs) - i - 1):.0f}s",
              file=sys.stderr, flush=True)
        write_json(args.json, dict(argv=argv, partial=True, rows=rows))  # a run cut short keeps what it measured
    device = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)"
    print(f"\n`python bench.py attention {' '.join(argv)}` — {datetime.date.today()} — {device}, torch "
          f"{torch.__version__}; causal; TFLOP/s as in the module docstring\n")
    print(attention_table(rows))
    write_json(args.json, dict(argv=argv, device=device, date=str(datetime.date.today()), rows=rows))
    if args.plot:
        plot_attention(rows, args.plot)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# allreduce, ddp: collectives and data-parallel variants (SPEC §7.8, §7.9, issue 5)
# ---------------------------------------------------------------------------------------------------------------
def _env_line(device):
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
    return (f"`{' '.join(['torchrun ... bench.py'] + sys.argv[1:])}`, {datetime.date.today().isoformat()}, {what}, "
            f"torch {torch.__version__}")


def _timer(device):
    """Wall-clock timer that first waits for the device (SPEC §7.1)."""

    def now():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


def cmd_allreduce(argv):
    """All-reduce of fp32 tensors (SPEC §6.2, §7.8): per size, median and mean ms over timed iterations (each
    iteration's time is the slowest rank's, gathered with all_gather_object), algbw = bytes / median time and
    busbw = algbw * 2 (N - 1) / N, in GiB/s. NCCL on GPUs, gloo on CPU."""

    ap = argparse.ArgumentParser(prog="bench.py allreduce")
    ap.add_argument("--sizes_mb", type=float, nargs="+", default=[1, 10, 100, 1000], help="MiB per tensor")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="bench_allreduce.json")
    args = ap.parse_args(argv)
    rank, _, world_size, device = ddp.init_distributed()
    if not dist.is_initialized():
        raise SystemExit("bench.py allreduce needs several processes: run it under torchrun --nproc_per_node=N")
    now = _timer(device)
    rows, records = [], []
    for mb in args.sizes_mb:
        nbytes = int(mb * 2**20)
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(x)
            x.fill_(1.0)
        times = []
        for _ in range(args.iters):
            dist.barrier()
            t0 = now()
            dist.all_reduce(x)
            times.append(now() - t0)
            x.fill_(1.0)  # keep values finite (a sum of ones grows by N per call)
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, times)
        slowest = [max(ts[i] for ts in per_rank) for i in range(args.iters)]
        median, mean = statistics.median(slowest), statistics.mean(slowest)
        algbw = x.numel() * 4 / median / 2**30
        busbw = algbw * 2 * (world_size - 1) / world_size
        records.append(dict(size_mib=mb, world_size=world_size, median_ms=median * 1e3, mean_ms=mean * 1e3,
                            algbw_gib_s=algbw, busbw_gib_s=busbw, backend=dist.get_backend()))
        rows.append([f"{mb:g}", world_size, f"{median * 1e3:.3f}", f"{mean * 1e3:.3f}", f"{algbw:.1f}",
                     f"{busbw:.1f}"])
        if rank == 0:
            print(f"all-reduce {mb:g} MiB: median {median * 1e3:.3f} ms, busbw {busbw:.1f} GiB/s", flush=True)
        del x
    if rank == 0:
        print(f"\nAll-reduce, fp32, {dist.get_backend()}: {_env_line(device)}\n")
        print(markdown_table(["MiB", "ranks", "median ms", "mean ms", "algbw GiB/s", "busbw GiB/s"], rows))
        write_json(args.json, dict(command="allreduce", env=_env_line(device), results=records))
    ddp.cleanup_distributed()


# impl[-bucket MiB][+zero1][+bf16]: the names of ddp.wrap (train.py's ddp_impl); "none" = no wrapper, no
# communication (the per-GPU compute baseline); torch+zero_redundancy = torch DDP with torch's ZeroRedundancyOptimizer
DDP_VARIANTS = ("none", "naive", "flat", "overlap", "bucketed-1", "bucketed-10", "bucketed-25", "bucketed-100",
                "bucketed-1000", "bucketed-25+zero1", "fsdp", "fsdp+bf16", "torch", "torch+zero_redundancy",
                "torch_fsdp+bf16")
_TINY = dict(d_model=64, d_ff=172, num_layers=2, num_heads=4)


def _optimizer_state_bytes(optimizer):
    """Bytes of optimizer state held by this rank (ZeRO wrappers: their local inner optimizer; DTensors: the
    local shard)."""
    inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "optim", None) or optimizer
    total = 0
    for state in inner.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                v = getattr(v, "_local_tensor", v)
                total += v.numel() * v.element_size()
    return total


def _build_variant(variant, net, opt_cls, lr):
    """(ddp.Parallel, optimizer) for one variant name (see DDP_VARIANTS); net is already on its device."""
    impl, *options = variant.split("+")
    impl, _, size = impl.partition("-")
    unknown = [o for o in options if o not in ("zero1", "bf16", "zero_redundancy")]
    if impl not in ddp.IMPLS or unknown or (size and impl != "bucketed"):
        raise ValueError(f"unknown variant {variant!r}; expected impl[-MiB][+zero1][+bf16] with impl one of "
                         f"{ddp.IMPLS}, e.g. {DDP_VARIANTS}")
    w = ddp.wrap(net, impl, bucket_size_mb=float(size or 25), compute_dtype=torch.bfloat16 if "bf16" in options
                 else None)
    kwargs = dict(lr=lr, weight_decay=0.1)
    if "zero_redundancy" in options:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return w, ZeroRedundancyOptimizer(w.parameters(), optimizer_class=opt_cls, **kwargs)
    return w, w.make_optimizer(opt_cls, zero1="zero1" in options, **kwargs)


def cmd_ddp(argv):
    """Data-parallel variants on TransformerLM in one run: ours (naive, flat, per-parameter overlap, bucketed at
    several sizes, bucketed + ZeRO-1, FSDP fp32 and bf16 gathers) beside torch DDP, ZeroRedundancyOptimizer and
    FSDP2, plus "none" (no wrapper, no communication: the per-GPU compute that scaling is measured against), all
    built by ddp.wrap under the names train.py's ddp_impl takes. Per variant: median ms/step over --steps timed
    steps (each the slowest rank's), scaling = none / variant, communication ms (naive, flat: timed between
    synchronizes around finish(); others: step - none, the communication not hidden behind compute), peak memory
    after init, just before optimizer.step() and just after it, and optimizer-state bytes on this rank."""

    ap = argparse.ArgumentParser(prog="bench.py ddp")
    ap.add_argument("--preset", default="gpt2-xl", help=f"model_py.PRESETS key or 'tiny' {_TINY}")
    ap.add_argument("--vocab_size", type=int, default=50304)
    ap.add_argument("--batch_size", type=int, default=8, help="per rank")
    ap.add_argument("--context_length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(DDP_VARIANTS), choices=DDP_VARIANTS)
    ap.add_argument("--attn_impl", default=None, help="default: flash on CUDA, naive on CPU")
    ap.add_argument("--amp", default=None, choices=["bf16", "none"], help="default: bf16 on CUDA, none on CPU")
    ap.add_argument("--optimizer", default="ours", choices=["ours", "torch"],
                    help="the same optimizer for every variant: train.AdamW or torch.optim.AdamW (fused on CUDA)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--json", default="bench_ddp.json")
    args = ap.parse_args(argv)
    rank, _, world_size, device = ddp.init_distributed()
    if not dist.is_initialized():
        raise SystemExit("bench.py ddp needs a process group: run it under torchrun --nproc_per_node=N")
    cuda = device.type == "cuda"
    dims = _TINY if args.preset == "tiny" else model_py.PRESETS[args.preset]
    if args.preset == "tiny" and args.vocab_size == 50304:
        args.vocab_size = 512
    attn_impl = args.attn_impl or ("flash" if cuda else "naive")
    amp = (args.amp or ("bf16" if cuda else "none")) == "bf16"
    if args.optimizer == "ours":
        from train import AdamW as opt_cls
    else:
        import functools
        opt_cls = functools.partial(torch.optim.AdamW, fused=True) if cuda else torch.optim.AdamW
    now = _timer(device)
    gib = 2**30
    g = torch.Generator(device=device).manual_seed(1234 + rank)  # each rank its own slice of the global batch
    x = torch.randint(0, args.vocab_size, (args.batch_size, args.context_length), device=device, generator=g)
    y = torch.randint(0, args.vocab_size, (args.batch_size, args.context_length), device=device, generator=g)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if amp else contextlib.nullcontext
    mem = (lambda: torch.cuda.max_memory_allocated(device) / gib) if cuda else (lambda: float("nan"))
    if rank == 0:
        print(f"bench ddp: {args.preset} {dims}, vocab {args.vocab_size}, batch {args.batch_size}/rank x "
              f"{world_size} ranks, T {args.context_length}, attn {attn_impl}, bf16 autocast {amp}, "
              f"optimizer {args.optimizer}", flush=True)

    results, t_start = [], time.time()
    for k, variant in enumerate(args.variants):
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        record = dict(variant=variant)
        try:
            torch.manual_seed(0)
            net = model_py.TransformerLM(args.vocab_size, args.context_length, **dims, attn_impl=attn_impl,
                                      device=device)
            wrapped, optimizer = _build_variant(variant, net, opt_cls, args.lr)
            record["peak_after_init_gib"] = mem()
            steps, comm, before, after = [], [], [], []
            for it in range(args.warmup + args.steps):
                dist.barrier()
                t0 = now()
                with autocast():
                    logits = wrapped(x)
                loss = cross_entropy(logits, y)
                del logits
                loss.backward()
                if variant in ("naive", "flat"):
                    t1 = now()
                    wrapped.finish()
                    comm.append(now() - t1)
                else:
                    wrapped.finish()
                before.append(mem())
                optimizer.step()
                after.append(mem())
                optimizer.zero_grad(set_to_none=True)
                steps.append(now() - t0)
            per_rank = [None] * world_size
            dist.all_gather_object(per_rank, (steps[args.warmup:], comm[args.warmup:]))
            slowest = [max(r[0][i] for r in per_rank) for i in range(args.steps)]
            record["ms_per_step"] = statistics.median(slowest) * 1e3
            if comm:
                record["comm_ms"] = statistics.median(max(r[1][i] for r in per_rank) for i in range(args.steps)) * 1e3
            record["peak_before_step_gib"] = max(before)
            record["peak_after_step_gib"] = max(after)
            record["optimizer_state_gib"] = _optimizer_state_bytes(optimizer) / gib
            record["loss"] = loss.item()
            del wrapped, optimizer, net, loss
        except Exception as e:  # a baseline missing from this torch build must not sink the other rows
            record["error"] = f"{type(e).__name__}: {e}"[:200]
        statuses = [None] * world_size
        dist.all_gather_object(statuses, record.get("error"))
        if any(statuses) and "error" not in record:
            record["error"] = next(s for s in statuses if s)
        results.append(record)
        if rank == 0:
            done = time.time() - t_start
            eta = done / (k + 1) * (len(args.variants) - k - 1)
            status = record.get("error") or f"{record['ms_per_step']:.1f} ms/step"
            print(f"[{k + 1}/{len(args.variants)}] {variant}: {status}  ({done:.0f}s, ETA {eta:.0f}s)", flush=True)

    local = next((r["ms_per_step"] for r in results if r["variant"] == "none" and "ms_per_step" in r), None)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["variant"], r["error"]] + [""] * 7)
            continue
        scaling = f"{100 * local / r['ms_per_step']:.1f}%" if local else "-"
        if "comm_ms" in r:
            comm = f"{r['comm_ms']:.1f}"
        elif local and r["variant"] != "none":
            comm = f"~{r['ms_per_step'] - local:.1f}"
        else:
            comm = "-"
        rows.append([r["variant"], f"{r['ms_per_step']:.1f}", scaling, comm, f"{r['peak_after_init_gib']:.2f}",
                     f"{r['peak_before_step_gib']:.2f}", f"{r['peak_after_step_gib']:.2f}",
                     f"{r['optimizer_state_gib']:.3g}", f"{r['loss']:.3f}"])
    if rank == 0:
        print(f"\nData parallel, {args.preset}, batch {args.batch_size}/rank, T {args.context_length}, "
              f"{world_size} ranks: {_env_line(device)}\n")
        print(markdown_table(["variant", "ms/step", "scaling vs none", "comm ms", "peak init GiB",
                         "peak before step GiB", "peak after step GiB", "opt state GiB/rank", "loss"], rows))
        print("\ncomm ms: naive/flat measured between synchronizes; ~x = step - none (communication not hidden).")
        write_json(args.json, dict(command="ddp", env=_env_line(device), args=vars(args), world_size=world_size,
                                    results=results))
    ddp.cleanup_distributed()


# ---------------------------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------------------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {
        "model": cmd_model,
        "precision": cmd_precision,
        "compile": cmd_compile,
        "gpt2": cmd_gpt2,
        "varlen": cmd_varlen,
        "attention": cmd_attention,
        "allreduce": cmd_allreduce,
        "ddp": cmd_ddp,
    }
    if not argv or argv[0] not in commands:
        names = ", ".join(commands)
        raise SystemExit(f"usage: python bench.py SUBCOMMAND [options]   (SUBCOMMAND: {names}; "
                         f"python bench.py SUBCOMMAND -h for its options)"
                         + (f"\nunknown subcommand {argv[0]!r}" if argv else ""))
    commands[argv[0]](argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
