"""Benchmarks and profilers: where the time and the memory of training go.

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
    python bench.py rmsnorm                                       # our RMSNorm kernels vs inductor, F.rms_norm, a copy
    torchrun --nproc_per_node=2 bench.py allreduce                # all-reduce 1 MB .. 1 GB: ms, algbw, busbw
    torchrun --nproc_per_node=2 bench.py ddp --preset gpt2-xl     # our DDP / ZeRO-1 / FSDP vs torch's, one run
    python bench.py bpe --input _dev/bench_corpus.txt             # our tokenizer vs HF tokenizers and tiktoken
    python bench.py --help                                        # the subcommands, one line each

Every subcommand runs on CPU at tiny sizes (`--size tiny`, or the tiny defaults of varlen) and on CUDA.
Timing: one timer, time_ms: warm-up calls, then timed samples with the device synchronized around each (CUDA events
on the GPU, perf_counter on the CPU); model steps report the mean and standard deviation in ms, kernels the median.
Peak memory is the allocator's peak (torch.cuda.max_memory_allocated) per phase; the CPU has no such counter, so
CPU rows leave it empty.
"""
import argparse
import collections
import contextlib
import datetime
import functools
import gc
import importlib.util
import itertools
import json
import math
import os
import pickle
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback


def bpe_train_child(argv):
    """One tokenizer training for `bench.py bpe`, run as `bench.py _bpe_train WHICH PATH VOCAB_SIZE SPECIAL WORKERS
    OUT_DIR` in a fresh process that never imports torch, so its peak RSS is the trainer's own. WHICH: ours
    (bpe.train_bpe, the files saved to OUT_DIR) or hf (HF tokenizers' BpeTrainer, byte-level, on as many threads).
    Prints one JSON line: seconds, peak RSS of this process and of its largest finished child, vocab size."""
    which, path, vocab_size, special, num_workers, out_dir = argv
    vocab_size, num_workers = int(vocab_size), int(num_workers)
    from bpe import Tokenizer, peak_rss_mb, train_bpe
    t0 = time.perf_counter()
    if which == "ours":
        vocab, merges = train_bpe(path, vocab_size, [special], num_workers=num_workers, verbose=False)
        Tokenizer(vocab, merges, [special]).save(out_dir)
        n = len(vocab)
    else:
        os.environ["RAYON_NUM_THREADS"] = str(num_workers)  # HF's thread pool, on as many cores as ours
        from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[special], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        hf.train_from_iterator(documents_of(path, special), trainer)  # whole documents: no merge crosses a special
        n = hf.get_vocab_size()
    seconds = time.perf_counter() - t0
    rss_self, rss_children = peak_rss_mb()
    print(json.dumps({"seconds": seconds, "rss_mb": rss_self, "worker_rss_mb": rss_children, "vocab": n}))
    return 0


def documents_of(path, special):
    """The documents of a UTF-8 file split at `special`, streamed (1 MiB reads)."""
    buf = ""
    with open(path, encoding="utf-8", newline="") as f:
        while True:
            block = f.read(1 << 20)
            if not block:
                break
            parts = (buf + block).split(special)
            buf = parts.pop()
            yield from parts
    yield buf


if __name__ == "__main__" and sys.argv[1:2] == ["_bpe_train"]:  # before torch is imported: see bpe_train_child
    sys.exit(bpe_train_child(sys.argv[2:]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

import ddp  # noqa: E402
import flash  # noqa: E402
import hf  # noqa: E402
import model as model_py  # noqa: E402  (the module itself: --nvtx swaps its attention function for an annotated one)
from flash import flash_attn_varlen  # noqa: E402
from model import ATTN_IMPLS, PRESETS, TransformerLM, count_params, cross_entropy, flops_per_token  # noqa: E402
from train import (PEAK_FLOPS as PEAK_FLOPS_BY_GPU, AdamW, pack_batch, pad_batch, pad_packed,  # noqa: E402
                   sample_documents, whole_step_graph)

SIZES = dict(PRESETS, tiny=dict(d_model=64, d_ff=192, num_layers=2, num_heads=4))  # tiny: CPU tests and smoke runs
MODES = ("fwd", "fwd_bwd", "train")
PHASES = ("forward", "backward", "optimizer_step")
DTYPES = ("fp32", "bf16")
COMPILE_CHOICES = ("none", "model", "blocks")  # see compiled()
PEAK_FLOPS = PEAK_FLOPS_BY_GPU["H200"]  # the MFU denominator on CUDA (train.PEAK_FLOPS: dense bf16 datasheet figure)


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
    """What every report starts with: the command that made it, the date and the device."""
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


def markdown_table(header, rows, digits=2):
    """The benchmarks' one table formatter: a Markdown table, every cell through fmt. digits: decimals of float
    cells, one number for all columns or a list with one per column."""
    per_column = digits if isinstance(digits, (list, tuple)) else [digits] * len(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c, d).replace("|", "\\|") for c, d in zip(row, per_column)) + " |" for row in rows]
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
    elapsed = time.perf_counter() - t_start
    eta = elapsed / done * (total - done) if done else 0.0
    print(f"[{done}/{total}] {text} | {elapsed:.0f}s elapsed, ETA {eta:.0f}s", file=sys.stderr, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(dtype, device):
    """bf16 autocast around forward and loss (parameters, gradients and optimizer state stay fp32); fp32 runs with
    no context at all."""
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
    """An NVTX range for Nsight Systems; push/pop are looked up at call time (the tests observe them)."""
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
    """model.scaled_dot_product_attention with an NVTX range around each of its three parts (scores, softmax, P V): the
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


_L2_FLUSH = {}  # device -> a 256 MiB buffer, larger than any L2 cache, zeroed before a timed call to evict it


def time_ms(fn, device, warmup=0, steps=1, reps=1, setup=None, budget_ms=None, flush_l2=False, host_ahead=False,
            host_ms=None):
    """The benchmarks' one timer: milliseconds per call of fn(), one sample per timed step, as a list.

    `warmup` untimed calls come first; then `steps` samples, each the mean of `reps` back-to-back calls. setup(), if
    given, runs before each sample, untimed (a barrier, a refill). budget_ms: as many samples as fit in about that
    many milliseconds, judged by the first one (never fewer than `steps`). The device is synchronized before and
    after every sample. On CUDA a sample is timed by a pair of CUDA events on the current stream, the GPU's own
    clock; with flush_l2 every call starts with a cold L2 cache (a 256 MiB buffer is zeroed before it, outside the
    events). host_ahead (CUDA): the GPU is kept busy (torch.cuda._sleep) before the first event, for longer than
    the host takes to issue fn(), so the events time the GPU's work alone, not the host's launch cost (which a short
    call otherwise shows: the GPU waits for the host); host_ms, a list, then gets the host ms per call. On the CPU:
    time.perf_counter."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    host_ahead = host_ahead and cuda
    # GPU sleep per sample: twice the host's time for the last warm-up call (the first may compile), doubled
    # whenever a sample's host time comes near it
    sleep = {"ms": 1.0}
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        sleep["ms"] = max(1.0, 2e3 * (time.perf_counter() - t0) * (1 if flush_l2 else reps))
    flush = None
    if cuda and flush_l2:
        if device not in _L2_FLUSH:
            _L2_FLUSH[device] = torch.empty(2**28, dtype=torch.int8, device=device)
        flush = _L2_FLUSH[device]

    def sample():
        if setup is not None:
            setup()
        sync(device)
        if not cuda:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) * 1e3 / reps
        spans = []
        for _ in range(reps if flush is not None else 1):  # with a flush, every call gets its own events
            if flush is not None:
                flush.zero_()
            if host_ahead:
                torch.cuda._sleep(int(sleep["ms"] * 2e6))  # ~2e6 cycles per ms at the H100/H200 clock
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            calls = 1 if flush is not None else reps
            for _ in range(calls):
                fn()
            host = (time.perf_counter() - t0) * 1e3 / calls
            end.record()
            spans.append((start, end))
            if host_ahead:
                if host_ms is not None:
                    host_ms.append(host)
                if host * calls > 0.8 * sleep["ms"]:
                    sleep["ms"] *= 2
        torch.cuda.synchronize(device)
        return sum(start.elapsed_time(end) for start, end in spans) / reps

    samples = [sample() for _ in range(min(steps, 1) if budget_ms else steps)]
    if budget_ms and samples:
        cost = samples[0] + (sleep["ms"] if host_ahead else 0)  # the GPU sleeps are spent too
        steps = max(steps, min(int(budget_ms / max(cost, 1e-3)), 10_000))
    return samples + [sample() for _ in range(steps - len(samples))]


def in_nvtx_range(fn, name, enabled):
    """fn wrapped in an NVTX range (a no-op when not enabled)."""
    def run():
        with nvtx_range(name, enabled):
            return fn()
    return run


class Phases:
    """The breakdown of one step that time_ms times as a whole: each phase (forward, backward, optimizer_step) is
    timed from its start to its end, and on CUDA its peak allocated memory is recorded (the peak counter is reset
    when a phase starts; the allocator's counters are kept on the host, so they need no synchronize). On CUDA a
    phase is timed by CUDA events, read once the step is over: nothing synchronizes inside a step, so the GPU runs
    the step as a training loop does, without waiting for the host between phases. With profiling (--profile) a
    phase instead ends with a device synchronize inside its profiler range, so that its kernels run inside it.
    Optionally wraps every phase in an NVTX range (--nvtx) and a profiler range."""

    def __init__(self, device, nvtx=False, profiling=False):
        self.device, self.nvtx, self.profiling = device, nvtx, profiling
        self.events = self.device.type == "cuda" and not profiling
        self.reset()

    def reset(self):
        self._ms = {p: [] for p in PHASES}
        self._pending = []  # (phase, start event, end event), read by .ms
        self.peak = {p: None for p in PHASES}

    @property
    def ms(self):
        for name, start, end in self._pending:
            end.synchronize()
            self._ms[name].append(start.elapsed_time(end))
        self._pending = []
        return self._ms

    @contextlib.contextmanager
    def __call__(self, name):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        label = torch.profiler.record_function(name) if self.profiling else contextlib.nullcontext()
        t0 = time.perf_counter()
        with nvtx_range(name, self.nvtx), label:
            if self.events:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            yield
            if self.events:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((name, start, end))
            else:
                sync(self.device)  # inside the ranges: the phase's kernels finish within its window
        if not self.events:
            self._ms[name].append((time.perf_counter() - t0) * 1e3)
        if cuda:
            peak = mib(torch.cuda.max_memory_allocated(self.device))
            self.peak[name] = max(self.peak[name] or 0.0, peak)


def measure(step, warmup, steps, device, phases, nvtx=False, profiler=None, snapshot=None):
    """Time `warmup` steps, then `steps` timed ones, with time_ms (the device synchronized around each step). The
    first warm-up step's time is kept: it shows the one-off costs (allocator growth, lazy optimizer state, cuBLAS
    heuristics, compilation). profiler: a torch.profiler.profile around the timed steps only; snapshot: a path to
    dump a CUDA memory-history snapshot of the timed steps to."""
    first_ms = None
    with nvtx_range("warmup", nvtx):
        if warmup:
            first_ms = time_ms(step, device)[0]
            time_ms(step, device, warmup=warmup - 1, steps=0)
    phases.reset()
    if snapshot:
        # Python frames only: symbolizing C++ frames at dump time can take minutes on a large model
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        with profiler if profiler is not None else contextlib.nullcontext():
            times = time_ms(in_nvtx_range(step, "step", nvtx), device, steps=steps)
        if snapshot:
            torch.cuda.memory._dump_snapshot(snapshot)
    finally:
        if snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
    peaks = [v for v in phases.peak.values() if v is not None]
    return dict(mean_ms=statistics.fmean(times), std_ms=statistics.stdev(times) if len(times) > 1 else 0.0,
                median_ms=statistics.median(times), first_step_ms=first_ms,
                phase_ms={p: statistics.fmean(v) for p, v in phases.ms.items() if v},
                phase_peak_mib={p: v for p, v in phases.peak.items() if v is not None},
                peak_mib=max(peaks) if peaks else None)


def peak_breakdown(snapshot, top=15):
    """Where a memory peak goes, from a memory-history snapshot (torch.cuda.memory._snapshot(), as --memory_snapshot
    dumps it): the blocks allocated while the history was recorded that are live when their total is highest,
    grouped by allocation site: the innermost frame outside torch's own files (generated inductor code counts as
    outside; its source line names the buffer) and the innermost frame in this repository's scripts. What was
    allocated before recording began (parameters, optimizer state) is not in the history. Returns (peak bytes,
    [(bytes, blocks, site)] largest first, at most `top`)."""
    import linecache
    events = max(snapshot.get("device_traces") or [[]], key=len)

    def replay(stop=None):
        live, total, peak, peak_at = {}, 0, 0, -1
        for i, e in enumerate(events[:stop]):
            if e["action"] == "alloc":
                live[e["addr"]] = e["size"], e.get("frames") or []
                total += e["size"]
                if total > peak:
                    peak, peak_at = total, i
            elif e["action"] == "free_completed" and e["addr"] in live:
                total -= live.pop(e["addr"])[0]
        return live, peak, peak_at

    _, peak, peak_at = replay()
    live, _, _ = replay(peak_at + 1)

    def name(f):
        line = linecache.getline(f["filename"], f["line"]).strip()
        return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" + (f" `{line[:60]}`" if line else "")

    ours = {"model.py", "flash.py", "bench.py", "train.py", "ddp.py"}
    groups = collections.defaultdict(lambda: [0, 0])
    for size, frames in live.values():
        inner = next((f for f in frames if "/torch/" not in f["filename"] or "torchinductor" in f["filename"]), None)
        repo = next((f for f in frames if os.path.basename(f["filename"]) in ours), None)
        site = (name(inner) if inner else "?") + (f" <- {name(repo)}" if repo and repo is not inner else "")
        groups[site][0] += size
        groups[site][1] += 1
    rows = sorted(((b, n, site) for site, (b, n) in groups.items()), reverse=True)
    return peak, rows[:top]


def document_lengths(num_docs, median_len, sigma, max_len, generator, total_tokens=None, min_len=16):
    """Long-tailed document lengths like real corpora (TinyStories: many short, a few long): log-normal with median
    median_len (mu = ln median_len) and the given sigma, rounded and clipped to [min_len, max_len]. Either num_docs
    of them, or (num_docs None) as many as fill exactly total_tokens, the last one cut to fit. An int64 tensor."""
    def draw(n):
        z = torch.randn(n, generator=generator, dtype=torch.float64)
        return (median_len * torch.exp(sigma * z)).round().clamp(min_len, max_len).long()
    if (num_docs is None) == (total_tokens is None):
        raise ValueError("document_lengths: give num_docs or total_tokens, not both")
    if num_docs is not None:
        return draw(num_docs)
    lengths = draw(0)
    while int(lengths.sum()) < total_tokens:
        lengths = torch.cat([lengths, draw(max(1, int(total_tokens / median_len)))])
    ends = lengths.cumsum(0)
    last = int(torch.searchsorted(ends, total_tokens))  # the first document that reaches total_tokens
    lengths = lengths[:last + 1].clone()
    lengths[-1] -= int(ends[last]) - total_tokens
    return lengths


BWD_FLOPS, FWD_BWD_FLOPS = 2.5, 3.5  # attention's backward and forward+backward, in forward FLOPs


def attention_flops(lengths, num_heads, head_dim):
    """Useful forward FLOPs of causal attention over sequences (or packed documents) of these lengths: Q K^T and
    P V are 2 L^2 D each per head, and a causal kernel does half: sum of 4 H L^2 D / 2. The backward recomputes
    the scores and makes dQ, dK, dV: BWD_FLOPS x forward."""
    return sum(4 * num_heads * float(n) ** 2 * head_dim / 2 for n in lengths)


# ---------------------------------------------------------------------------------------------------------------
# model: end-to-end step timing, sweep, NVTX, profiler, memory
# ---------------------------------------------------------------------------------------------------------------

def model_dims(size, args):
    """The preset's dims with any explicit --d_model / --d_ff / --num_layers / --num_heads on top."""
    dims = dict(SIZES[size])
    for key in dims:
        if getattr(args, key, None) is not None:
            dims[key] = getattr(args, key)
    return dims


def build_model(dims, vocab_size, context_length, attn, device, **recompute):
    """Our TransformerLM; recompute: its act_ckpt_every / act_ckpt_layers / selective_recompute."""
    return TransformerLM(vocab_size, context_length, dims["d_model"], dims["num_layers"], dims["num_heads"],
                         dims["d_ff"], attn_impl=attn, device=device, **recompute)


def add_recompute_args(p):
    p.add_argument("--act_ckpt_every", type=int, default=0, help="recompute segments of k blocks in backward")
    p.add_argument("--act_ckpt_layers", type=int, default=-1, help="... over the first n blocks only (-1: all)")
    p.add_argument("--selective_recompute", action="store_true", help="the other blocks keep only their matmul "
                   "and attention outputs and recompute the elementwise work (model.TransformerLM)")


def recompute_label(args):
    """What a row recomputes, in words: 'none', 'full all' or 'full 8' (the first 8 blocks; segments of k named
    when k > 1), 'selective', or 'full 8 + selective'."""
    parts = []
    if args.act_ckpt_every:
        parts.append(f"full {'all' if args.act_ckpt_layers < 0 else args.act_ckpt_layers}"
                     + (f" (segments of {args.act_ckpt_every})" if args.act_ckpt_every > 1 else ""))
    if args.selective_recompute:
        parts.append("selective")
    return " + ".join(parts) or "none"


def recompute_kwargs(args):
    return dict(act_ckpt_every=args.act_ckpt_every, selective_recompute=args.selective_recompute,
                act_ckpt_layers=None if args.act_ckpt_layers < 0 else args.act_ckpt_layers)


def build_native(dims, vocab_size, context_length, device):
    """The PyTorch-native peer of build_model's TransformerLM (NativeLM, no recomputation)."""
    with torch.device(device):
        return NativeLM(vocab_size, context_length, dims["d_model"], dims["num_layers"], dims["num_heads"],
                        dims["d_ff"], act_ckpt=False)


def compiled(net, how):
    """none: the model as it is; model: torch.compile(model); blocks: every block (TransformerLM.layers,
    NativeLM.blocks) compiled in place (regional compilation: the blocks share one compiled code, so compile time
    does not grow with depth)."""
    if how == "model":
        return torch.compile(net)
    if how == "blocks":
        for layer in net.layers if isinstance(net, TransformerLM) else net.blocks:
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
        loss = runner(x, targets=y)  # the fused head: loss without materializing the logits
    if mode == "fwd":
        return
    with phases("backward"):
        loss.backward()
    if mode == "train":
        with phases("optimizer_step"):
            optimizer.step()


def step_flops(dims, vocab_size, context_length, batch_size, mode, attn):
    """Model FLOPs of one step by model.flops_per_token (training = 3 x forward, so forward = flops_per_token / 3;
    backward doubles it); naive attention computes every T^2
    score (counted in full), sdpa and flash skip the masked half (counted causal)."""
    per_token = flops_per_token(vocab_size, context_length, dims["d_model"], dims["num_layers"], dims["d_ff"],
                                causal=attn != "naive")
    return per_token / 3 * (1 if mode == "fwd" else 3) * batch_size * context_length


def torch_adamw(params, capturable=False):
    """The native peer's optimizer: torch's AdamW, fused on CUDA (capturable: its step count on the device, so a
    CUDA graph can replay the step)."""
    params = list(params)
    return torch.optim.AdamW(params, lr=1e-4, fused=params[0].is_cuda, capturable=capturable)


def run_config(net, runner, cfg, device, generator, warmup, steps, nvtx=False, profiler=None, snapshot=None,
               make_optimizer=lambda params, capturable: AdamW(params, lr=1e-4, capturable=capturable)):
    """Measure one configuration (cfg: size, dims, vocab_size, context_length, batch_size, dtype, compile, attn,
    mode, optionally cuda_graphs) and return its row; out-of-memory becomes a row with status "OOM" (memory freed)
    instead of a crash. With cfg["cuda_graphs"] (mode train, CUDA) the step is one CUDA graph (whole_step_graph:
    the first two warm-up steps eager, the third captures it), so there is no split by phase and the peak is the
    allocator's over the whole run."""
    row = dict(cfg, params=count_params(net), status="ok")
    graphs = cfg.get("cuda_graphs", False)
    x, y = random_batch(cfg["vocab_size"], cfg["batch_size"], cfg["context_length"], device, generator)
    optimizer = make_optimizer(net.parameters(), graphs) if cfg["mode"] == "train" else None
    phases = Phases(device, nvtx=nvtx, profiling=profiler is not None)
    step = lambda: run_step(net, runner, optimizer, x, y, cfg["mode"], cfg["dtype"],
                            (lambda name: contextlib.nullcontext()) if graphs else phases)
    if graphs:
        step = whole_step_graph(step, optimizer, device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        row.update(measure(step, warmup, steps, device, phases, nvtx=nvtx, profiler=profiler, snapshot=snapshot))
        if graphs:
            row["peak_mib"] = mib(torch.cuda.max_memory_allocated(device))
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
    header = ["model", "size", "params", "ctx", "batch", "dtype", "compile", "attn", "recompute", "mode", "ms/step",
              "first step ms", "fwd / bwd / opt ms", "peak MiB", "tokens/s", "TFLOP/s"]
    body = [[r.get("model", "ours"), r["size"], millions(r["params"]), r["context_length"], r["batch_size"],
             r["dtype"], r["compile"] + (", step graph" if r.get("cuda_graphs") else ""), r["attn"],
             r.get("recompute", "none"), r["mode"]] + row_cells(r)
            for r in rows]
    print(markdown_table(header, body))


def sweep_table(rows):
    """The sweep's table: one line per size x context x dtype x compile, the modes side by side."""
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
    rows, done, t_start = [], 0, time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed)
    for size, how in itertools.product(sizes, compile_opts):
        dims = model_dims(size, args)
        configs = [dict(size=size, dims=dims, vocab_size=args.vocab_size, context_length=ctx,
                        batch_size=args.batch_size, dtype=dtype, compile=how, attn=args.attn, mode=mode)
                   for dtype, ctx, mode in itertools.product(dtypes, ctxs, modes)]
        net, runner, build_status = None, None, "skipped"
        if how != "none":
            torch._dynamo.reset()  # drop the previous model's compiled code (and its guards) before compiling anew
        if time.perf_counter() - t_start <= args.time_budget:
            try:  # a fresh model per compile option: "blocks" compiles the model's blocks in place
                net = build_model(dims, args.vocab_size, max(ctxs), args.attn, device)
                runner = compiled(net, how)
            except RuntimeError as e:  # torch.OutOfMemoryError included
                if not is_oom(e):
                    raise
                build_status = "OOM"  # the weights alone do not fit: every row of this size is OOM
            free_memory(device)
        for cfg in configs:
            if net is None or time.perf_counter() - t_start > args.time_budget:
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
          f"{args.steps}; fwd = inference forward + loss under no_grad; TFLOP/s by model.flops_per_token "
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
    p = argparse.ArgumentParser(prog="bench.py model", description="End-to-end step timing.")
    p.add_argument("--size", default="small", choices=sorted(SIZES), help="model preset (model.PRESETS); tiny for CPU")
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
    p.add_argument("--peer", action="store_true", help="single run: also time the PyTorch-native peer of the same "
                   "architecture (NativeLM: torch.nn layers, nn.RMSNorm, SDPA on cuDNN, fp32 logits into "
                   "F.cross_entropy, torch's fused AdamW), same shape, dtype and --compile, right after ours")
    add_recompute_args(p)
    add_common_args(p, plot_help="sweep only: time and memory by context length")
    p.add_argument("--sweep", action="store_true", help="every --sizes x --context_lengths x --dtypes x --modes x "
                                                        "--compile_options, one table")
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
    p.add_argument("--cuda_graphs", action="store_true", help="mode train on CUDA: the whole step (forward, "
                   "backward, optimizer) as one CUDA graph, for ours and --peer (torch's AdamW then capturable): "
                   "two eager warm-up steps, the third captures (needs --warmup >= 3); no split by phase")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.cuda_graphs and (args.mode != "train" or args.sweep or args.warmup < 3 or args.nvtx
                             or args.memory_snapshot):
        raise SystemExit("--cuda_graphs captures one training step: it needs --mode train and --warmup >= 3 (two "
                         "eager steps, then the capture), without --sweep, --nvtx or --memory_snapshot")
    if args.sweep and (args.nvtx or args.profile or args.memory_snapshot or args.peer
                       or recompute_label(args) != "none"):
        raise SystemExit("--nvtx, --profile, --memory_snapshot, --peer and recomputation are for a single run; "
                         "drop --sweep")
    if args.peer and (args.nvtx or args.profile or args.memory_snapshot):
        raise SystemExit("--nvtx, --profile and --memory_snapshot instrument our model alone; drop --peer")
    if args.plot and not args.sweep:
        raise SystemExit("--plot draws the sweep; add --sweep (a single run is one row)")
    device = pick_device(args.device)
    if args.cuda_graphs and device.type != "cuda":
        raise SystemExit(f"--cuda_graphs needs a CUDA device, got {device}")
    torch.manual_seed(args.seed)
    info = run_info("model", argv, device)
    print_header("bench.py model" + (" --sweep" if args.sweep else ""), info)
    if args.sweep:
        return run_sweep(args, device, info)

    if args.nvtx:
        check_nvtx()
    dims = model_dims(args.size, args)
    cfg = dict(size=args.size, dims=dims, vocab_size=args.vocab_size, context_length=args.context_length,
               batch_size=args.batch_size, dtype=args.dtype, compile=args.compile, attn=args.attn, mode=args.mode,
               recompute=recompute_label(args), cuda_graphs=args.cuda_graphs)
    net = build_model(dims, args.vocab_size, args.context_length, args.attn, device, **recompute_kwargs(args))
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
    rows = [row]
    if args.peer:  # ours first, then the peer on the same fresh random batch (the same seed)
        del net, runner
        free_memory(device)
        peer = build_native(dims, args.vocab_size, args.context_length, device)
        peer_cfg = dict(cfg, attn="sdpa", model="native peer", recompute="none")
        rows.append(run_config(peer, compiled(peer, args.compile), peer_cfg, device,
                               torch.Generator().manual_seed(args.seed), args.warmup, args.steps,
                               make_optimizer=torch_adamw))
        del peer
        free_memory(device)
    print_model_rows(rows)
    if args.peer and all(r["status"] == "ok" for r in rows):
        print(f"ours vs the native peer: {rows[1]['mean_ms'] / row['mean_ms']:.3f}x the peer's speed "
              f"(its ms / ours), peak memory {fmt(row['peak_mib'], 0)} vs {fmt(rows[1]['peak_mib'], 0)} MiB\n")
    payload = dict(info, rows=rows)
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
            with open(args.memory_snapshot, "rb") as f:
                peak, sites = peak_breakdown(pickle.load(f))
            print(f"### Memory at the peak of what the timed steps allocate ({mib(peak):,.0f} MiB on top of what "
                  f"existed before: parameters, optimizer state), by allocation site\n")
            print(markdown_table(["MiB", "blocks", "allocated at"], [[mib(b), n, site] for b, n, site in sites]))
            payload["memory_peak_sites"] = [dict(mib=mib(b), blocks=n, site=site) for b, n, site in sites]
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
    return rows


# ---------------------------------------------------------------------------------------------------------------
# precision: fp32 vs bf16 autocast, and the accumulation demo
# ---------------------------------------------------------------------------------------------------------------

def accumulation_demo():
    """Add 0.01 a thousand times (exact: 10): in fp32, in fp16, fp16 increments into an fp32 accumulator, and the
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
    """The dtype each stage has under bf16 autocast in our model (matmuls low precision, RMSNorm and
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
    pairs, t_start, total = [], time.perf_counter(), len(sizes) * len(modes)
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
# compile: eager vs torch.compile, whole model and attention alone
# ---------------------------------------------------------------------------------------------------------------

def time_attention(attn, batch_size, seq_len, d, device, warmup, steps):
    """Attention alone: one head, random Q, K, V (B, T, d) with the causal mask; forward ms, memory allocated just
    before backward, backward ms (retain_graph, so each timed backward reuses one forward)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch_size, seq_len, d, generator=g).to(device).requires_grad_() for _ in range(3))
    mask = model_py.causal_mask(seq_len, device)
    fwd = lambda: attn(q, k, v, mask)
    res = dict(fwd_ms=None, bwd_ms=None, mib_before_bwd=None, status="ok")
    try:
        res["fwd_ms"] = statistics.fmean(time_ms(fwd, device, warmup=warmup, steps=steps))
        out = fwd()
        if device.type == "cuda":
            res["mib_before_bwd"] = mib(torch.cuda.memory_allocated(device))
        grad = torch.randn_like(out)
        bwd = lambda: out.backward(grad, retain_graph=True)
        res["bwd_ms"] = statistics.fmean(time_ms(bwd, device, warmup=warmup, steps=steps))
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
    pairs, t_start = [], time.perf_counter()
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
          f"one head, fp32, causal mask, forward and backward timed separately\n")
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
# gpt2: training throughput of our model vs a torch.nn peer of nanoGPT's architecture
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
    """The peer: GPT-2's architecture as nanoGPT builds it (learned positions, LayerNorm, GELU MLP, tied
    embeddings), from torch.nn parts, trained with torch's AdamW."""

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


PEER_MLP_AS_SWIGLU = 8 / 3  # the d_ff / d_model at which our SwiGLU MLP costs the FLOPs of the peer's GELU MLP


def peer_flops_per_token(vocab_size, context_length, d_model, num_layers):
    """Training FLOPs per token of PeerGPT, by model.flops_per_token: the peer differs from ours only in its MLP,
    two matrices d x 4d (forward 2 x 2 T d (4d) = 16 T d^2 per sequence), which is what our three-matrix SwiGLU
    costs (6 T d d_ff) at d_ff = 8d / 3. Attention is counted causal (SDPA skips the masked half); biases,
    LayerNorms and the position embedding are left out, as norms are for ours."""
    return flops_per_token(vocab_size, context_length, d_model, num_layers, PEER_MLP_AS_SWIGLU * d_model)


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
    p.add_argument("--variants", default="sdpa:tied,flash:tied,flash:tied:graphs,flash:tied:step_graph",
                   help="ours to run: attn_impl, "
                   "with ':tied' for tied input/output embeddings (as GPT-2 and the peer), ':graphs' for "
                   "torch.compile(mode='reduce-overhead'), the step replayed as CUDA graphs (no host launch cost), "
                   "':step_graph' for the whole step (forward, backward, AdamW) captured as one CUDA graph "
                   "(train.capture_step, the model compiled in default mode; what train.py --cuda_graphs=True runs "
                   "for concat batches), "
                   "':rope_inside' for RoPE applied inside the flash kernels (default: separate passes "
                   "before them; model.FLASH_FUSED_ROPE) and ':library_ops' for flash's Triton kernels called "
                   "through its torch.library operators under torch.compile (flash.TRITON_OPS off; default: "
                   "inductor launches them itself), ':autotune' for torch.compile(mode='max-autotune') (Triton "
                   "matmul templates benchmarked against cuBLAS, with the elementwise work fused into their "
                   "epilogues where they win; with ':graphs' as well, the CUDA graphs of that mode), ':triton_norm' "
                   "for every RMSNorm on impl='triton' (each block's norms with their residual adds in one kernel "
                   "each way, flash.add_rms_norm; default: PyTorch ops that inductor fuses), ':autocast' "
                   "for autocast's own Linear product (model.LINEAR_FP32_WEIGHT_GRADS off: weight gradients in "
                   "bf16, then cast), ':coordinate_descent' for inductor's coordinate-descent tuning (each "
                   "generated elementwise and reduction kernel's block sizes and warps benchmarked at compile time)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--peak_tflops", type=float, default=None,
                   help=f"MFU denominator (default on CUDA {PEAK_FLOPS / 1e12:g}, the H100/H200 dense bf16 figure)")
    p.add_argument("--reference_tokens_per_s", type=float, default=None, help="a throughput to compare every row "
                   "with, measured elsewhere on the same GPU (e.g. nanoGPT's GPT-2 124M with nanoGPT's own "
                   "bench.py); adds a 'vs reference' column and a line on the plot")
    add_common_args(p)
    args = p.parse_args(argv)
    device = pick_device(args.device)
    variants = [v.split(":") for v in args.variants.split(",") if v]
    for v in variants:
        if v[0] not in ATTN_IMPLS or not set(v[1:]) <= {"tied", "graphs", "step_graph", "rope_inside", "library_ops",
                                                        "autotune", "triton_norm", "autocast",
                                                        "coordinate_descent"}:
            raise SystemExit(f"--variants: {':'.join(v)!r} is not ATTN[:tied][:graphs|:step_graph][:rope_inside]"
                             f"[:library_ops][:autotune][:triton_norm][:autocast][:coordinate_descent] with ATTN "
                             f"one of {ATTN_IMPLS}")
        if {"graphs", "step_graph"} <= set(v):
            raise SystemExit(f"--variants: {':'.join(v)!r}: ':graphs' and ':step_graph' are two ways to the same end")
    import torch._inductor.config as inductor_config  # (':coordinate_descent')
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (PEAK_FLOPS if device.type == "cuda" else None)
    reference = args.reference_tokens_per_s
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT does; under bf16 autocast matmuls are bf16 anyway
        torch.backends.cudnn.allow_tf32 = True
    info = run_info("gpt2", argv, device)
    print_header("bench.py gpt2", info)
    V, T, B = args.vocab_size, args.context_length, args.batch_size
    x, y = random_batch(V, B, T, device, torch.Generator().manual_seed(args.seed))
    tokens = B * T

    def bench(name, attn, net, loss_of, optimizer, flops_per_tok, graphs=False, autotune=False, step_graph=False):
        mode = ("max-autotune" if graphs else "max-autotune-no-cudagraphs") if autotune else \
            "reduce-overhead" if graphs else None
        loss_fn = torch.compile(loss_of, mode=mode) if args.compile else loss_of

        def step():
            if graphs:  # a new step: the outputs of the previous replay may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            optimizer.zero_grad(set_to_none=True)
            with autocast(args.dtype, device):
                loss = loss_fn(x, y)
            loss.backward()
            optimizer.step()
        if step_graph:
            step = whole_step_graph(step, optimizer, device)
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
            if device.type == "cuda":  # the GPU's own time per step, without the host's launch cost
                row["gpu_ms"] = statistics.median(time_ms(step, device, warmup=1, steps=10, host_ahead=True))
            row["tokens_per_s"] = tokens / (row["mean_ms"] / 1e3)
            row["tflops"] = flops_per_tok * row["tokens_per_s"] / 1e12
            row["mfu"] = flops_per_tok * row["tokens_per_s"] / peak if peak else None
        print(f"{name} {attn}: {fmt(row.get('mean_ms'))} ms/step, {fmt(row.get('tokens_per_s'))} tokens/s",
              file=sys.stderr, flush=True)
        return row

    rows = []
    for attn, *tags in variants:
        tied, graphs = "tied" in tags, "graphs" in tags and device.type == "cuda"
        step_graph = "step_graph" in tags and device.type == "cuda"
        ours = TransformerLM(V, T, args.d_model, args.num_layers, args.num_heads, args.d_ff, attn_impl=attn,
                             tie_embeddings=tied, device=device)
        if "triton_norm" in tags:
            model_py.set_norm_impl(ours, "triton")
        optimizer = AdamW(ours.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, capturable=step_graph)
        ours_flops = flops_per_token(V, T, args.d_model, args.num_layers, args.d_ff, causal=attn != "naive")
        name = "ours: TransformerLM" + (", tied" if tied else "") + (", CUDA graphs" if graphs else "") + \
            (", the step as one CUDA graph" if step_graph else "") + \
            (", Triton norms" if "triton_norm" in tags else "") + \
            (", autocast's Linear" if "autocast" in tags else "") + \
            (", RoPE inside" if "rope_inside" in tags else "") + \
            (", flash through its operators" if "library_ops" in tags else "") + \
            (", max-autotune" if "autotune" in tags else "") + \
            (", coordinate-descent tuned" if "coordinate_descent" in tags else "") + " + our AdamW"
        # module switches, set for this variant's whole run (it compiles in its first steps) and restored after
        switches = [(inductor_config, "coordinate_descent_tuning")]
        defaults = [getattr(module, name) for module, name in switches]
        inductor_config.coordinate_descent_tuning = inductor_config.coordinate_descent_tuning or \
            "coordinate_descent" in tags
        try:
            rows.append(bench(name, attn, ours, lambda a, b, net=ours: net(a, targets=b), optimizer, ours_flops,
                              graphs=graphs, autotune="autotune" in tags, step_graph=step_graph))
        finally:
            for (module, name), value in zip(switches, defaults):
                setattr(module, name, value)
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
          f"RoPE, RMSNorm, embeddings untied unless marked tied; peer: GELU MLP 4 x d_model, learned positions, "
          f"LayerNorm, tied embeddings. FLOPs: model.flops_per_token for each architecture (training = 3 x forward, "
          f"T^2 terms halved for causal kernels, naive attention counted in full); MFU against "
          f"{fmt(peak / 1e12 if peak else None, 0)} TFLOP/s"
          + (f"; reference: {fmt(reference, 0)} tokens/s." if reference else ".") + "\n")
    body = []
    for r in rows:
        ok = r["status"] == "ok"
        vs_peer = r["tokens_per_s"] / peer_row["tokens_per_s"] if ok and peer_row["status"] == "ok" else None
        body.append([r["model"], r["attn"], millions(r["params"]),
                     f"{r['mean_ms']:.2f} ± {r['std_ms']:.2f}" if ok else r["status"], r.get("median_ms"),
                     r.get("gpu_ms"),
                     r.get("tokens_per_s"), r.get("tflops"), f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "—",
                     f"{vs_peer:.2f}x" if vs_peer else "—"]
                    + ([f"{r['tokens_per_s'] / reference:.2f}x" if ok else "—"] if reference else [])
                    + [r.get("peak_mib")])
    print("ms/step: mean ± std of the synchronized steps (tokens/s, TFLOP/s and MFU follow it); median ms: theirs; "
          "GPU ms: the median of 10 more steps with the GPU kept busy until the host has issued the step, so it "
          "times the GPU's work alone (CUDA only). Where ms/step is well above GPU ms, the GPU waited for the host.\n")
    print(markdown_table(["model", "attn", "params", "ms/step", "median ms", "GPU ms", "tokens/s", "TFLOP/s", "MFU",
                          "vs peer"]
                         + (["vs reference"] if reference else []) + ["peak MiB"], body))
    write_json(args.json, dict(info, rows=rows))

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        ok = [r for r in rows if r["status"] == "ok"]
        ax.barh([f"{r['model'].split(':')[0]} {r['attn']}" for r in ok], [r["tokens_per_s"] / 1e3 for r in ok])
        if reference:
            ax.axvline(reference / 1e3, color="k", linestyle="--", label="reference")
            ax.legend()
        ax.set(xlabel="thousand tokens/s", title="GPT-2-small training throughput")
        return fig
    save_plot(args.plot, draw)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# varlen: padding strategies on the same documents
# ---------------------------------------------------------------------------------------------------------------

VARLEN_DEFAULTS = dict(  # (CUDA, CPU): a GPT-2-small-ish model in bf16 on the GPU, a tiny one on the CPU
    d_model=(768, 64), num_layers=(12, 2), num_heads=(12, 4), d_ff=(3072, 192), vocab_size=(10000, 512),
    context_length=(1024, 256), median_len=(200.0, 40.0), batch_size=(32, 2), dtype=("bf16", "fp32"),
    attn=("flash", "naive"), num_docs=(20000, 400), warmup=(2, 1), steps=(10, 2))


def padded_layout(cu_seqlens, length):
    """Where each packed row goes in a right-padded (num_docs, length) layout: flat indices, and the lengths."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
    pos = torch.arange(int(cu_seqlens[-1]), device=lens.device) - cu_seqlens[:-1].long()[doc]
    return doc * length + pos, lens


def xformers_varlen(lens):
    """xFormers' memory-efficient attention on the packed documents (its block-diagonal causal bias), or, when
    xFormers is missing, a method that raises saying so (its row in the table then says why)."""
    try:
        from xformers.ops import fmha
    except ImportError as e:
        why = f"xFormers is not installed ({e})"

        def missing(q, k, v):
            raise ModuleNotFoundError(why)
        return missing
    bias = fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens(lens)
    return lambda q, k, v: fmha.memory_efficient_attention(q[None], k[None], v[None], attn_bias=bias)[0]


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

    # the documents back to back with one dense (N, N) block-diagonal causal mask: O(N^2) memory and work
    block_diagonal = model_py.block_diagonal_causal_mask(cu, N)

    def sdpa_block_diagonal(q, k, v):
        heads = lambda t: t.transpose(0, 1)[None]  # (N, H, D) -> (1, H, N, D), a view
        return F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=block_diagonal)[0].transpose(0, 1)
    methods["SDPA, concatenated, dense block-diagonal mask (O(N^2))"] = sdpa_block_diagonal

    # jagged NestedTensors: the packed rows with their offsets, through SDPA's nested-tensor kernels
    offsets, lens = cu.long(), (cu[1:] - cu[:-1]).tolist()

    def nested_sdpa(q, k, v):
        jagged = lambda t: torch.nested.nested_tensor_from_jagged(t, offsets, min_seqlen=min(lens),
                                                                  max_seqlen=max(lens)).transpose(1, 2)
        return F.scaled_dot_product_attention(jagged(q), jagged(k), jagged(v), is_causal=True).transpose(1, 2).values()
    methods["NestedTensor (jagged) through SDPA, is_causal"] = nested_sdpa
    methods["xFormers memory_efficient_attention, block-diagonal causal"] = xformers_varlen(lens)
    if device.type == "cuda":
        def torch_varlen(q, k, v):  # PyTorch's internal FA2 varlen kernel (aten op; it has an autograd formula)
            return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True,
                                                           False, scale=q.shape[-1] ** -0.5)[0]
        methods["torch internal FA2 varlen (aten)"] = torch_varlen
    return methods


def cmd_varlen(argv):
    p = argparse.ArgumentParser(prog="bench.py varlen", description="pad vs dynamic_pad vs pack on the same "
                                "documents: train step, eval forward, and attention alone.")
    for key, (gpu, cpu) in VARLEN_DEFAULTS.items():
        p.add_argument(f"--{key}", type=type(gpu), default=None, help=f"default {gpu} on CUDA, {cpu} on CPU")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of document lengths")
    p.add_argument("--strategies", default="pad,dynamic_pad,pack,pack_static", help="pack_static: pack padded to "
                   "(batch_size + 1) * context_length tokens and a power of two of documents (train.py's "
                   "pack_static), compiled for static shapes")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model with dynamic shapes (batches differ in size; pack_static: static "
                   "shapes, one compile per shape); default on CUDA")
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
    strategies = csv_list(args.strategies, ("pad", "dynamic_pad", "pack", "pack_static"))
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
          f"{'torch.compile(dynamic=True; pack_static: dynamic=False)' if args.compile else 'eager'}.\n")

    def make_inputs(strategy, spans):
        if strategy.startswith("pack"):
            x, y, cu_seqlens, max_seqlen = pack_batch(tokens, spans)
            if strategy == "pack_static":
                x, y, cu_seqlens = pad_packed(x, y, cu_seqlens, budget + ctx, 0)
                max_seqlen = ctx
            kw = dict(cu_seqlens=cu_seqlens.to(device), max_seqlen=int(max_seqlen))
        else:
            length = ctx if strategy == "pad" else max(end - start for start, end in spans)
            x, y = pad_batch(tokens, spans, length, 0)
            kw = {}
        return x.to(device), y.to(device), kw, int((y != -100).sum()), x.numel()

    net = TransformerLM(args.vocab_size, ctx, args.d_model, args.num_layers, args.num_heads, args.d_ff,
                        attn_impl=args.attn, device=device)
    runner = torch.compile(net, dynamic=True) if args.compile else net  # one graph for every batch size
    static_runner = torch.compile(net, dynamic=False) if args.compile else net  # one graph per shape
    inputs_of = {strategy: [make_inputs(strategy, spans) for spans in batches] for strategy in strategies}
    rows, t_start, total = [], time.perf_counter(), 2 * len(strategies)
    for phase in ("eval", "train"):  # every eval first, so the loss column compares the same weights
        for strategy, inputs in inputs_of.items():
            optimizer = AdamW(net.parameters(), lr=1e-4) if phase == "train" else None
            times, first_loss, oom = [], None, False
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)

            run = static_runner if strategy == "pack_static" else runner

            def step(x, y, kw, out):
                if phase == "eval":
                    with torch.no_grad(), autocast(args.dtype, device):
                        out["loss"] = run(x, targets=y, **kw)
                else:
                    net.zero_grad(set_to_none=True)
                    with autocast(args.dtype, device):
                        loss = run(x, targets=y, **kw)
                    loss.backward()
                    optimizer.step()
            try:
                if strategy == "pack_static":  # each of its few shapes compiled before the timed batches
                    for x, y, kw, _, _ in {tuple(t[2]["cu_seqlens"].shape): t for t in inputs}.values():
                        step(x, y, kw, {})
                for i, (x, y, kw, _, _) in enumerate(inputs):  # one sample per batch: each batch is timed once
                    out = {}
                    ms = time_ms(lambda: step(x, y, kw, out), device)[0]
                    if i >= args.warmup:
                        times.append(ms / 1e3)
                    if i == 0 and phase == "eval":
                        first_loss = float(out["loss"])
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
             f"{100 * r['real_tokens'] / r['token_slots']:.0f}%" if r.get("token_slots") else "—", r.get("peak_mib"),
             r["loss_first_batch"]]
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


def varlen_attention(args, batches, tokens, device):
    """Attention alone on the packed batches: each method's inference forward and forward+backward time summed
    over the timed batches, useful TFLOP/s (attention_flops: causal work inside documents only), and the largest
    difference on the first batch from SDPA on dynamic padding computed in fp32."""
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
        useful = attention_flops((cu_seqlens[1:] - cu_seqlens[:-1]).tolist(), H, D)
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
                    fwd_s = time_ms(lambda: fn(qd, kd, vd), device, reps=reps)[0] / 1e3
            except Exception as e:  # a contender unavailable here (e.g. Triton without a GPU): a row that says why
                st["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
                continue
            fwd_bwd_s = 0.0
            if st["backward"]:
                try:
                    fn(q, k, v).backward(do)
                    fwd_bwd_s = time_ms(lambda: fn(q, k, v).backward(do), device, reps=reps)[0] / 1e3
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
                   fwd_bwd_tflops=FWD_BWD_FLOPS * st["useful"] / st["fwd_bwd_s"] / 1e12 if ok and st["backward"]
                   else None,
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
# attention: our FlashAttention-2 vs PyTorch's attention
# ---------------------------------------------------------------------------------------------------------------
#     python bench.py attention --json out.json --plot attention.png
# Ours (flash.flash_attention / flash_attn_varlen) against PyTorch SDPA's flash, cuDNN and memory-efficient backends,
# FlexAttention (compiled) and naive PyTorch; forward, backward and forward+backward, each the median of time_ms
# samples. FLOPs by attention_flops: 4·B·H·S²·D/2 for a causal forward (half of QKᵀ and PV), ×2.5 for backward,
# ×3.5 for forward+backward; packed documents count only the useful work, Σ 4·H·L²·D/2.
# Case groups, most important first: "anchors", the dense causal shapes at B·S = 16384 tokens and H·D = 2048
# (D 64 and 128, S 1024 to 16384) in bf16; "varlen", packed documents of log-normal lengths filling 16384 tokens;
# "sweep", one head at S 128 to 65536 and D 16 to 128 in bf16 and fp32.

SWEEP_SEQ = [2 ** i for i in range(7, 17)]
SWEEP_D = [16, 32, 64, 128]
DENSE_SHAPES = [(d, s) for d in (64, 128) for s in (1024, 4096, 16384)]  # (D, S); B = 16384 / S, H = 2048 / D
SUSTAINED_SHAPES = [(1, 32, 16384, 64), (1, 16, 16384, 128), (1, 32, 32768, 128)]  # (B, H, S, D)
WORK_BH = [(4, 12), (12, 12), (16, 16), (16, 32), (32, 32)]  # (B, H) of the 'work' part; (12, 12) is GPT-2 small's
PEERS_MAX_SEQ = {"naive": 16384, "flex": 65536, "sdpa-efficient": 65536}  # expensive peers capped at long S


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


def on_backend(backend, fn):
    """fn with flash.BACKEND set for its call (the backward of what it returns follows the same backend)."""
    def call(*args):
        old, flash.BACKEND = flash.BACKEND, backend
        try:
            return fn(*args)
        finally:
            flash.BACKEND = old
    return call


def hopper_kernels():
    """True where flash.py has a Gluon (Hopper) forward beside the Triton one: then 'ours-triton' rows run."""
    return torch.cuda.is_available() and flash.gluon is not None and torch.cuda.get_device_capability() == (9, 0)


def forced_backend(backend):
    """A dense_methods entry: causal flash_attention on the kernels of flash.BACKEND = backend."""
    return lambda q, k, v: on_backend(backend, lambda q, k, v: flash.flash_attention(q, k, v, causal=True))


def ours_method(module):
    """A dense_methods entry: causal flash_attention of this flash.py module (flash itself, or a copy loaded by
    flash_variant)."""
    return lambda q, k, v: (lambda q, k, v: module.flash_attention(q, k, v, causal=True))


def dense_methods():
    """name -> make(q, k, v) returning a callable (q, k, v) -> O for causal (B, H, S, D) attention. 'ours' is what
    flash.py picks (the Gluon forward on Hopper where it is faster), 'ours-triton' the Triton kernels alone."""
    methods = {"ours": ours_method(flash),
               "naive": lambda q, k, v: (lambda q, k, v: flash.attention_reference(q, k, v, True)[0])}
    if not torch.cuda.is_available():
        if not flash.INTERPRET:
            del methods["ours"]
        return methods
    if hopper_kernels():
        methods["ours-triton"] = forced_backend("triton")
    from torch.nn.attention import SDPBackend
    methods.update({"sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION),
                    "sdpa-efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION), "flex": _flex})
    return methods


def time_fwd_bwd(make, q, k, v, do, rep, with_bwd=True, sustain=0, readings=None):
    """(fwd ms, bwd ms, fwd+bwd ms, host ms of fwd+bwd) for make(q, k, v); 'OOM' or 'n/a' (unsupported) instead of
    numbers. Each is the median of time_ms samples: on CUDA as many as fit in `rep` ms, every call with a cold L2
    cache and the host ahead of the GPU (GPU time alone; the host's own time per fwd+bwd call is the fourth
    number), after 5 warm-up calls; on the CPU (the Triton interpreter: slow) 3 samples. sustain > 0 (CUDA):
    sustained_ms instead, `sustain` seconds of warm-up and as many timed for each of the three (no host ms;
    readings gets the GPU's (MHz, W) of each)."""
    cuda = q.device.type == "cuda"

    def median_ms(fn, host_ms=None):
        if sustain and cuda:
            return sustained_ms(fn, q.device, sustain, readings)
        return statistics.median(time_ms(fn, q.device, warmup=5 if cuda else 0, steps=3,
                                         budget_ms=rep if cuda else None, flush_l2=cuda, host_ahead=cuda,
                                         host_ms=host_ms))
    try:
        fn = make(q, k, v)
        o = fn(q, k, v)
        t_f = median_ms(lambda: fn(q, k, v))
        if not with_bwd:
            return t_f, None, None, None
        grad = lambda o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        grad(o)
        t_b = median_ms(lambda: grad(o))
        host = []
        t_fb = median_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), host)
        return t_f, t_b, t_fb, statistics.median(host) if host else None
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return ("OOM",) * 4
    except RuntimeError as e:  # a backend that does not take this dtype / head dim
        if "out of memory" in str(e):
            torch.cuda.empty_cache()
            return ("OOM",) * 4
        return ("n/a",) * 4


def gpu_reading(device):
    """(SM clock MHz, board power W) now, through NVML (torch.cuda.clock_rate / power_draw); (None, None) where
    NVML is not installed or does not answer."""
    try:
        return float(torch.cuda.clock_rate(device)), torch.cuda.power_draw(device) / 1e3
    except Exception:  # no pynvml, no NVML library, or a GPU it does not report
        return None, None


def sustained_ms(fn, device, seconds, readings=None):
    """ms per call of fn() as a long run sees it: fn runs back to back (no L2 flush, no pause, the host ahead) for
    `seconds` untimed, so the GPU settles at the clock its power limit allows for this work, then for `seconds`
    more in samples of about 0.2 s (events around each); the median sample. A short burst after idle runs at the
    top clock, while minutes of training run at the power-capped one: on the H200 a long attention kernel drew
    ~690 W and ran at 1.6-1.75 GHz instead of 1.98. readings (a list) gets (mean SM MHz, mean W) of the samples.
    Only meaningful when a call takes the GPU longer than the host takes to issue it."""
    per_call = time_ms(fn, device, warmup=2, steps=1)[0]
    reps = max(1, round(200 / per_call))
    for _ in range(max(1, round(seconds * 1e3 / per_call))):
        fn()
    samples, seen = [], []
    for _ in range(max(3, round(seconds * 1e3 / (reps * per_call)))):
        samples += time_ms(fn, device, steps=1, reps=reps)
        seen.append(gpu_reading(device))
    if readings is not None and seen[0][0] is not None:
        readings.append(tuple(statistics.mean(r[i] for r in seen) for i in (0, 1)))
    return statistics.median(samples)


def _tflops(flops, ms):
    return flops / ms / 1e9 if isinstance(ms, float) else ms


def dense_case(b, h, s, d, dtype, methods, rep, tag, sustain=0):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(s * 131 + d)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(q.shape, device=device, dtype=dtype, generator=gen)
    flops = b * attention_flops([s], h, d)
    rows = []
    for name, make in methods.items():
        readings = []
        if s > PEERS_MAX_SEQ.get(name, 1 << 30):
            t = ("skipped",) * 4
        elif name in ("sdpa-cudnn", "sdpa-flash") and dtype == torch.float32:
            t = ("n/a",) * 4
        else:
            t = time_fwd_bwd(make, q, k, v, do, rep, sustain=sustain, readings=readings)
        rows.append(dict(tag=tag, case=f"B={b} H={h} S={s} D={d} {str(dtype)[6:]}", method=name,
                         fwd_ms=t[0], bwd_ms=t[1], fwd_bwd_ms=t[2], host_ms=t[3], gpu=readings or None,
                         fwd_tflops=_tflops(flops, t[0]),
                         bwd_tflops=_tflops(BWD_FLOPS * flops, t[1]),
                         fwd_bwd_tflops=_tflops(FWD_BWD_FLOPS * flops, t[2])))
    del q, k, v, do
    return rows


VARLEN_AS_DENSE = {"ours varlen": "ours", "ours varlen-triton": "ours-triton", "flex doc-mask": "flex",
                   "sdpa-flash dyn-pad": "sdpa-flash"}  # the dense method each packed-documents row stands for


def varlen_case(lens, h, d, dtype, rep, with_peers=True, methods=None):
    """Ours (packed) vs FlexAttention with a document mask vs SDPA flash on documents padded to the batch max."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    total, max_len = sum(lens), max(lens)
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
    gen = torch.Generator(device=device).manual_seed(total + d)
    q, k, v = (torch.randn(total, h, d, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(q.shape, device=device, dtype=dtype, generator=gen)
    useful = attention_flops(lens, h, d)
    case = f"docs={len(lens)} max={max_len} tokens={total} H={h} D={d}"
    modules = {"ours varlen": flash}  # and the flash.py copies of bench.py attention --variants
    modules.update((f"ours varlen@{n[5:]}", _FLASH_VARIANTS[n[5:]][1]) for n in methods or () if n.startswith("ours@"))
    makes = {n: (lambda m: lambda q, k, v: (lambda q, k, v: m.flash_attn_varlen(q, k, v, cu, max_len)))(m)
             for n, m in modules.items()}
    if hopper_kernels():
        makes["ours varlen-triton"] = lambda q, k, v: on_backend("triton", lambda q, k, v: flash.flash_attn_varlen(
            q, k, v, cu, max_len))
    if torch.cuda.is_available() and with_peers:
        from torch.nn.attention import SDPBackend
        doc_ids = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
        to_dense = lambda x: x.detach().transpose(0, 1)[None].contiguous().requires_grad_()
        makes["flex doc-mask"] = ("dense", lambda q, k, v: _flex(q, k, v, doc_ids))
        makes["sdpa-flash dyn-pad"] = ("padded", _sdpa(SDPBackend.FLASH_ATTENTION))
    rows = []
    for name, make in makes.items():
        if methods is not None and VARLEN_AS_DENSE.get(name, name.replace("ours varlen", "ours")) not in methods:
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
        rows.append(dict(tag="varlen", case=case, method=name, fwd_ms=t[0], bwd_ms=t[1], fwd_bwd_ms=t[2], host_ms=t[3],
                         fwd_tflops=_tflops(useful, t[0]), bwd_tflops=_tflops(BWD_FLOPS * useful, t[1]),
                         fwd_bwd_tflops=_tflops(FWD_BWD_FLOPS * useful, t[2])))
    return rows


def attention_table(rows):
    """One line per (case, method): ms and TFLOP/s, plus ours' fwd+bwd speed over the method's (>1: ours faster);
    the GPU's clock and power where they were read (the sustained part)."""
    with_gpu = any(r.get("gpu") for r in rows)
    ours = {}
    for r in rows:  # the first "ours" row of each case
        if r["method"].startswith("ours"):
            ours.setdefault(r["case"], r)
    body = []
    for r in rows:
        o = ours.get(r["case"])
        ratio = "—"
        if o is not None and r is not o:
            f = [o[key] / r[key] if isinstance(o[key], float) and isinstance(r[key], float) and r[key] else None
                 for key in ("fwd_tflops", "fwd_bwd_tflops")]
            ratio = " / ".join(f"{x:.2f}x" if x is not None else "—" for x in f)
        gpu = " / ".join(f"{mhz:.0f} MHz {w:.0f} W" for mhz, w in r.get("gpu") or ()) or None
        body.append([r["case"], r["method"], r["fwd_ms"], r["bwd_ms"], r["fwd_bwd_ms"], r["fwd_tflops"],
                     r["fwd_bwd_tflops"], ratio, r.get("host_ms")] + ([gpu] if with_gpu else []))
    return markdown_table(["case", "method", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd+bwd TFLOP/s",
                           "ours vs it (fwd / fwd+bwd)", "host ms per fwd+bwd"]
                          + (["GPU clock and power (fwd / bwd / fwd+bwd)"] if with_gpu else []), body,
                          digits=[2, 2, 3, 3, 3, 0, 0, 2, 3, 0])


def plot_attention(rows, path):
    """Causal fwd+bwd TFLOP/s against sequence length, one panel per head dim and dtype of the sweep."""
    sweep = [r for r in rows if r["tag"] == "sweep"]
    if not sweep:
        return
    dims = sorted({int(r["case"].split("D=")[1].split()[0]) for r in sweep})
    dtypes = sorted({r["case"].split()[-1] for r in sweep})

    def draw(plt):
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
        return fig
    save_plot(path, draw)


_FLASH_VARIANTS = {}  # name -> (spec, module): a name's operators can be registered once per process


def flash_variant(spec):
    """'NAME=PATH[:ATTR=VALUE,...]' -> (NAME, module): a copy of flash.py (PATH; `flash.py` is this checkout's) loaded
    as a module of its own, with module-level settings set (VALUE a Python literal), so that kernel variants run side
    by side in one process, on one GPU state. The copy registers its operators under its own namespace (flash.py
    registers `flash::...`, which can exist once), and eager calls do not go through them."""
    import ast
    name, sep, rest = spec.partition("=")
    if name in _FLASH_VARIANTS:
        if _FLASH_VARIANTS[name][0] != spec:
            raise SystemExit(f"--variants: the name {name!r} is taken in this process by {_FLASH_VARIANTS[name][0]!r}")
        return name, _FLASH_VARIANTS[name][1]
    path, _, settings = rest.partition(":")
    if not (sep and name.isidentifier() and path):
        raise SystemExit(f"--variants: {spec!r} is not NAME=PATH[:ATTR=VALUE,...]")
    if not os.path.isfile(path):
        raise SystemExit(f"--variants: no such file: {path}")
    namespace = f"flash_{name}"
    with open(path) as f:
        source = f.read().replace('Library("flash", "FRAGMENT")', f'Library("{namespace}", "FRAGMENT")')
    source = source.replace("torch.ops.flash.", f"torch.ops.{namespace}.").replace('"flash::', f'"{namespace}::')
    module = type(sys)(namespace)
    module.__file__ = os.path.abspath(path)
    sys.modules[namespace] = module  # (the Triton and Gluon decorators look their functions' module up)
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    for item in filter(None, settings.split(",")):
        attr, sep, value = item.partition("=")
        if not sep or not hasattr(module, attr):
            raise SystemExit(f"--variants: {item!r}: flash.py has no setting {attr!r}")
        setattr(module, attr, ast.literal_eval(value))
    _FLASH_VARIANTS[name] = (spec, module)
    return name, module


def cmd_attention(argv):
    p = argparse.ArgumentParser(prog="bench.py attention", description="FlashAttention-2 vs PyTorch attention")
    p.add_argument("--quick", action="store_true", help="a few shapes (CPU: tiny interpreter smoke test)")
    p.add_argument("--json", help="write all rows to this JSON file")
    p.add_argument("--plot", help="write a PNG of the sweep (needs matplotlib)")
    p.add_argument("--rep", type=int, default=50, help="CUDA: ms of timed samples per measurement (median taken)")
    p.add_argument("--time_budget", type=float, default=0, help="seconds; cases that would start later are "
                   "marked skipped (0 = no limit)")
    p.add_argument("--parts", default="anchors,varlen,sweep", help="on CUDA without --quick, which case groups run "
                   "(in this order): anchors = the dense shapes B·S = 16384, H·D = 2048; varlen = packed "
                   "documents; sweep = one head, S 128..65536, D 16..128; work = D=64 at S 512..2048 over B·H "
                   "from 48 to 1024 (1.5 to 124 query tiles per SM): what flash.py picks, the Gluon and Triton "
                   "kernels each forced, beside cuDNN: where it should switch between them; sustained = the "
                   "anchors' long calls (S=16384 and the 8B model's S=32768) timed as a long run sees them, at the "
                   "clock the GPU's power limit leaves (bench.sustained_ms; --sustain). work and sustained are not "
                   "in the default")
    p.add_argument("--sustain", type=float, default=1.0, help="sustained part: seconds of warm-up and of timing for "
                   "each method and direction")
    p.add_argument("--methods", help="comma list of methods to time (default all: ours, ours-triton (on Hopper), "
                   "naive, sdpa-cudnn, sdpa-flash, sdpa-efficient, flex); packed documents follow the same names")
    p.add_argument("--variants", help="semicolon list NAME=PATH[:ATTR=VALUE,...]: copies of flash.py (edited "
                   "kernels, other settings) timed as methods 'ours@NAME' (packed: 'ours varlen@NAME') beside the "
                   "others, e.g. 'before=/tmp/flash_before.py;dkv_off=flash.py:GLUON_BWD_DKV_TMA=False'")
    p.add_argument("--repeat", type=int, default=1, help="run the cases this many times in turn (A/B runs: the "
                   "variance between rounds)")
    args = p.parse_args(argv)
    parts = csv_list(args.parts, ("anchors", "varlen", "sweep", "work", "sustained"))
    cuda = torch.cuda.is_available()
    allow_recompiles()  # FlexAttention compiles once per shape: past the default 8 it would fall back to eager
    methods = dense_methods()
    wanted = csv_list(args.methods, tuple(methods)) if args.methods else list(methods)
    methods = {n: m for n, m in methods.items() if n in wanted}
    for name, module in (flash_variant(spec) for spec in filter(None, (args.variants or "").split(";"))):
        methods[f"ours@{name}"] = ours_method(module)
    # Most important first (the dense shapes, then packed documents, then the sweep), so a time budget cuts the
    # least important rows. FlexAttention compiles once per shape: in the sweep it runs at a few lengths only.
    jobs = []  # (tag, b, h, s, d, dtype) or ("varlen", d)
    if not cuda:
        jobs += [("sweep", 1, 2, s, 16, torch.float32) for s in (16, 40)] + [("varlen", 16)]
    elif args.quick:
        jobs += [("sweep", 1, 16, s, d, torch.bfloat16) for d in (64, 128) for s in (1024, 4096)]
        jobs += [("varlen", 64), ("varlen", 128)]
    else:
        if "anchors" in parts:
            jobs += [("anchors", 16384 // s, 2048 // d, s, d, torch.bfloat16) for d, s in DENSE_SHAPES]
            jobs += [("anchors", 1, 32, 32768, 128, torch.bfloat16)]  # one sequence of the 8B leaderboard model
            jobs += [("anchors", 4, 32, 2048, 80, torch.bfloat16)]  # the 2.7B model's (config/xl.py) attention
        if "varlen" in parts:
            jobs += [("varlen", 64), ("varlen", 128)]
        if "sweep" in parts:
            jobs += [("sweep", 1, 1, s, d, dt) for d in SWEEP_D for s in SWEEP_SEQ
                     for dt in (torch.bfloat16, torch.float32)]
        if "work" in parts:
            jobs += [("work", b, h, s, 64, torch.bfloat16) for s in (512, 1024, 2048) for b, h in WORK_BH]
        if "sustained" in parts:
            jobs += [("sustained", b, h, s, d, torch.bfloat16) for b, h, s, d in SUSTAINED_SHAPES]
    n_cases = len(jobs)
    jobs *= max(args.repeat, 1)
    rows, t0 = [], time.time()
    for i, job in enumerate(jobs):
        if i % n_cases == 0:
            gen = torch.Generator().manual_seed(1)  # (every round on the same documents)
        if args.time_budget and time.time() - t0 > args.time_budget:
            print(f"time budget reached: {len(jobs) - i} cases skipped", flush=True)
            break
        if job[0] == "varlen":
            d = job[1]
            # on CUDA: log-normal lengths of median e^6 ~ 403, sigma 1, in [16, 4096], filling 16384 tokens
            lens = document_lengths(None, math.exp(6.0), 1.0, 4096, gen, total_tokens=16384).tolist() if cuda \
                else [1, 5, 17, 9]
            new = varlen_case(lens, 2048 // d if cuda else 2, d, torch.bfloat16 if cuda else torch.float32,
                              args.rep, methods=methods)
        else:
            tag, b, h, s, d, dt = job
            flex_ok = dt != torch.float32 and d >= 64 and (tag in ("anchors", "sustained") or s in (1024, 16384))
            if tag == "work":  # what flash.py picks, then each kernel family forced, beside cuDNN
                chosen = {n: m for n, m in methods.items() if n == "ours"}
                if hopper_kernels():
                    chosen["ours-gluon"] = forced_backend("gluon")
                chosen.update((n, m) for n, m in methods.items() if n in ("ours-triton", "sdpa-cudnn"))
            else:
                chosen = {n: m for n, m in methods.items() if n != "flex" or flex_ok}
            if tag == "sustained" and (i // n_cases) % 2:  # every other round in the opposite order
                chosen = dict(reversed(chosen.items()))
            new = dense_case(b, h, s, d, dt, chosen, args.rep, tag, args.sustain if tag == "sustained" else 0)
        for row in new if args.repeat > 1 else ():  # a case per round: "ours vs it" compares within one
            row["case"] += f" (round {i // n_cases + 1})"
        rows += new
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
# rmsnorm: our RMSNorm kernels against PyTorch's
# ---------------------------------------------------------------------------------------------------------------
#     python bench.py rmsnorm --json rmsnorm.json
# flash.rms_norm (the Triton forward and backward) beside model.RMSNorm's PyTorch ops compiled by inductor,
# F.rms_norm eager, and x.clone() (one read and one write of x: the copy bandwidth the norm can at best reach), at
# (tokens, d) = (32768, 4096) and (12288, 768) in bf16 (x, dy and g). Bytes moved: the forward reads x and writes y,
# the backward reads x and dy and writes dx, and each reads g (the 4 bytes a row of saved statistics are not
# counted); GB/s = bytes / time, and "% of copy" is that over the copy's GB/s at the same shape. Each time is the
# median of time_ms samples, every call with a cold L2 cache (12288 x 768 in bf16 would otherwise sit in it) and
# the GPU kept busy until the host has issued the call, so the times are the GPU's work alone (an eager autograd
# call costs more host time than these kernels take on the GPU).

RMSNORM_SHAPES = ((32768, 4096), (12288, 768))
RMSNORM_METHODS = ("ours", "inductor", "F.rms_norm", "copy")
RMSNORM_EPS = 1e-5


def rmsnorm_methods(weight, names):
    """name -> (y = f(x), the tensors f's backward differentiates besides x) for the methods asked for."""
    d = weight.shape[0]
    methods = {}
    if "ours" in names:
        methods["ours"] = (lambda x: flash.rms_norm(x, weight, RMSNORM_EPS), [weight])
    if "inductor" in names:
        norm = model_py.RMSNorm(d, eps=RMSNORM_EPS, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
        methods["inductor"] = (torch.compile(norm, dynamic=False), [norm.weight])
    if "F.rms_norm" in names:
        methods["F.rms_norm"] = (lambda x: F.rms_norm(x, (d,), weight, RMSNORM_EPS), [weight])
    if "copy" in names:
        methods["copy"] = (lambda x: x.clone(), None)  # forward only: the bandwidth ceiling
    return methods


def rmsnorm_rows(shapes, dtype, device, names=RMSNORM_METHODS, rep=50):
    """One row per (shape, method): fwd and fwd+bwd ms, bytes and GB/s (fwd+bwd: None for the copy)."""
    cuda = device.type == "cuda"
    rows = []
    for n, d in shapes:
        gen = torch.Generator(device=device).manual_seed(n + d)
        x = torch.randn(n, d, device=device, dtype=dtype, generator=gen).requires_grad_()
        dy = torch.randn(n, d, device=device, dtype=dtype, generator=gen)
        weight = (1 + 0.1 * torch.randn(d, device=device, generator=gen)).to(dtype).requires_grad_()
        act, g = n * d * x.element_size(), d * weight.element_size()
        fwd_bytes, bwd_bytes = 2 * act + g, 3 * act + g

        def median_ms(fn):
            return statistics.median(time_ms(fn, device, warmup=5 if cuda else 1, steps=3,
                                             budget_ms=rep if cuda else None, flush_l2=cuda, host_ahead=True))
        for name, (fn, params) in rmsnorm_methods(weight, names).items():
            fn(x)  # compiles (inductor) or warms the kernels up before timing
            t_f = median_ms(lambda: fn(x))
            t_fb = None
            if params is not None:
                t_fb = median_ms(lambda: torch.autograd.grad(fn(x), [x] + params, dy))
            rows.append(dict(shape=f"{n} x {d}", dtype=str(dtype)[6:], method=name, fwd_ms=t_f, fwd_bwd_ms=t_fb,
                             fwd_bytes=fwd_bytes, fwd_bwd_bytes=fwd_bytes + bwd_bytes,
                             fwd_gb_s=fwd_bytes / t_f / 1e6,
                             fwd_bwd_gb_s=None if t_fb is None else (fwd_bytes + bwd_bytes) / t_fb / 1e6,
                             bwd_gb_s=None if t_fb is None or t_fb <= t_f else bwd_bytes / (t_fb - t_f) / 1e6))
        del x, dy, weight
        free_memory(device)
    return rows


def rmsnorm_table(rows):
    """The Markdown table of rmsnorm_rows: ms, GB/s and % of the copy's GB/s at the same shape (the backward's: its
    bytes over the fwd+bwd time less the forward's)."""
    copy = {r["shape"]: r["fwd_gb_s"] for r in rows if r["method"] == "copy"}
    pct = lambda r, key: None if r[key] is None or r["shape"] not in copy else f"{100 * r[key] / copy[r['shape']]:.0f}%"
    body = [[r["shape"], r["method"], r["fwd_ms"], r["fwd_gb_s"], pct(r, "fwd_gb_s"), r["fwd_bwd_ms"],
             r["fwd_bwd_gb_s"], pct(r, "fwd_bwd_gb_s"), pct(r, "bwd_gb_s")] for r in rows]
    return markdown_table(["shape", "method", "fwd ms", "fwd GB/s", "fwd % of copy", "fwd+bwd ms", "fwd+bwd GB/s",
                           "fwd+bwd % of copy", "bwd % of copy"], body, digits=[0, 0, 3, 0, 0, 3, 0, 0, 0])


def cmd_rmsnorm(argv):
    p = argparse.ArgumentParser(prog="bench.py rmsnorm", description="RMSNorm forward and forward+backward: our "
                                "Triton kernels vs model.RMSNorm compiled by inductor, F.rms_norm and a copy (CUDA)")
    p.add_argument("--shapes", default=",".join(f"{n}x{d}" for n, d in RMSNORM_SHAPES),
                   help="comma list of TOKENSxD (default: %(default)s)")
    p.add_argument("--methods", default=",".join(RMSNORM_METHODS), help="comma list of: %(default)s")
    p.add_argument("--rep", type=int, default=50, help="ms of timed samples per measurement (median taken)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    names = csv_list(args.methods, RMSNORM_METHODS)
    shapes = [tuple(int(v) for v in s.split("x")) if re.fullmatch(r"[1-9]\d*x[1-9]\d*", s) else None
              for s in csv_list(args.shapes)]
    if not shapes or None in shapes:
        raise SystemExit(f"--shapes {args.shapes!r}: expected TOKENSxD items, e.g. 32768x4096,12288x768")
    if not torch.cuda.is_available():
        raise SystemExit("bench.py rmsnorm needs CUDA: it times GPU kernels (the tests run the kernels on CPU)")
    device = torch.device("cuda")
    info = run_info("rmsnorm", argv, device)
    print_header("bench.py rmsnorm", info)
    rows = rmsnorm_rows(shapes, torch.bfloat16, device, names, args.rep)
    print("bf16 x, dy and g; bytes: forward x read + y written, backward x and dy read + dx written, g read in "
          "each; % of copy: GB/s over x.clone()'s at the same shape; medians, cold L2\n")
    print(rmsnorm_table(rows))
    write_json(args.json, dict(info, rows=rows))
    return rows


def host_us(fn, calls, device):
    """Host time per call of fn in us: `calls` calls back to back, no sync inside the loop (on a shape small enough
    that the GPU keeps up, this is what a call costs the host)."""
    for _ in range(10):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    sync(device)
    return t


def launch_rows(head_dims, seqlen, calls, rounds, device):
    """Host us per call of flash.py's pieces, with its direct launches (flash.DIRECT_LAUNCH) and through Triton's
    kernel[grid], beside SDPA's; B=1, H=4, bf16, causal; the minimum over rounds (host timings are noisy)."""
    rows = []
    direct_modes = (True, False) if flash.DIRECT_LAUNCH else (False,)
    for d in head_dims:
        q, k, v = (torch.randn(1, 4, seqlen, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn_like(q)
        qn, kn, vn = (x.detach() for x in (q, k, v))
        args = (None, None, 0, 0, True, flash.BACKEND, None, None)
        o, lse = flash._forward(qn, kn, vn, *args)
        compiled_flash = torch.compile(lambda q, k, v: flash.flash_attention(q * 1.0, k, v) * 1.0)
        compiled_sdpa = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q * 1.0, k, v, is_causal=True)
                                      * 1.0)

        def no_grad(fn):
            def run():
                with torch.no_grad():
                    fn()
            return run
        pieces = {  # what: (ours, SDPA's or None)
            "forward launcher": (no_grad(lambda: flash._forward(qn, kn, vn, *args)),
                                 no_grad(lambda: F.scaled_dot_product_attention(qn, kn, vn, is_causal=True))),
            "backward launcher": (lambda: flash._backward(g, qn, kn, vn, o, lse, *args), None),
            "forward+backward, eager": (lambda: flash.flash_attention(q, k, v).backward(g),
                                        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)),
            "forward+backward, compiled": (lambda: compiled_flash(q, k, v).backward(g),
                                           lambda: compiled_sdpa(q, k, v).backward(g)),
        }
        kernels = "Gluon" if flash._gluon_supported(qn, kn, vn, None, None, 0) else "Triton"
        if flash.TRITON_OPS and kernels == "Triton":  # compiled, inductor launches the kernels; here through
            def library_ops():                          # flash's operators instead (a graph of its own: the compiler
                flash.TRITON_OPS = False                # guards on flash.TRITON_OPS)
                try:
                    compiled_flash(q, k, v).backward(g)
                finally:
                    flash.TRITON_OPS = True
            pieces["forward+backward, compiled, through flash's operators"] = (library_ops, None)
        best = collections.defaultdict(lambda: math.inf)
        try:
            for _ in range(rounds):
                for what, (ours, sdpa) in pieces.items():
                    for direct in direct_modes:
                        flash.DIRECT_LAUNCH = direct
                        best[what, direct] = min(best[what, direct], host_us(ours, calls, device))
                    if sdpa is not None:
                        best[what, "sdpa"] = min(best[what, "sdpa"], host_us(sdpa, calls, device))
        finally:
            flash.DIRECT_LAUNCH = direct_modes[0]
        for what in pieces:
            rows.append(dict(head_dim=d, seqlen=seqlen, kernels=kernels, what=what,
                             direct_us=best.get((what, True)), kernel_grid_us=best[what, False],
                             sdpa_us=best.get((what, "sdpa"))))
    return rows


def cmd_launch(argv):
    p = argparse.ArgumentParser(prog="bench.py launch", description="Host time of one flash.py call, piece by piece: "
                                "the launchers, a forward+backward eager and compiled, with direct launches and "
                                "through Triton's kernel[grid], beside SDPA (CUDA)")
    p.add_argument("--head_dims", default="64,128", help="comma list (64: the Triton kernels at this "
                   "small shape; 128: the Gluon ones on Hopper)")
    p.add_argument("--seqlen", type=int, default=256, help="small, so that the GPU keeps up with the host")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3, help="the minimum over this many rounds is reported")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    head_dims = csv_list(args.head_dims, cast=int)
    if not torch.cuda.is_available():
        raise SystemExit("bench.py launch needs CUDA: it times the host's side of GPU launches")
    device = torch.device("cuda")
    info = run_info("launch", argv, device)
    print_header("bench.py launch", info)
    rows = launch_rows(head_dims, args.seqlen, args.calls, args.rounds, device)
    print(f"B=1, H=4, S={args.seqlen}, bf16, causal; host us per call, no sync inside a loop of {args.calls} calls, "
          f"the minimum of {args.rounds} rounds\n")
    fmt = lambda x: "" if x is None else f"{x:.1f}"
    print(markdown_table(["head dim", "kernels", "what", "flash, direct launches", "flash, kernel[grid]", "sdpa"],
                         [[r["head_dim"], r["kernels"], r["what"], fmt(r["direct_us"]), fmt(r["kernel_grid_us"]),
                           fmt(r["sdpa_us"])] for r in rows]))
    write_json(args.json, dict(info, rows=rows))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# allreduce, ddp: collectives and data-parallel variants
# ---------------------------------------------------------------------------------------------------------------
def _env_line(device):
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
    return (f"`{' '.join(['torchrun ... bench.py'] + sys.argv[1:])}`, {datetime.date.today().isoformat()}, {what}, "
            f"torch {torch.__version__}")


def cmd_allreduce(argv):
    """All-reduce of fp32 tensors: per size, median and mean ms over timed iterations (each
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
    rows, records = [], []
    for mb in args.sizes_mb:
        nbytes = int(mb * 2**20)
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

        def refill_and_wait():  # values stay finite (a sum of ones grows N-fold per call); ranks start together
            x.fill_(1.0)
            dist.barrier()
        times = time_ms(lambda: dist.all_reduce(x), device, warmup=args.warmup, steps=args.iters,
                        setup=refill_and_wait)
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, times)
        slowest = [max(ts[i] for ts in per_rank) for i in range(args.iters)]  # a call ends when every rank has it
        median, mean = statistics.median(slowest), statistics.mean(slowest)
        algbw = x.numel() * 4 / (median / 1e3) / 2**30
        busbw = algbw * 2 * (world_size - 1) / world_size
        records.append(dict(size_mib=mb, world_size=world_size, median_ms=median, mean_ms=mean,
                            algbw_gib_s=algbw, busbw_gib_s=busbw, backend=dist.get_backend()))
        rows.append([f"{mb:g}", world_size, f"{median:.3f}", f"{mean:.3f}", f"{algbw:.1f}", f"{busbw:.1f}"])
        if rank == 0:
            print(f"all-reduce {mb:g} MiB: median {median:.3f} ms, busbw {busbw:.1f} GiB/s", flush=True)
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
        opt_cls = functools.partial(torch.optim.AdamW, fused=True) if cuda else torch.optim.AdamW
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
            comm, before, after, last = [], [], [], {}  # filled by every step, the warm-up ones included

            def step():
                with autocast():
                    logits = wrapped(x)
                loss = cross_entropy(logits, y)
                del logits
                loss.backward()
                if variant in ("naive", "flat"):
                    comm.append(time_ms(wrapped.finish, device)[0])
                else:
                    wrapped.finish()
                before.append(mem())
                optimizer.step()
                after.append(mem())
                optimizer.zero_grad(set_to_none=True)
                last["loss"] = loss.detach()
            steps = time_ms(step, device, warmup=args.warmup, steps=args.steps, setup=dist.barrier)
            per_rank = [None] * world_size
            dist.all_gather_object(per_rank, (steps, comm[args.warmup:]))
            slowest = [max(r[0][i] for r in per_rank) for i in range(args.steps)]  # a step ends on its last rank
            record["ms_per_step"] = statistics.median(slowest)
            if comm:
                record["comm_ms"] = statistics.median(max(r[1][i] for r in per_rank) for i in range(args.steps))
            record["peak_before_step_gib"] = max(before)
            record["peak_after_step_gib"] = max(after)
            record["optimizer_state_gib"] = _optimizer_state_bytes(optimizer) / gib
            loss = last["loss"]  # the last step's
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
# hf: a Hugging Face GPT-2 trained on variable-length documents: padded, dynamically padded and padding-free
# batches, with SDPA, our kernels (hf.register_hf_attention) and FlexAttention, the same documents for every row
# ---------------------------------------------------------------------------------------------------------------
#     python bench.py hf --json hf.json --plot hf.png
#     python bench.py hf --n_layer 2 --n_embd 64 --steps 2      # a small run (on CPU: the interpreter, tiny sizes)
# Every step trains on the same number of whole documents (so padded rows keep one shape and compile once); the
# rows differ only in how those documents are laid out and attended. transformers is imported inside cmd_hf.

HF_DEFAULTS = dict(  # (CUDA, CPU): GPT2Config's shape on the GPU; a tiny model for the Triton interpreter on CPU
    n_layer=(12, 2), n_embd=(768, 64), n_head=(12, 4), n_positions=(1024, 32), vocab_size=(50257, 257),
    median_len=(200.0, 20.0), tokens=(16384, 64), warmup=(3, 1), steps=(10, 1))
HF_ROWS = {  # key: (label, attn_implementation, layout, compiled); "ours" is what register_hf_attention adds
    "sdpa_pad": ("sdpa, padded to n_positions", "sdpa", "pad", False),
    "sdpa_pad_compiled": ("sdpa, padded to n_positions, compiled", "sdpa", "pad", True),
    "sdpa_dynamic": ("sdpa, dynamic padding (batch's longest)", "sdpa", "dynamic", False),
    "ours_pad": ("ours, padded to n_positions", "ours", "pad", False),
    "ours_packed": ("ours, padding-free", "ours", "packed", False),
    "ours_packed_compiled": ("ours, padding-free, compiled", "ours", "packed", True),
    "flex_packed": ("flex_attention, padding-free", "flex_attention", "packed_fixed", False),
}


def hf_batches(lengths, docs_per_step, steps, vocab_size, generator):
    """`steps` batches of `docs_per_step` documents each (lists of token ids), consecutive draws of `lengths`."""
    tokens = [torch.randint(vocab_size, (int(n),), generator=generator).tolist() for n in lengths]
    return [tokens[i * docs_per_step:(i + 1) * docs_per_step] for i in range(steps)]


def hf_padded(docs, length):
    """One document per row, right-padded to `length`: input_ids, attention_mask, labels (-100 on pads)."""
    ids = torch.zeros(len(docs), length, dtype=torch.long)
    mask = torch.zeros(len(docs), length, dtype=torch.long)
    for r, d in enumerate(docs):
        ids[r, :len(d)] = torch.tensor(d)
        mask[r, :len(d)] = 1
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def hf_packed(docs, flash_kwargs, fixed_length=None, max_doc=None):
    """The documents in one row by transformers' DataCollatorWithFlattening (position_ids restart per document,
    each document's first label -100); flash_kwargs adds cu_seq_lens_q/k and max_length_q/k. fixed_length: filler
    documents of at most max_doc tokens, every label -100, take the row to that length (one shape per step)."""
    from transformers import DataCollatorWithFlattening
    features = [{"input_ids": d, "labels": d} for d in docs]  # labels on every feature: the collator reads
    # them from all features only when the first one has them (else fillers would be targets)
    if fixed_length is not None:
        left = fixed_length - sum(len(d) for d in docs)
        if left < 0:
            raise ValueError(f"hf_packed: {-left} tokens more than fixed_length {fixed_length}")
        while left > 0:
            n = min(left, max_doc)
            features.append({"input_ids": [0] * n, "labels": [-100] * n})
            left -= n
    return dict(DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(features))


def hf_counting_backend(name):
    """A torch.compile backend that counts the graphs it is handed (one per compile or recompile of a frame)."""
    inner = torch._dynamo.lookup_backend(name)
    count = [0]

    def backend(gm, example_inputs, **kwargs):
        count[0] += 1
        return inner(gm, example_inputs, **kwargs)
    return backend, count


def hf_train_row(key, args, cfg, init_state, batches, device):
    """Train one row's model for warmup + steps batches; returns the row dict (status "ok" or why not)."""
    import copy  # the config is copied: transformers writes the attention implementation into it
    from transformers import AutoModelForCausalLM
    label, attn, layout, compiled = HF_ROWS[key]
    cuda = device.type == "cuda"
    row = dict(key=key, strategy=label, attn=attn, layout=layout, compiled=compiled, status="ok")
    if attn == "flex_attention":
        from transformers.utils import is_torch_flex_attn_available
        if not is_torch_flex_attn_available():
            row["status"] = "not run: this transformers/torch has no FlexAttention"
            return row
    real = [sum(len(d) for d in docs) for docs in batches]
    net = optimizer = runner = None
    try:
        if layout == "pad":
            inputs = [hf_padded(docs, args.n_positions) for docs in batches]
        elif layout == "dynamic":
            inputs = [hf_padded(docs, max(len(d) for d in docs)) for docs in batches]
        elif layout == "packed":
            inputs = [hf_packed(docs, flash_kwargs=True) for docs in batches]
            if compiled:  # max_length only bounds the longest document: a constant compiles once
                for batch in inputs:
                    batch["max_length_q"] = batch["max_length_k"] = args.n_positions
        else:  # FlexAttention compiles its kernel for each new length: every row padded to one length
            fixed = -(-max(real) // 128) * 128
            inputs = [hf_packed(docs, flash_kwargs=False, fixed_length=fixed, max_doc=args.n_positions)
                      for docs in batches]
        inputs = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()} for batch in inputs]
        row.update(real_tokens=sum(real[args.warmup:]),
                   token_slots=sum(b["input_ids"].numel() for b in inputs[args.warmup:]))
        torch._dynamo.reset()
        net = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn).to(device)
        net.load_state_dict(init_state)
        net.loss_type = "ForCausalLM"  # GPT-2 names no loss type: transformers would warn, a graph break
        net.train()
        optimizer = torch.optim.AdamW(net.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
        count = [0]
        runner = net
        if compiled:
            backend, count = hf_counting_backend(args.backend)
            runner = torch.compile(net, backend=backend)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
        times, compiles_warmup = [], 0
        for i, batch in enumerate(inputs):
            if compiled and layout == "packed":  # documents change the row's length every step
                for name in ("input_ids", "labels", "position_ids"):
                    torch._dynamo.mark_dynamic(batch[name], 1)
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with amp:
                loss = runner(**batch).loss
            loss.backward()
            optimizer.step()
            sync(device)
            dt = time.perf_counter() - t0
            if i == 0:
                row["loss_first_batch"] = float(loss.detach())
            if i < args.warmup:
                compiles_warmup = count[0]
            else:
                times.append(dt)
        row.update(ms_per_step=1e3 * statistics.fmean(times), std_ms=statistics.stdev(times) if len(times) > 1 else 0.0,
                   tokens_per_s=row["real_tokens"] / sum(times),
                   peak_mib=mib(torch.cuda.max_memory_allocated(device)) if cuda else None,
                   compiles=(compiles_warmup, count[0] - compiles_warmup) if compiled else None)
    except Exception as e:  # one failing strategy (OOM, unsupported here) is a row that says why, in one line
        first = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:140]
        row["status"] = "OOM" if is_oom(e) else f"{type(e).__name__}: {first}"
        print(f"{label}: {type(e).__name__}: {e}", file=sys.stderr)
        if not isinstance(e, (ValueError, NotImplementedError)) and not is_oom(e):
            traceback.print_exception(e, file=sys.stderr)
        row.pop("token_slots", None)
    finally:
        net = optimizer = runner = None
        free_memory(device)
    return row


def cmd_hf(argv):
    p = argparse.ArgumentParser(prog="bench.py hf", description="A transformers GPT2LMHeadModel trained on "
                                "variable-length documents: SDPA padded / dynamically padded, ours padded / "
                                "padding-free, FlexAttention padding-free; the same documents for every row.")
    for key, (gpu, cpu) in HF_DEFAULTS.items():
        flags = [f"--{key}"] + ({"steps": ["-n"], "warmup": ["-w"], "tokens": ["-t"]}.get(key, []))
        p.add_argument(*flags, type=type(gpu), default=None, help=f"default {gpu} on CUDA, {cpu} on CPU")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of document lengths")
    p.add_argument("-r", "--rows", default=",".join(HF_ROWS), help=f"comma list of {', '.join(HF_ROWS)}")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor on CUDA, aot_eager "
                   "on CPU)")
    add_common_args(p, plot_help="bar chart of real tokens/s per row")
    args = p.parse_args(argv)
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    for key, (gpu, cpu) in HF_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, gpu if cuda else cpu)
    args.backend = args.backend or ("inductor" if cuda else "aot_eager")
    keys = csv_list(args.rows, HF_ROWS)
    if args.steps < 1 or args.warmup < 0 or args.tokens < 1:
        raise SystemExit("--steps must be >= 1, --warmup >= 0 and --tokens >= 1")
    try:
        from transformers import AutoModelForCausalLM, GPT2Config
    except ImportError:
        raise SystemExit("bench.py hf needs transformers: pip install -r requirements-hf.txt")
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    hf.register_hf_attention("ours")
    allow_recompiles()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    info = run_info("hf", argv, device)
    print_header("bench.py hf", info)

    # the documents: log-normal lengths clipped to [16, n_positions]; a step holds the number of whole documents
    # whose expected length adds up to --tokens
    g = torch.Generator().manual_seed(args.seed)
    probe = document_lengths(100_000, args.median_len, args.sigma, args.n_positions, g)
    docs_per_step = max(1, round(args.tokens / probe.double().mean().item()))
    n_steps = args.warmup + args.steps
    lengths = document_lengths(docs_per_step * n_steps, args.median_len, args.sigma, args.n_positions, g)
    batches = hf_batches(lengths, docs_per_step, n_steps, args.vocab_size, g)
    # GPT2Config defaults but no dropout: our kernels have none, and first-batch losses must be comparable
    cfg = GPT2Config(vocab_size=args.vocab_size, n_positions=args.n_positions, n_embd=args.n_embd,
                     n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(args.seed)
    init = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    init_state = {k: v.clone() for k, v in init.state_dict().items()}
    params = sum(p.numel() for p in init.parameters())
    del init
    per_step = [sum(len(d) for d in docs) for docs in batches]
    print(f"GPT2LMHeadModel (GPT2Config defaults but: {args.n_layer} layers, n_embd {args.n_embd}, {args.n_head} "
          f"heads, n_positions {args.n_positions}, vocab {args.vocab_size}; dropout 0), {params / 1e6:.1f}M "
          f"parameters, random init (the same weights for every row), "
          f"{'bf16 autocast' if cuda else 'fp32'}, torch AdamW{' (fused)' if cuda else ''}. Documents: log-normal "
          f"lengths, median {args.median_len:g}, sigma {args.sigma:g}, clipped to [16, {args.n_positions}], random "
          f"tokens; {docs_per_step} whole documents per step ({statistics.fmean(per_step):,.0f} real tokens on "
          f"average, {min(per_step):,}-{max(per_step):,}), {args.warmup} warm-up + {args.steps} timed steps, the "
          f"same batches for every row. Compiled rows: torch.compile(backend={args.backend}); padding-free rows "
          f"take DataCollatorWithFlattening's cu_seq_lens (compiled: max_length = n_positions, a bound, and the row "
          f"length marked dynamic); flex_attention's row is filled to one length with label-less filler documents "
          f"(it compiles its kernel per length).\n", flush=True)

    rows, t_start = [], time.perf_counter()
    for key in keys:
        rows.append(hf_train_row(key, args, cfg, init_state, batches, device))
        r = rows[-1]
        progress(len(rows), len(keys), t_start, f"{r['strategy']}: " + (
            f"{r['ms_per_step']:.1f} ms/step, {fmt(r['tokens_per_s'])} real tokens/s" if r["status"] == "ok"
            else r["status"]))
    base = next((r for r in rows if r["key"] == "sdpa_pad" and r["status"] == "ok"), None)
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base and r["status"] == "ok" else None
    body = [[r["strategy"],
             f"{r['ms_per_step']:.1f} ± {r['std_ms']:.1f}" if r["status"] == "ok" else r["status"],
             r.get("tokens_per_s"), f"{r['speedup']:.2f}x" if r["speedup"] else "—",
             f"{100 * r['real_tokens'] / r['token_slots']:.0f}%" if r.get("token_slots") else "—", r.get("peak_mib"),
             fmt(r.get("loss_first_batch"), 5) if r.get("loss_first_batch") is not None else "—",
             f"{r['compiles'][0]} + {r['compiles'][1]}" if r.get("compiles") else "—"]
            for r in rows]
    print(markdown_table(["strategy", "ms/step", "real tokens/s", "speedup vs sdpa padded", "real / slots",
                          "peak MiB", "loss, batch 1", "graphs compiled (warm-up + timed)"], body))
    print("Speedup: real tokens/s over the uncompiled sdpa padded row. Loss, batch 1: before any update, the same "
          "weights and targets in every row, so strategies that keep documents apart agree. Graphs compiled: the "
          "timed steps' count is 0 when the compiled model did not recompile for new batches.\n")
    write_json(args.json, dict(info, docs_per_step=docs_per_step, rows=rows))

    def draw(plt):
        ok = [r for r in rows if r["status"] == "ok"]
        fig, ax = plt.subplots(figsize=(8, 0.5 * len(ok) + 1.5))
        ax.barh([r["strategy"] for r in ok][::-1], [r["tokens_per_s"] / 1e3 for r in ok][::-1])
        ax.set(xlabel="thousand real tokens/s", title=f"GPT-2 ({args.n_layer} layers) on variable-length documents")
        return fig
    save_plot(args.plot, draw)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# bpe: our tokenizer's training vs HF tokenizers, its encoding vs tiktoken
# ---------------------------------------------------------------------------------------------------------------

def cmd_bpe(argv):
    """Our byte-level BPE side by side with the libraries: training (bpe.train_bpe vs HF tokenizers' BpeTrainer,
    each run in a fresh process, see bpe_train_child: wall seconds and peak RSS of the main process and of its
    largest worker) and encoding of the whole corpus with our vocabulary (Tokenizer.encode, encode_batch and
    encode_file vs tiktoken built from the same ranks: MB/s, median of --repeats, the ids checked equal)."""
    import tiktoken
    from bpe import GPT2_PAT, Tokenizer, peak_rss_mb
    p = argparse.ArgumentParser(prog="bench.py bpe", description=cmd_bpe.__doc__)
    p.add_argument("--input", required=True, help="UTF-8 corpus, documents joined by --special "
                   "(data/bench_corpus.py builds a 50 MB one)")
    p.add_argument("--vocab_size", type=int, default=10000)
    p.add_argument("--special", default="<|endoftext|>")
    p.add_argument("--num_workers", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    path, special, workers, repeats = args.input, args.special, args.num_workers, args.repeats
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        raise SystemExit(f"--input {path}: " + ("the file is empty" if os.path.isfile(path) else "no such file"))
    if repeats < 1 or workers < 1 or not special:
        raise SystemExit("--repeats and --num_workers must be >= 1 and --special non-empty")
    cpu = torch.device("cpu")
    info = run_info("bpe", argv, cpu)
    print_header("bench.py bpe", info)
    size = os.path.getsize(path)
    have_hf = importlib.util.find_spec("tokenizers") is not None
    print(f"{path}: {size / 1e6:.1f} MB, vocab_size {args.vocab_size}, {workers} workers of {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, tiktoken {tiktoken.__version__}"
          + ("" if have_hf else "; HF tokenizers is not installed: its rows are left empty") + "\n", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench_bpe_") as tok_dir:
        train = {"ours": [], "hf": []}
        for which in ("ours", "hf") * repeats:
            if which == "hf" and not have_hf:
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "_bpe_train", which, path, str(args.vocab_size),
                   special, str(workers), tok_dir]
            r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if r.returncode != 0:
                raise SystemExit(f"bench.py bpe: the {which} training run failed:\n{r.stderr.strip()[-2000:]}")
            train[which].append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(f"train {which}: {train[which][-1]}", file=sys.stderr, flush=True)
        tok = Tokenizer.from_files(os.path.join(tok_dir, "vocab.json"), os.path.join(tok_dir, "merges.txt"),
                                   [special])
    median_s = {w: statistics.median(x["seconds"] for x in runs) if runs else None for w, runs in train.items()}
    body = []
    for which, label in (("ours", "bpe.train_bpe"), ("hf", "HF tokenizers BpeTrainer (ByteLevel)")):
        runs = train[which]
        body.append([label, median_s[which], ", ".join(fmt(x["seconds"], 1) for x in runs) or None,
                     max((x["rss_mb"] for x in runs), default=None),
                     max((x["worker_rss_mb"] for x in runs), default=None)])
    print(markdown_table([f"train, vocab {args.vocab_size}, {workers} workers", f"wall s (median of {repeats})",
                          "all runs", "peak RSS main MB", "peak RSS largest worker MB"], body, digits=[2, 1, 2, 0, 0]))
    ratio = median_s["ours"] / median_s["hf"] if median_s["hf"] else None
    print(f"ratio ours / HF: {fmt(ratio)}x (goal <= 2x)\n" if ratio else "ratio ours / HF: —\n", flush=True)

    peer = tiktoken.Encoding("peer", pat_str=GPT2_PAT, mergeable_ranks=tok._tiktoken_ranks(),
                             special_tokens=dict(tok.special_ids))
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    pieces, piece = [], []  # ~1 MB pieces of whole documents for the batch APIs
    for d in text.split(special):
        piece.append(d)
        if sum(map(len, piece)) > 1 << 20:
            pieces.append(special.join(piece) + special)
            piece = []
    pieces.append(special.join(piece))

    def timed(fn):
        """(median seconds over --repeats calls, the last call's result)."""
        out = {}
        ms = time_ms(lambda: out.__setitem__("result", fn()), cpu, steps=repeats)
        return statistics.median(ms) / 1e3, out["result"]

    def same(ours, theirs, what):
        if ours != theirs:
            raise SystemExit(f"bench.py bpe: {what} gives other ids than tiktoken on {path}")

    cases = []
    t_ours, ids_ours = timed(lambda: tok.encode(text))
    t_peer, ids_peer = timed(lambda: peer.encode(text, allowed_special="all"))
    same(ids_ours, ids_peer, "Tokenizer.encode")
    cases.append(("1 thread: Tokenizer.encode(text) vs tiktoken encode(text, allowed_special='all')", t_ours, t_peer))
    t_ours, b_ours = timed(lambda: tok.encode_batch(pieces, workers))
    t_peer, b_peer = timed(lambda: peer.encode_batch(pieces, num_threads=workers, allowed_special="all"))
    same(b_ours, b_peer, "Tokenizer.encode_batch")
    cases.append((f"{workers} threads: Tokenizer.encode_batch(1 MB pieces) vs tiktoken encode_batch", t_ours, t_peer))
    t_file, arrays = timed(lambda: list(tok.encode_file(path, workers, verbose=False)))
    same(np.concatenate(arrays).tolist(), ids_peer, "Tokenizer.encode_file")
    cases.append((f"{workers} threads: Tokenizer.encode_file(path) (reads the file) vs tiktoken encode_batch",
                  t_file, t_peer))
    n_tokens = len(ids_peer)
    encode = [dict(case=label, ours_s=t_o, tiktoken_s=t_p, ours_mb_s=size / t_o / 1e6, tiktoken_mb_s=size / t_p / 1e6,
                   ours_vs_tiktoken=t_p / t_o) for label, t_o, t_p in cases]
    print(markdown_table([f"encode {size / 1e6:.1f} MB, {n_tokens:,} tokens ({size / n_tokens:.2f} bytes/token)",
                          "ours MB/s", "tiktoken MB/s", "ours / tiktoken"],
                         [[e["case"], e["ours_mb_s"], e["tiktoken_mb_s"], e["ours_vs_tiktoken"]] for e in encode],
                         digits=[2, 1, 1, 2]))
    rss = peak_rss_mb()[0]
    print(f"peak RSS of this process (encode side, bench.py's torch import included): {rss:.0f} MB", flush=True)
    result = dict(info, bytes=size, tokens=n_tokens, vocab_size=args.vocab_size, workers=workers, repeats=repeats,
                  train=train, train_median_s=median_s, ours_vs_hf=ratio, encode=encode, encode_peak_rss_mb=rss)
    write_json(args.json, result)
    return result


# ---------------------------------------------------------------------------------------------------------------
# leaderboard: the full training step of the 8B configuration, ours beside a PyTorch-native peer
# ---------------------------------------------------------------------------------------------------------------

LEADERBOARD = dict(vocab_size=151936, context_length=32768, d_model=4096, num_layers=34, num_heads=32, d_ff=11008)


class NativeBlock(nn.Module):
    """The same pre-norm block written the way a PyTorch user would: nn.RMSNorm, one qkv projection, RoPE on
    adjacent pairs, F.scaled_dot_product_attention on cuDNN, a fused w1/w3 projection, F.silu."""

    def __init__(self, d_model, num_heads, d_ff):
        super().__init__()
        self.num_heads = num_heads
        self.ln1, self.ln2 = nn.RMSNorm(d_model, eps=1e-5), nn.RMSNorm(d_model, eps=1e-5)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.w13 = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        rot = lambda t: torch.stack((t[..., 0::2].float() * cos - t[..., 1::2].float() * sin,
                                     t[..., 0::2].float() * sin + t[..., 1::2].float() * cos), -1).flatten(-2)
        q, k = rot(q).to(v.dtype), rot(k).to(v.dtype)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] if x.is_cuda else [SDPBackend.MATH]
        with sdpa_kernel(backends):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
        g, u = self.w13(self.ln2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(g) * u)


class NativeLM(nn.Module):
    """The PyTorch-native peer of TransformerLM (same architecture and FLOPs): torch.nn layers, SDPA, fp32
    logits into F.cross_entropy; act_ckpt checkpoints every block."""

    def __init__(self, vocab_size, context_length, d_model, num_layers, num_heads, d_ff, act_ckpt=True):
        super().__init__()
        self.act_ckpt = act_ckpt
        self.emb = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(NativeBlock(d_model, num_heads, d_ff) for _ in range(num_layers))
        self.ln = nn.RMSNorm(d_model, eps=1e-5)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        d_k = d_model // num_heads
        inv = 10000.0 ** (-torch.arange(0, d_k, 2, dtype=torch.float32) / d_k)
        angles = torch.arange(context_length, dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        # the tables in the activations' dtype: FSDP2 casts block inputs in the forward but not when a checkpointed
        # block is recomputed, so they must arrive in that dtype already
        cos, sin = self.cos[:idx.shape[1]].to(x.dtype), self.sin[:idx.shape[1]].to(x.dtype)
        for block in self.blocks:
            x = (torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False) if self.act_ckpt
                 else block(x, cos, sin))
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def leaderboard_flops(vocab_size, context_length, d_model, num_layers, d_ff, tokens):
    """Model FLOPs of one training step (3 x forward, causal half of the T^2 terms, recomputation not counted)."""
    return flops_per_token(vocab_size, context_length, d_model, num_layers, d_ff, causal=True) * tokens


def cmd_leaderboard(argv):
    t_process = time.time()
    p = argparse.ArgumentParser(prog="bench.py leaderboard", description="The 8B training step (d_model 4096, d_ff "
                                "11008, 34 layers, 32 heads, vocab 151,936, context 32,768, two sequences in all, "
                                "bf16, causal): ours beside the PyTorch-native peer, ms/step by "
                                "triton.testing.do_bench, peak memory, MFU, cold start. Run under torchrun (one "
                                "sequence per rank on several GPUs; on one GPU --num_layers to fit).")
    p.add_argument("--num_layers", type=int, default=LEADERBOARD["num_layers"])
    p.add_argument("--context_length", type=int, default=LEADERBOARD["context_length"])
    p.add_argument("--batch_size", type=int, default=1, help="sequences per rank (the leaderboard's two sequences "
                   "are one per rank on two GPUs; on one GPU, one sequence is a proxy of one rank's share)")
    p.add_argument("--act_ckpt_layers", type=int, default=-1, help="how many of the first blocks recompute their "
                   "activations in backward (-1: every block)")
    p.add_argument("--selective_recompute", action="store_true", help="the other blocks keep only their matmul and "
                   "attention outputs")
    p.add_argument("--warmup_ms", type=float, default=10_000, help="do_bench warm-up (the rules: 10,000)")
    p.add_argument("--rep_ms", type=float, default=30_000, help="do_bench repetitions (the rules: 30,000)")
    p.add_argument("--compile", choices=("none", "blocks"), default="blocks")
    p.add_argument("--runs", default="ours,peer", help="comma list: ours, peer")
    add_common_args(p)
    args = p.parse_args(argv)
    import triton
    rank, _, world, device = ddp.init_distributed()
    if device.type != "cuda":
        raise SystemExit("bench.py leaderboard needs CUDA GPUs (run under torchrun)")
    runs = csv_list(args.runs, ("ours", "peer"))
    if "peer" in runs and not torch.distributed.is_initialized():
        raise SystemExit("the peer uses FSDP2: run under torchrun, e.g. torchrun --standalone --nproc_per_node=1 "
                         "bench.py leaderboard --num_layers 4")
    cfg = dict(LEADERBOARD, num_layers=args.num_layers, context_length=args.context_length)
    batch = args.batch_size
    n_ckpt = args.num_layers if args.act_ckpt_layers < 0 else args.act_ckpt_layers
    info = run_info("leaderboard", argv, device)
    if rank == 0:
        print_header("bench.py leaderboard", info)
    gen = torch.Generator(device=device).manual_seed(args.seed + rank)
    idx = torch.randint(0, cfg["vocab_size"], (batch, cfg["context_length"]), device=device, generator=gen)
    tgt = torch.randint(0, cfg["vocab_size"], (batch, cfg["context_length"]), device=device, generator=gen)
    flops = leaderboard_flops(cfg["vocab_size"], cfg["context_length"], cfg["d_model"], cfg["num_layers"],
                              cfg["d_ff"], batch * world * cfg["context_length"])
    rows = []

    def measure_step(name, step):
        t0 = time.time()
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize()
        first = time.time()
        ms = triton.testing.do_bench(step, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
        row = dict(name=name, ms=ms, peak_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                   mfu=flops / (ms / 1e3) / world / PEAK_FLOPS, first_step_s=first - t0,
                   cold_start_s=first - t_process)
        rows.append(row)
        if rank == 0:
            print(f"{name}: {ms:.0f} ms/step, peak {row['peak_gib']:.1f} GiB, MFU {100 * row['mfu']:.1f}%, first "
                  f"step {row['first_step_s']:.1f} s ({row['cold_start_s']:.0f} s since start)", file=sys.stderr,
                  flush=True)

    if "ours" in runs:
        torch.manual_seed(args.seed)
        net = TransformerLM(**cfg, attn_impl="flash", act_ckpt_every=1, act_ckpt_layers=n_ckpt,
                            selective_recompute=args.selective_recompute, device=device)
        if args.compile == "blocks":
            compiled(net, "blocks")
        wrapped = ddp.wrap(net, "fsdp" if world > 1 else "none", compute_dtype=torch.bfloat16)
        opt = wrapped.make_optimizer(AdamW, lr=1e-3)

        def ours_step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = wrapped(idx, targets=tgt)  # mean loss through the fused head (no full logits)
            loss.backward()
            wrapped.finish()
            opt.step()
        measure_step(f"ours (flash, fused head, {n_ckpt}/{cfg['num_layers']} blocks recomputed"
                     f"{', selective recompute in the rest' if args.selective_recompute else ''}, "
                     f"{'our FSDP bf16' if world > 1 else 'one GPU'}, compile {args.compile})", ours_step)
        del net, wrapped, opt
        free_memory(device)
    if "peer" in runs:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        with torch.device("meta"):
            peer = NativeLM(**cfg, act_ckpt=True)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in peer.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(peer, mp_policy=mp)
        peer.to_empty(device=device)
        torch.manual_seed(args.seed)
        for m in peer.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02 if isinstance(m, nn.Linear) else 1.0)
            elif isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)
        d_k = cfg["d_model"] // cfg["num_heads"]
        inv = 10000.0 ** (-torch.arange(0, d_k, 2, dtype=torch.float32, device=device) / d_k)
        ang = torch.arange(cfg["context_length"], dtype=torch.float32, device=device)[:, None] * inv[None, :]
        peer.cos, peer.sin = ang.cos(), ang.sin()
        peer_opt = torch.optim.AdamW(peer.parameters(), lr=1e-3, fused=True)

        def peer_step():
            peer_opt.zero_grad(set_to_none=True)
            peer(idx, tgt).backward()
            peer_opt.step()
        measure_step("peer: torch FSDP2 per block (bf16 params, fp32 reduce), every block recomputed, SDPA cuDNN, "
                     "nn.RMSNorm, fused torch AdamW, fp32 logits", peer_step)
        del peer, peer_opt
        free_memory(device)
    if rank == 0:
        peer_ms = next((r["ms"] for r in rows if r["name"].startswith("peer")), None)
        print(f"{cfg['num_layers']} layers, context {cfg['context_length']}, {batch} sequence(s) per rank, {world} "
              f"rank(s); model FLOPs {flops:.3e} per step (3 x forward, causal half of the T^2 terms); MFU against "
              f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s per GPU; do_bench warm-up {args.warmup_ms:.0f} ms, rep "
              f"{args.rep_ms:.0f} ms; cold start = process start to the end of the first step.\n")
        print(markdown_table(["run", "ms/step", "vs peer", "peak GiB", "MFU", "first step s", "cold start s"],
                             [[r["name"], r["ms"], f"{r['ms'] / peer_ms:.2f}x" if peer_ms else "-", r["peak_gib"],
                               f"{100 * r['mfu']:.1f}%", r["first_step_s"], r["cold_start_s"]] for r in rows]))
        write_json(args.json, dict(info, rows=rows))
    ddp.cleanup_distributed()
    return rows


# ---------------------------------------------------------------------------------------------------------------
# sass: what the compiler made of flash.py's attention kernels for an H100/H200 (sm_90), on any machine
# ---------------------------------------------------------------------------------------------------------------

SASS_TYPES = {"LSE": "*fp32", "DELTA": "*fp32", "COS": "*fp32", "SIN": "*fp32",
               "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "counter": "*i32", "qk_scale": "fp32",
               "sm_scale": "fp32", **{t: "*bf16" for t in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}}


def sass_stats(kernel_fn, signature, constexprs, options, gluon_source=False, attrs=None):
    """(registers, stack bytes, spill loads, spill stores, SASS instructions, shared memory in KiB, wgmma
    serialized?) of one kernel compiled for sm_90 with this Triton, read with the cuobjdump and ptxas its package
    carries."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    source = ASTSource
    if gluon_source:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    kernel = triton.compile(source(fn=kernel_fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        run = lambda *a: subprocess.run(a, capture_output=True, text=True)
        res = run(os.path.join(tools, "cuobjdump"), "-res-usage", cubin).stdout
        sass = run(os.path.join(tools, "cuobjdump"), "-sass", cubin).stdout
        notes = run(os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin).stderr
    usage = dict(t.split(":", 1) for t in next(l for l in res.splitlines() if "REG:" in l).split() if ":" in t)
    instr = sum(1 for line in sass.splitlines() if line.strip().startswith("/*") and "*/" in line.strip()[2:])
    # a warp-specialized kernel launches with usage["REG"] a thread and then moves registers between its partitions
    # (setmaxnreg): the highest register its code names tells what its busiest partition uses
    registers = int(usage["REG"])
    if "SETMAXREG" in sass:
        used = 1 + max(int(r) for r in re.findall(r"\bR(\d+)\b", sass))
        registers = f"{registers} at launch, {used} used"
    return [registers, int(usage["STACK"]), sass.count(" LDL"), sass.count(" STL"), instr,
            round(kernel.metadata.shared / 1024, 1),
            "yes" if "wgmma.mma_async instructions are serialized" in notes else "no"]  # (notes C7514, C7515, ...)


def cmd_sass(argv):
    """Compile the attention kernels for sm_90 without a GPU and print registers, spills, SASS size, shared memory
    (an H100/H200 block has at most 227 KiB) and whether ptxas serialized the tensor-core (wgmma) instructions (its
    notes C7514/C7515: with it, the dK/dV pass ran 16-20% slower). Run it after changing a kernel's loop structure
    or a config, with the Triton the GPU machine has, installed aside:
        pip install --no-deps --target /tmp/triton36 triton==3.6.0
        PYTHONPATH=/tmp/triton36 python bench.py sass"""
    p = argparse.ArgumentParser(prog="bench.py sass", description=cmd_sass.__doc__.split("\n")[0])
    p.add_argument("--head_dims", default="128,64")
    p.add_argument("--no_specialize", action="store_true", help="ignore do_not_specialize (all ints specialized)")
    p.add_argument("--varlen", action="store_true", help="the packed (variable-length) kernels instead of dense")
    p.add_argument("--full", action="store_true", help="non-causal instead of causal")
    p.add_argument("--rope", action="store_true", help="the Triton kernels with RoPE applied inside (ROPE=True)")
    args = p.parse_args(argv)
    if flash.INTERPRET:  # the kernels were defined for the interpreter: compile them in a process that does not
        env = dict(os.environ, TRITON_INTERPRET="0")
        return subprocess.run([sys.executable, os.path.abspath(__file__), "sass"] + argv, env=env).returncode
    import triton
    how = "every int specialized" if args.no_specialize else \
        "integer arguments marked divisible by 16 as at the dense shapes, except do_not_specialize ones"
    print(f"Triton {triton.__version__}, sm_90, bf16, {'non-causal' if args.full else 'causal'}, "
          f"{'packed' if args.varlen else 'dense'}{', RoPE inside the Triton kernels' if args.rope else ''}; "
          f"{how}\n")
    rows = []

    def divisible(fn, sig):  # pointers and the ints Triton would specialize, marked multiples of 16
        skip = set() if args.no_specialize else {p.name for p in fn.params if p.do_not_specialize}
        return {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                if sig[a].startswith("*") or (sig[a] == "i32" and a not in skip)}

    for d in (int(x) for x in args.head_dims.split(",")):
        common = dict(HEAD_DIM=d, CAUSAL=not args.full, VARLEN=args.varlen, PREC="tf32", ROPE=args.rope)
        triton_kernels = [("fwd (Triton)", flash._attn_fwd, flash.FWD_CONFIGS[(d, 2)][0], {}),
                          ("dq (Triton)", flash._attn_bwd_dq, flash.DQ_CONFIGS[(d, 2)][0], {}),
                          ("dkdv (Triton)", flash._attn_bwd_dkdv, flash.DKDV_CONFIGS[(d, 2)][0],
                           dict(GROUP=1, EVEN_Q=not args.varlen))] if (d, 2) in flash.FWD_CONFIGS else []
        for name, tuned, (m, n, w, s), extra in triton_kernels:
            fn = getattr(tuned, "fn", tuned)  # the JITFunction under the autotuner
            cx = dict(common, BLOCK_M=m, BLOCK_N=n, **extra)
            sig = {a: "constexpr" if a in cx else SASS_TYPES.get(a, "i32") for a in fn.arg_names}
            rows.append([d, name, str((m, n, w, s))] + sass_stats(fn, sig, cx, {"num_warps": w, "num_stages": s},
                                                                 attrs=divisible(fn, sig)))
        tiles = flash._gluon_head_tiles(d) if flash.gluon is not None else None
        if tiles is not None:
            main, tail = tiles

            def desc(rows, cols, dtype="bf16", swizzle=None):  # the type of a descriptor of (rows x cols) tiles
                block = [rows, 1, cols] if args.varlen else [1, 1, rows, cols]
                layout = flash._smem_layout(tuple(block), torch.float32 if dtype == "fp32" else torch.bfloat16,
                                            swizzle)
                return f"tensordesc<{dtype}{block},{layout!r}>"

            m, n, stages, q_bufs = flash.GLUON_FWD_CONFIGS[main + tail]
            cx = dict(HEAD_DIM=main, TAIL=tail, BLOCK_M=m, BLOCK_N=n, NUM_STAGES=stages, Q_BUFS=q_bufs,
                      CAUSAL=not args.full, VARLEN=args.varlen, HEAD_MAJOR=flash.GLUON_HEAD_MAJOR,
                      PINGPONG=flash.GLUON_PINGPONG,
                      DYNAMIC=flash.GLUON_FWD_PERSISTENT > 0,  # as flash.py launches it (FLASH_FWD_PERSISTENT)
                      O_TMA=flash._gluon_fwd_o_tma(tail))
            types = {"q_desc": desc(m, main), "k_desc": desc(n, main), "v_desc": desc(n, main),  # tails: the
                     "o_desc": desc(m, main),
                     "qt_desc": desc(m, tail or main), "kt_desc": desc(n, tail or main),  # main ones again where
                     "vt_desc": desc(n, tail or main), **SASS_TYPES}  # there is no tail
            fn = flash._gl_attn_fwd
            sig = {a: "constexpr" if a in cx else types.get(a, "i32") for a in fn.arg_names}
            rows.append([d, "fwd (Gluon, sm90)", str((2 * m, n, 9, stages))] + sass_stats(
                fn, sig, cx, {"num_warps": 4, "maxnreg": 168}, gluon_source=True, attrs=divisible(fn, sig)))
            m, n, stages, split, _, dq_swizzle = flash.GLUON_BWD_CONFIGS[main + tail]
            cx = dict(HEAD_DIM=main, TAIL=tail, BLOCK_M=m, BLOCK_N=n, NUM_STAGES=stages, CAUSAL=not args.full,
                      VARLEN=args.varlen, DYNAMIC=flash._gluon_bwd_persistent(main + tail) > 0)
            cx["DKV_TMA"] = flash._gluon_bwd_dkv_tma(tail, cx["DYNAMIC"], 1024, split)  # as at S=1024
            dq = desc(m, main // split, "fp32", dq_swizzle)  # (a tail's dQ tiles: the default swizzle)
            types = {"q_desc": desc(m, main), "do_desc": desc(m, main), "k_desc": desc(n, main),
                     "v_desc": desc(n, main), "dq_desc": dq,
                     "qt_desc": desc(m, tail or main), "dot_desc": desc(m, tail or main),
                     "kt_desc": desc(n, tail or main), "vt_desc": desc(n, tail or main),
                     "dqt_desc": desc(m, tail, "fp32") if tail else dq, "dk_desc": desc(n, main),
                     "dv_desc": desc(n, main), **SASS_TYPES}
            fn = flash._gl_attn_bwd
            sig = {a: "constexpr" if a in cx else types.get(a, "i32") for a in fn.arg_names}
            rows.append([d, "bwd (Gluon, sm90)", str((m, 2 * n, 10, stages))] + sass_stats(
                fn, sig, cx, {"num_warps": 4, "maxnreg": 168}, gluon_source=True, attrs=divisible(fn, sig)))
    print(markdown_table(["D", "kernel", "config (M, N, warps, stages)", "registers", "stack bytes", "spill loads",
                          "spill stores", "SASS instructions", "shared KiB", "wgmma serialized"], rows, digits=1))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------------------------

COMMANDS = {  # name: (function, what it answers, in one line)
    "model": (cmd_model, "one model's training step: time per phase, memory, sweeps, NVTX, profiler, snapshot"),
    "precision": (cmd_precision, "fp32 vs bf16 autocast side by side, and where low-precision sums go wrong"),
    "compile": (cmd_compile, "eager vs torch.compile: the whole model, and attention alone"),
    "gpt2": (cmd_gpt2, "GPT-2-small training throughput: our TransformerLM vs a torch.nn GPT-2 peer"),
    "varlen": (cmd_varlen, "pad vs dynamic_pad vs pack on the same documents: model step and attention"),
    "attention": (cmd_attention, "our FlashAttention (Triton, Gluon) vs PyTorch SDPA backends, FlexAttention, naive"),
    "rmsnorm": (cmd_rmsnorm, "our RMSNorm kernels vs inductor, F.rms_norm and a copy: ms, GB/s (CUDA)"),
    "launch": (cmd_launch, "host time of one flash.py call: direct launches vs Triton's kernel[grid], vs SDPA (CUDA)"),
    "allreduce": (cmd_allreduce, "all-reduce time and bandwidth per tensor size (under torchrun)"),
    "ddp": (cmd_ddp, "our DDP / ZeRO-1 / FSDP variants vs torch's, one run (under torchrun)"),
    "bpe": (cmd_bpe, "our BPE tokenizer: training vs HF tokenizers, encoding vs tiktoken"),
    "leaderboard": (cmd_leaderboard, "the 8B training step (ms, memory, MFU, cold start) beside a PyTorch-native peer"),
    "sass": (cmd_sass, "registers, spills, shared memory, wgmma serialization of the attention kernels (sm_90)"),
    "hf": (cmd_hf, "a Hugging Face GPT-2 on variable-length documents: padding vs padding-free, SDPA vs ours"),
}


def usage():
    width = max(map(len, COMMANDS))
    return "\n".join(["usage: python bench.py SUBCOMMAND [options]   (python bench.py SUBCOMMAND -h: its options)",
                      "", "subcommands:"] + [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()])


def main(argv=None):
    """Runs one subcommand; returns the exit status (-h: the list of subcommands, 0; none or an unknown one: 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] not in COMMANDS:
        print(f"bench.py: unknown subcommand {argv[0]!r}; choose one of {', '.join(COMMANDS)} (python bench.py -h)",
              file=sys.stderr)
        return 2
    rc = COMMANDS[argv[0]][0](argv[1:])
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
