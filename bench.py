"""Benchmarks: where training's time and memory go, ours beside what a user
would otherwise pick. A subcommand per question (`python bench.py -h`) prints
Markdown tables, saves its rows in --json FILE and a chart in --plot FILE.png.

Sections: command line (read before torch is imported) · harness (Report,
time_ms) · model · attention · varlen, hf · rmsnorm, adamw · ddp · bpe · sass
"""
import argparse
import collections
import contextlib
import datetime
import functools
import gc
import itertools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import unittest.mock

T_START = time.time()  # cold starts count from here


def bpe_train_child(which, path, vocab_size, special, workers, out_dir):
    """`bench.py bpe`'s training run, ours or HF's, in a process without torch
    (its peak RSS the trainer's); prints JSON."""
    from bpe import Tokenizer, peak_rss_mb, train_bpe
    t0 = time.perf_counter()
    if which == "ours":
        vocab, merges = train_bpe(path, int(vocab_size), [special],
                                  num_workers=int(workers), verbose=False)
        Tokenizer(vocab, merges, [special]).save(out_dir)
        n = len(vocab)
    else:
        os.environ["RAYON_NUM_THREADS"] = workers  # HF's threads: as many as ours
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers, trainers
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                     use_regex=True)

        def documents():  # split at the special token: no merge crosses one
            buf = ""
            with open(path, encoding="utf-8", newline="") as f:
                for block in iter(lambda: f.read(1 << 20), ""):
                    *done, buf = (buf + block).split(special)
                    yield from done
            yield buf

        trainer = trainers.BpeTrainer(
            vocab_size=int(vocab_size),
            special_tokens=[special],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(documents(), trainer)
        n = tok.get_vocab_size()
    seconds = time.perf_counter() - t0
    rss, worker_rss = peak_rss_mb()
    print(json.dumps(dict(seconds=seconds, rss_mb=rss,
                          worker_rss_mb=worker_rss, vocab=n)))


# ---- command line
# Parsed before torch is imported: -h and mistakes answer at once.

class Parser(argparse.ArgumentParser):
    """One-line mistakes, exit status 2; then the subcommand's rules(args) ->
    [(bad, why)]."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    def parse_args(self, args=None, namespace=None):
        args = super().parse_args(args, namespace)
        for bad, why in args.rules(args):
            if bad:
                fail(args, why)
        return args


def fail(args, message):
    Parser(prog=f"bench.py {args.command}").error(message)


def listed(choices=None, cast=str):
    """An argparse type: 'a,b,c' -> [a, b, c], cast and checked."""
    def parse_list(text):
        try:
            items = [cast(t) for t in text.split(",") if t]
        except ValueError:
            kind = "int" if cast is int else "TOKENSxD"
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of {kind}")
        if not items or (choices and set(items) - set(choices)):
            expected = ", ".join(map(str, choices))
            raise argparse.ArgumentTypeError(
                f"unknown value in {text!r}: expected {expected}")
        return items
    return parse_list


# size and attn names, known once torch is imported (before: any name)
MODEL_NAMES = {}
PHASES = ("forward", "backward", "optimizer_step")
DTYPES = ("fp32", "bf16")
KEYS = dict(  # a row's configuration: its column names
    model="model",
    size="size",
    context_length="ctx",
    batch_size="batch",
    dtype="dtype",
    compile="compile",
    attn="attn",
    recompute="recompute",
    mode="mode")
ATTN_PARTS = ("anchors", "varlen", "sweep", "work", "sustained", "compile")
ATTN_METHODS = (  # those a device lacks are left out
    "ours", "ours-triton", "ours-gluon",
    "naive", "naive-compiled",
    "sdpa-cudnn", "sdpa-flash", "sdpa-efficient",
    "flex", "sdpa-pad", "sdpa-dynamic", "fa2-varlen")
# (CUDA, CPU): a GPT-2-small-ish model in bf16, a tiny one
VARLEN_DEFAULTS = dict(
    d_model=(768, 64),
    num_layers=(12, 2),
    num_heads=(12, 4),
    d_ff=(3072, 192),
    vocab_size=(10000, 512),
    context_length=(1024, 256),
    median_len=(200.0, 40.0),
    sigma=(0.8, 0.8),
    batch_size=(32, 2),
    dtype=("bf16", "fp32"),
    attn=("flash", "naive"),
    num_docs=(20000, 400),
    warmup=(2, 1),
    steps=(10, 2),
    compile=("dynamic", "none"),
    phases=("eval,train",) * 2,
    strategies=("pad,dynamic_pad,pack,pack_static",) * 2,
    backend=("inductor", "aot_eager"))
HF_DEFAULTS = dict(  # GPT2Config's shape on the GPU
    VARLEN_DEFAULTS,
    vocab_size=(50257, 257),
    context_length=(1024, 32),
    median_len=(200.0, 20.0),
    batch_size=(16, 2),
    warmup=(3, 1),
    steps=(10, 1),
    phases=("train",) * 2,
    strategies=("sdpa:pad,sdpa:pad:compiled,sdpa:dynamic_pad,ours:pad,"
                "ours:pack,ours:pack:compiled,flex_attention:pack",) * 2)
LAYOUTS = ("pad", "dynamic_pad", "pack", "pack_static")
STRATEGIES = dict(
    varlen=LAYOUTS,
    hf=tuple(f"{attn}:{layout}{compiled}"
             for attn in ("sdpa", "ours", "flex_attention")
             for layout in LAYOUTS[:3]
             for compiled in ("", ":compiled")))
RMSNORM_METHODS = ("ours", "inductor", "F.rms_norm", "copy")
# ddp.wrap's impl[-bucket MiB][+zero1][+bf16]; none: no communication
DDP_VARIANTS = (
    "none", "naive", "flat", "overlap",
    *(f"bucketed-{mb}" for mb in (1, 10, 25, 100, 1000)),
    "bucketed-25+zero1", "fsdp", "fsdp+bf16",
    "torch", "torch+zero_redundancy", "torch_fsdp+bf16")


def model_rules(a):
    tracing = a.nvtx or a.profile or a.memory_snapshot
    lists = (a.attn, a.size, a.compile, a.dtype, a.context_length, a.mode)
    several = a.peer or math.prod(map(len, lists)) > 1
    not_graphable = (a.mode != ["train"] or a.warmup < 3 or tracing
                     or "graphs" in a.compile)
    return [
        (a.steps < 1 or a.warmup < 0,
         "--steps must be >= 1 and --warmup >= 0"),
        (tracing and several,
         "--nvtx, --profile and --memory_snapshot are for a single configuration of ours"),
        (a.cuda_graphs and not_graphable,
         "--cuda_graphs captures a training step: it needs --mode train and "
         "--warmup >= 3, without --nvtx, --profile, --memory_snapshot, --compile graphs"),
        ("WORLD_SIZE" in os.environ and not set(a.compile) <= {"none", "blocks"},
         "under torchrun --compile is none or blocks (the models are sharded after compiling)"),
    ]


def varlen_rules(a):
    known = STRATEGIES[a.command]
    bad_strategy = (a.strategies
                    and not set(a.strategies.split(",")) <= set(known))
    bad_dtype = a.dtype not in (None, *DTYPES)
    bad_phase = (a.phases
                 and not set(a.phases.split(",")) <= {"eval", "train"})
    why = (f"--strategies, --dtype or --phases: not {','.join(known)}; "
           f"{'|'.join(DTYPES)}; eval,train")
    return [(bad_strategy or bad_dtype or bad_phase, why)]


def bpe_rules(a):
    empty = not os.path.isfile(a.input) or os.path.getsize(a.input) == 0
    bad = empty or a.repeats < 1 or a.num_workers < 1 or not a.special
    return [(bad, f"--input {a.input} is missing or empty, or --repeats or "
                  "--num_workers < 1, or --special empty")]


def shape(text):  # 'TOKENSxD' -> (TOKENS, D)
    return tuple(map(int, text.split("x", 1)))


def cli():
    top = Parser(prog="bench.py", description=(
        "Benchmarks: a subcommand per question (bench.py SUBCOMMAND -h: its "
        "options). Markdown on stdout, progress on stderr, every row in --json FILE."))
    sub = top.add_subparsers(dest="command", required=True,
                             metavar="SUBCOMMAND", parser_class=Parser)

    def parser(name, summary, details, device=True, plot=False,
               defaults=None, rules=lambda a: (), **plain):
        p = sub.add_parser(name, help=summary,
                           description=f"{summary}. {details}")
        p.set_defaults(by_device=defaults or {}, rules=rules)
        p.add_argument("--json", metavar="FILE",
                       help="every row, and the header's facts, as JSON")
        if plot:
            p.add_argument("--plot", metavar="FILE.png",
                           help="a chart of the rows (needs matplotlib)")
        for key, (gpu, cpu) in (defaults or {}).items():  # set by on_device
            p.add_argument(f"--{key}", type=type(gpu),
                           help=f"default {gpu} on CUDA, {cpu} on the CPU")
        if device:
            plain = dict(device="auto", seed=0) | plain
        for key, value in plain.items():  # typed as the default
            p.add_argument(f"--{key}", type=type(value), default=value)
        return p

    p = parser("model", "The training step: time per phase, memory, "
               "throughput; sweeps, comparisons, peers",
               "A row per combination of the comma lists.", plot=True,
               vocab_size=10000, warmup=5, steps=10, rules=model_rules)
    p.add_argument("--size", type=listed(MODEL_NAMES.get("size")),
                   default="small", help="PRESETS, tiny, gpt2, 8B")
    p.add_argument("--num_layers", type=int,
                   help="the preset's, or this many")
    p.add_argument("--context_length", type=listed(cast=int), default="512")
    p.add_argument("--batch_size", type=int, default=4,
                   help="per rank under torchrun")
    p.add_argument("--dtype", type=listed(DTYPES), default="fp32",
                   help="bf16: autocast")
    p.add_argument("--mode", type=listed(("fwd", "fwd_bwd", "train")),
                   default="train", help="fwd: inference")
    p.add_argument("--compile",
                   type=listed(("none", "model", "blocks", "graphs")),
                   default="none", help="blocks: each block compiled in "
                   "place; graphs: torch.compile(mode='reduce-overhead')")
    p.add_argument("--attn", type=listed(MODEL_NAMES.get("attn")),
                   default="naive")
    p.add_argument("--tie_embeddings", action="store_true")
    p.add_argument("--peer", nargs="?", const="native",
                   choices=("gpt2", "native"),
                   help="GPT-2 or ours in torch.nn")
    p.add_argument("--cuda_graphs", action="store_true",
                   help="the whole step one CUDA graph (mode train, CUDA)")
    p.add_argument("--compare", choices=tuple(KEYS),
                   help="a table with this option's values side by side")
    p.add_argument("--sweep", action="store_const", dest="compare",
                   const="mode", help="--compare mode")
    p.add_argument("--time_budget", type=float, default=float("inf"),
                   help="seconds; later rows are skipped")
    p.add_argument("--reference_tokens_per_s", type=float,
                   help="nanoGPT's, say: a 'vs reference' column")
    p.add_argument("--act_ckpt_every", type=int, default=0,
                   help="recompute segments of k blocks in backward")
    p.add_argument("--act_ckpt_layers", type=int, default=-1,
                   help="... over the first n blocks only (-1: all)")
    p.add_argument("--selective_recompute", action="store_true")
    p.add_argument("--nvtx", action="store_true", help="NVTX ranges of the "
                   "timed steps' ops and phases, for nsys")
    p.add_argument("--profile", metavar="TRACE.json",
                   help="torch.profiler: top kernels and a Chrome trace")
    p.add_argument("--memory_snapshot", metavar="FILE.pickle",
                   help="CUDA: the memory history, for memory_viz")

    p = parser("attention", "Our FlashAttention vs SDPA's backends, "
               "FlexAttention, naive: dense and packed",
               "Causal, forward, backward and both (on the CPU: tiny "
               "stand-ins in the Triton interpreter).", device=False,
               rep=50, sustain=1.0, time_budget=0.0)
    p.add_argument("--parts", type=listed(ATTN_PARTS),
                   default="anchors,varlen,sweep", help="see the section")
    p.add_argument("--methods", type=listed(ATTN_METHODS),
                   help="default: all but ours-gluon, naive-compiled, packed sdpa-*, fa2")

    summaries = {
        "varlen": "pad vs dynamic_pad vs pack on the same documents, our model",
        "hf": "varlen on a Hugging Face GPT-2 (dropout 0): sdpa, ours "
              "(hf.register_hf_attention), flex_attention, a row per "
              "document or packed, compiled or not",
    }
    defaults = dict(varlen=VARLEN_DEFAULTS, hf=HF_DEFAULTS)
    for name, summary in summaries.items():
        parser(name, summary,
               "Training (and eval), every row from the same weights.",
               plot=True, defaults=defaults[name], rules=varlen_rules)

    p = parser("rmsnorm", "Our RMSNorm kernels vs inductor, F.rms_norm and "
               "a copy: ms, GB/s", "copy: x.clone(), the bandwidth a norm "
               "can at best reach. bf16 on CUDA, fp32 on the CPU.", rep=50)
    p.add_argument("--shapes", type=listed(cast=shape),
                   default="32768x4096,12288x768", help="TOKENSxD,...")
    p.add_argument("--methods", type=listed(RMSNORM_METHODS),
                   default=",".join(RMSNORM_METHODS))
    parser("adamw", "One optimizer step: our AdamW (fused, foreach) vs "
           "torch's", "Every optimizer on the same tensors and gradients of "
           "a TransformerLM: gpt2 and xl on CUDA, tiny on the CPU.", rep=100)

    summaries = {
        "ddp": "Our DDP / ZeRO-1 / FSDP variants vs torch's, all-reduce "
               "bandwidth (under torchrun)",
        "allreduce": "ddp's all-reduce table alone, 1 to 1000 MiB (under torchrun)",
    }
    for name, summary in summaries.items():
        p = parser(name, summary, "Then a TransformerLM step, our AdamW, "
                   "under each variant (none: no communication, the "
                   "baseline).", device=False, context_length=1024,
                   warmup=3, steps=10)
        p.add_argument("--allreduce_mb", type=float, nargs="*", default=[],
                       help="MiB per all-reduced fp32 tensor")
        p.add_argument("--variants", nargs="*", default=list(DDP_VARIANTS),
                       choices=DDP_VARIANTS)
        p.add_argument("--preset", default="gpt2-xl",
                       choices=MODEL_NAMES.get("size"), help="tiny: vocab 512")
        p.add_argument("--batch_size", type=int, default=8, help="per rank")
    p.set_defaults(variants=[], allreduce_mb=[1.0, 10.0, 100.0, 1000.0])

    p = parser("bpe", "Our BPE tokenizer: training vs HF tokenizers, "
               "encoding vs tiktoken", "Each training in a fresh process; "
               "the encodings' ids checked equal; medians of --repeats.",
               device=False, vocab_size=10000, special="<|endoftext|>",
               num_workers=os.cpu_count(), repeats=3, rules=bpe_rules)
    p.add_argument("--input", required=True, help="UTF-8 corpus, documents "
                   "joined by --special (bench_corpus.py)")

    p = parser("sass", "Registers, spills, shared memory, wgmma "
               "serialization of the attention kernels (sm_90)",
               "Compiled for sm_90 without a GPU (cmd_sass tells how and why).", device=False)
    p.add_argument("--head_dims", default="128,64")
    p.add_argument("--varlen", action="store_true",
                   help="the packed (variable-length) kernels instead of dense")
    p.add_argument("--full", action="store_true",
                   help="non-causal instead of causal")
    return top


if __name__ == "__main__":
    if sys.argv[1:2] == ["_bpe_train"]:  # before torch: see bpe_train_child
        sys.exit(bpe_train_child(*sys.argv[2:]))
    cli().parse_args(sys.argv[1:])

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

import ddp  # noqa: E402
import flash  # noqa: E402  (before triton: on a CPU it sets TRITON_INTERPRET)
import hf  # noqa: E402
import model as model_py  # noqa: E402
from model import (ATTN_IMPLS, PRESETS, TransformerLM,  # noqa: E402
                   count_params, flops_per_token)
from train import (AdamW, PEAK_FLOPS, pack_batch,  # noqa: E402
                   pad_batch, pad_packed, sample_documents, whole_step_graph)
import triton  # noqa: E402

SIZES = dict(
    PRESETS,
    tiny=dict(d_model=64, d_ff=192, num_layers=2, num_heads=4),
    # GPT-2 small's parameter count, in SwiGLU
    gpt2=dict(d_model=768, d_ff=2048, num_layers=12, num_heads=12),
    # the leaderboard's model
    **{"8B": dict(d_model=4096, d_ff=11008, num_layers=34, num_heads=32)})
MODEL_NAMES.update(size=tuple(SIZES), attn=ATTN_IMPLS)


# ---- harness: the device, output, timing

def on_device(args):
    """--device's device; the unset by_device options set for it."""
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(args, "--device cuda: CUDA is not available on this machine")
    for key, (gpu, cpu) in args.by_device.items():
        if getattr(args, key) is None:
            setattr(args, key, gpu if device.type == "cuda" else cpu)
    torch.manual_seed(args.seed)
    # one function compiled at many shapes: past 8 it would run eagerly
    torch._dynamo.config.cache_size_limit = 64
    return device


def fmt(x, digits=2):
    if x is None:
        return "—"
    if not isinstance(x, float):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if 0 < abs(x) < 0.1:
        return f"{x:.2g}"
    return f"{x:.{digits}f}"


def ratio(a, b):
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool)
                  for x in (a, b))
    if numbers and b:
        return f"{a / b:.2f}x"
    return "—"


class Report:
    """Markdown on stdout; every row so far in --json, atomically (a run cut
    short keeps its rows); --plot."""

    def __init__(self, args, device, rank=0):
        cuda = device.type == "cuda"
        launcher = "torchrun ... " if "WORLD_SIZE" in os.environ else "python "
        name = f"CPU {platform.machine()}, {torch.get_num_threads()} threads"
        versions = f"torch {torch.__version__}, triton {triton.__version__}"
        if cuda:
            name = torch.cuda.get_device_name(device)
            versions += f", CUDA {torch.version.cuda}"
        command = " ".join(["bench.py", args.command] + args.argv)
        self.data = dict(
            command=launcher + command,
            date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            device=name,
            versions=versions)
        self.json = getattr(args, "json", None)
        self.png = getattr(args, "plot", None)
        self.quiet = rank != 0
        self.t0 = time.perf_counter()
        facts = [f"`{self.data['command']}`", *list(self.data.values())[1:]]
        self.say(" · ".join(facts) + "\n")

    def elapsed(self):
        return time.perf_counter() - self.t0

    def progress(self, done, total, text, **data):  # with an ETA
        elapsed = self.elapsed()
        rate = done / max(elapsed, 1e-9)
        if not self.quiet:
            eta = (total - done) / rate
            print(f"[{done}/{total}] {text} | {elapsed:.0f}s, "
                  f"{60 * rate:.1f}/min, ETA {eta:.0f}s",
                  file=sys.stderr, flush=True)
        self.save(**data)

    def say(self, text=""):
        if not self.quiet:
            print(text, flush=True)

    def table(self, header, cells, digits=2, fold=(), **data):
        """Cells through fmt (digits: decimals, one or a list per column); a
        `fold` column of equal cells becomes a caption."""
        if isinstance(digits, (list, tuple)):
            digits = list(digits) + [2] * len(header)
        else:
            digits = [digits] * len(header)
        same = [i for i in fold
                if cells and len({fmt(r[i]) for r in cells}) == 1]
        keep = [i for i in range(len(header)) if i not in same]
        if same:
            caption = [f"{header[i]} {fmt(cells[0][i])}" for i in same]
            self.say(", ".join(caption) + "\n")
        lines = ["| " + " | ".join(header[i] for i in keep) + " |",
                 "|" + "---|" * len(keep)]
        for r in cells:
            row = [fmt(r[i], digits[i]).replace("|", "\\|") for i in keep]
            lines.append("| " + " | ".join(row) + " |")
        self.say("\n".join(lines) + "\n")
        self.save(**data)

    def save(self, **data):
        self.data.update(data)
        if self.json and not self.quiet:
            with open(self.json + ".tmp", "w") as f:
                json.dump(self.data, f, indent=1, default=str)
            os.replace(self.json + ".tmp", self.json)

    def plot(self, panels, xlabel, ylabel, log=False):
        """panels = {title: {series: [(x, y), ...]}}, x a number or a label."""
        if not self.png or self.quiet:
            return
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print(f"matplotlib is not installed: {self.png} not written",
                  file=sys.stderr)
            return
        n = len(panels) or 1
        fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
        for ax, (title, series) in zip(axes[0], panels.items()):
            for name, points in series.items():
                ax.plot(*zip(*points), marker="o", label=name)
            ax.set(title=title, xlabel=xlabel, ylabel=ylabel,
                   yscale="log" if log else "linear")
            ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(self.png, dpi=120)
        plt.close(fig)
        print(f"plot written to {self.png}", file=sys.stderr)


def free_memory(device):
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def is_oom(error):  # the allocator's error, or cuBLAS's or cuDNN's saying so
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return any(w in str(error) for w in ("out of memory", "ALLOC_FAILED"))


def failure(error, short=False):
    """A failed row's status ('OOM', else 'error'; short: the error's first
    sentence): one failure does not end a run."""
    if not is_oom(error) and not short:
        traceback.print_exception(error, file=sys.stderr)
        return "error"
    print(f"{type(error).__name__}: {error}", file=sys.stderr)
    if is_oom(error):
        return "OOM"
    first = str(error).split(". ")[0][:140]
    return f"{type(error).__name__}: {first}"


def autocast(dtype, device):  # bf16 around forward and loss, the rest fp32
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                          enabled=dtype == "bf16")


_L2_FLUSH = {}  # device -> 2**28 bytes, more than any L2, zeroed to evict it


def time_ms(fn, device, warmup=0, steps=1, reps=1, setup=None,
            budget_ms=None, flush_l2=False, host_ahead=False, host_ms=None):
    """`steps` samples (or as many as fit in budget_ms), each the ms per call
    over `reps` calls after setup(), `warmup` calls first. flush_l2: a cold L2
    per sample; host_ahead: the GPU kept busy while the host issues the calls,
    to time the GPU alone (host_ms, a list, gets the host's)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    sleep_ms = 1.0  # host_ahead's: twice the host's time for a sample, or more
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        sleep_ms = max(1.0, 2e3 * (time.perf_counter() - t0) * reps)
    if cuda and flush_l2 and device not in _L2_FLUSH:
        _L2_FLUSH[device] = torch.empty(2**28, dtype=torch.int8, device=device)

    def sample():
        nonlocal sleep_ms
        if setup is not None:
            setup()
        if cuda:
            torch.cuda.synchronize(device)
            if flush_l2:
                _L2_FLUSH[device].zero_()
            if host_ahead:  # ~2e6 cycles per ms at the H100/H200 clock
                torch.cuda._sleep(int(sleep_ms * 2e6))
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host = (time.perf_counter() - t0) * 1e3 / reps
        if not cuda:
            return host
        end.record()
        if host_ahead and host_ms is not None:
            host_ms.append(host)
        if host_ahead and host * reps > 0.8 * sleep_ms:
            sleep_ms *= 2
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / reps

    first = min(steps, 1) if budget_ms else steps  # one, to see how many fit
    samples = [sample() for _ in range(first)]
    if budget_ms and samples:
        cost = samples[0] + sleep_ms * host_ahead  # the GPU's sleeps count
        fit = int(budget_ms / max(cost, 1e-3))
        steps = max(steps, min(fit, 10_000))
    return samples + [sample() for _ in range(steps - len(samples))]


def kernel_ms(fn, device, rep, host_ms=None):
    """The median ms of as many calls as fit in `rep` ms (CPU: 3), each from a
    cold L2, the GPU's work alone."""
    cuda = torch.device(device).type == "cuda"
    samples = time_ms(fn, device, warmup=5 if cuda else 1, steps=3,
                      budget_ms=rep if cuda else None, flush_l2=cuda,
                      host_ahead=True, host_ms=host_ms)
    return statistics.median(samples)


def summary(samples):
    std = statistics.stdev(samples) if len(samples) > 1 else 0.0
    return dict(mean_ms=statistics.fmean(samples), std_ms=std,
                median_ms=statistics.median(samples))


def sustained_ms(fn, device, seconds, readings):
    """ms per call at the power limit: `seconds` of untimed calls for the clock
    to settle, then the median of `seconds` of ~0.2 s samples; readings gets
    NVML's mean SM MHz and board W."""
    per_call = time_ms(fn, device, warmup=2, steps=1)[0]
    reps = max(1, round(200 / per_call))
    seen = []

    def read():
        # no pynvml, no NVML library, or a GPU it does not report
        with contextlib.suppress(Exception):
            mhz = float(torch.cuda.clock_rate(device))
            seen.append((mhz, torch.cuda.power_draw(device) / 1e3))

    warmup = max(1, round(seconds * 1e3 / per_call))
    steps = max(3, round(seconds * 1e3 / (reps * per_call)))
    samples = time_ms(fn, device, warmup=warmup, steps=steps, reps=reps,
                      setup=read)
    if seen:
        readings.append(tuple(statistics.mean(r[i] for r in seen)
                              for i in (0, 1)))
    return statistics.median(samples)


def document_lengths(num_docs, median_len, sigma, max_len, generator,
                     total_tokens=None, min_len=16):
    """Log-normal (long-tailed) lengths in [min_len, max_len]: num_docs of
    them, or as many as fill total_tokens exactly."""
    def draw(n):
        noise = torch.randn(n, generator=generator, dtype=torch.float64)
        lengths = (median_len * torch.exp(sigma * noise)).round()
        return lengths.clamp(min_len, max_len).long()

    lengths = draw(num_docs or 0)
    if num_docs is not None:
        return lengths
    while int(lengths.sum()) < total_tokens:
        lengths = torch.cat([lengths, draw(max(1, int(total_tokens / median_len)))])
    end = int(torch.searchsorted(lengths.cumsum(0), total_tokens)) + 1
    lengths = lengths[:end].clone()
    lengths[-1] -= int(lengths.sum()) - total_tokens
    return lengths


# ---- model: the training step, ours beside a peer

def rotate_pairs(t, cos, sin):
    """RoPE on adjacent pairs: (a, b) -> (a cos - b sin, a sin + b cos)."""
    a, b = t[..., 0::2].float(), t[..., 1::2].float()
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


class PeerBlock(nn.Module):
    """GPT-2's block (LayerNorm, biases, a GELU MLP of width 4 d) or ours
    (RMSNorm, RoPE, a fused w1/w3 SwiGLU), as a PyTorch user writes it."""

    def __init__(self, d_model, num_heads, d_ff, gpt2):
        super().__init__()
        self.num_heads, self.gpt2 = num_heads, gpt2
        self.d_ff = 4 * d_model if gpt2 else d_ff
        norm = nn.LayerNorm if gpt2 else functools.partial(nn.RMSNorm, eps=1e-5)
        self.ln1, self.ln2 = norm(d_model), norm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=gpt2)
        self.proj = nn.Linear(d_model, d_model, bias=gpt2)
        up_width = self.d_ff if gpt2 else 2 * self.d_ff  # ours: w1 and w3
        self.up = nn.Linear(d_model, up_width, bias=gpt2)
        self.down = nn.Linear(self.d_ff, d_model, bias=gpt2)

    def forward(self, x, cos, sin):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        B, T, d = x.shape
        qkv = self.qkv(self.ln1(x))
        qkv = qkv.view(B, T, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        backends = contextlib.nullcontext()
        if not self.gpt2:
            q = rotate_pairs(q, cos, sin).to(v.dtype)
            k = rotate_pairs(k, cos, sin).to(v.dtype)
        if not self.gpt2 and x.is_cuda:
            backends = sdpa_kernel([SDPBackend.CUDNN_ATTENTION,
                                    SDPBackend.FLASH_ATTENTION])
        with backends:  # (unnamed: freed before the MLP)
            x = x + self.proj(
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
                .transpose(1, 2).reshape(B, T, d))
        h = self.up(self.ln2(x))
        if self.gpt2:
            return x + self.down(F.gelu(h, approximate="tanh"))
        return x + self.down(F.silu(h[..., :self.d_ff]) * h[..., self.d_ff:])


class PeerLM(nn.Module):
    """TransformerLM's peer in torch.nn: gpt2, GPT-2 as nanoGPT builds it
    (learned positions, tied embeddings); else ours. act_ckpt: every block
    recomputed."""

    def __init__(self, vocab_size, context_length, d_model, num_layers,
                 num_heads, d_ff, gpt2=False, act_ckpt=False):
        super().__init__()
        self.act_ckpt = act_ckpt
        self.emb = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context_length, d_model) if gpt2 else None
        self.layers = nn.ModuleList(PeerBlock(d_model, num_heads, d_ff, gpt2)
                                    for _ in range(num_layers))
        self.ln = nn.LayerNorm(d_model) if gpt2 else nn.RMSNorm(d_model, eps=1e-5)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if gpt2:
            self.head.weight = self.emb.weight
        d_k = d_model // num_heads
        freqs = 10000.0 ** (-torch.arange(0, d_k, 2).float() / d_k)
        angles = torch.arange(context_length).float()[:, None] * freqs
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.emb(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(T, device=idx.device))
        # FSDP2 casts a block's inputs, but not when it recomputes the block
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        for block in self.layers:
            if self.act_ckpt:
                x = torch.utils.checkpoint.checkpoint(
                    block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        logits = self.head(self.ln(x)).flatten(0, 1).float()
        return F.cross_entropy(logits, targets.flatten())


class Phases:
    """A step's phases as profiler labels; on CUDA, events read after the step
    (nothing synchronizes inside it) and peaks. off: one CUDA graph."""

    def __init__(self, device, off=False):
        self.cuda, self.off = device.type == "cuda", off
        self.clear()

    def clear(self):
        self.ms, self.peak, self.events = collections.defaultdict(list), {}, []

    def read(self):
        for name, start, end in self.events:
            end.synchronize()
            self.ms[name].append(start.elapsed_time(end))
        ms = {p: statistics.fmean(self.ms[p]) for p in PHASES if self.ms[p]}
        peak = self.peak
        self.clear()
        return ms, peak

    @contextlib.contextmanager
    def __call__(self, name):
        if self.off:
            yield
            return
        t0 = time.perf_counter()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        with torch.profiler.record_function(name):
            yield
        if not self.cuda:
            self.ms[name].append((time.perf_counter() - t0) * 1e3)
            return
        end.record()
        self.events.append((name, start, end))
        peak = torch.cuda.max_memory_allocated() / 2**20
        self.peak[name] = max(self.peak.get(name, 0.0), peak)


def training_step(par, optimizer, x, y, mode, dtype, phases, mark_step=False):
    if mark_step:  # reduce-overhead: the last replay's outputs may go
        torch.compiler.cudagraph_mark_step_begin()
    if mode != "fwd":
        par.module.zero_grad(set_to_none=True)
    with phases("forward"):
        with torch.set_grad_enabled(mode != "fwd"), autocast(dtype, x.device):
            loss = par(x, targets=y)
    if mode != "fwd":
        with phases("backward"):
            loss.backward()
            par.finish()
    if mode == "train":
        with phases("optimizer_step"):
            optimizer.step()


def build(who, size, attn, how, args, device, world):
    """A row group's model, compiled as `how` says; under torchrun sharded:
    ours by our FSDP, a peer by FSDP2."""
    num_layers = args.num_layers or SIZES[size]["num_layers"]
    dims = dict(SIZES[size], num_layers=num_layers)
    ctx = max(args.context_length)
    if who == "ours":
        ckpt_layers = None if args.act_ckpt_layers < 0 else args.act_ckpt_layers
        net = TransformerLM(args.vocab_size, ctx, **dims, attn_impl=attn,
                            tie_embeddings=args.tie_embeddings,
                            act_ckpt_every=args.act_ckpt_every,
                            selective_recompute=args.selective_recompute,
                            act_ckpt_layers=ckpt_layers, device=device)
    else:
        with torch.device(device):
            net = PeerLM(args.vocab_size, ctx, **dims, gpt2=who == "gpt2",
                         act_ckpt=world is not None)
    params = count_params(net)
    # blocks: one code for every block, so compiling does not grow with depth
    if how == "blocks":
        for layer in net.layers:
            layer.compile()
    elif how == "graphs":
        net = torch.compile(net, mode="reduce-overhead")
    elif how != "none":
        net = torch.compile(net)
    if world is None or (who == "ours" and world == 1):
        par = ddp.wrap(net, "none", compute_dtype=None)
    else:
        impl = "fsdp" if who == "ours" else "torch_fsdp"
        par = ddp.wrap(net, impl, compute_dtype=torch.bfloat16)
    if who == "ours":
        opt = AdamW
    else:
        opt = functools.partial(torch.optim.AdamW, fused=device.type == "cuda")
    # the GPT-2 peer's MLP, two d x 4d matrices, costs our SwiGLU's at d_ff 8d/3
    d_ff = 8 / 3 * dims["d_model"] if who == "gpt2" else dims["d_ff"]

    def flops(ctx):  # training FLOPs per token
        return flops_per_token(args.vocab_size, ctx, dims["d_model"],
                               dims["num_layers"], d_ff, causal=attn != "naive")

    def make_optimizer(capturable):
        return par.make_optimizer(opt, lr=6e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, capturable=capturable)
    return dict(par=par, params=params, flops=flops,
                make_optimizer=make_optimizer)


def run_config(cfg, built, device, args, gpu_ms=False, profiler=None):
    """A configuration's row: warm-up, then timed steps; or "OOM" or "error"."""
    row = dict(cfg, params=built["params"], status="ok")
    cuda = device.type == "cuda"
    world, rank = 1, 0
    if dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(args.seed + rank)
    B, T = cfg["batch_size"], cfg["context_length"]
    seq = torch.randint(args.vocab_size, (B, T + 1), generator=g)
    optimizer = None
    if cfg["mode"] == "train":
        optimizer = built["make_optimizer"](args.cuda_graphs)
    phases = Phases(device, off=args.cuda_graphs)
    x, y = seq[:, :-1].to(device), seq[:, 1:].to(device)
    step = functools.partial(training_step, built["par"], optimizer, x, y,
                             cfg["mode"], cfg["dtype"], phases,
                             cfg["compile"] == "graphs")
    # two eager warm-up steps, the third captures the step, later ones replay
    if args.cuda_graphs:
        step = whole_step_graph(step, optimizer, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        if args.warmup:
            row["first_step_ms"] = time_ms(step, device)[0]
            row["cold_start_s"] = time.time() - T_START
            time_ms(step, device, warmup=args.warmup - 1, steps=0)
        phases.read()
        # Python frames only: C++ frames take minutes to symbolize
        if args.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000,
                                                     stacks="python")
        nvtx = torch.autograd.profiler.emit_nvtx(enabled=args.nvtx)
        with profiler or contextlib.nullcontext(), nvtx:
            row.update(summary(time_ms(step, device, steps=args.steps)))
        if args.memory_snapshot:
            torch.cuda.memory._dump_snapshot(args.memory_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
        row["phase_ms"], row["phase_peak_mib"] = phases.read()
        if args.cuda_graphs:  # no phases in a captured step: the run's peak
            row["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        else:
            row["peak_mib"] = max(row["phase_peak_mib"].values(), default=None)
        if gpu_ms:  # the GPU's own time per step, without the host's launches
            samples = time_ms(step, device, warmup=1, steps=10, host_ahead=True)
            row["gpu_ms"] = statistics.median(samples)
    except Exception as e:
        row["status"] = failure(e)
    optimizer = seq = x = y = step = None
    built["par"].module.zero_grad(set_to_none=True)
    free_memory(device)  # here, where no traceback holds the step's tensors
    if row["status"] != "ok":
        return row
    row["tokens_per_s"] = B * T * world / (row["mean_ms"] / 1e3)
    flops = built["flops"](T)
    if cfg["mode"] == "fwd":  # a third of a training step
        flops /= 3
    row["tflops"] = flops * row["tokens_per_s"] / 1e12
    peak = 0
    if cuda:
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    row["mfu"] = row["tflops"] * 1e12 / (peak * world) if peak else None
    return row


def millions(n):
    if n is None:
        return None
    if n >= 1e5:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.1f}K"


def peer_key(r):  # what a peer's row shares with ours
    return tuple(r[k] for k in KEYS if k not in ("model", "attn", "recompute"))


def print_rows(rep, rows, reference=None):
    peers = {peer_key(r): r for r in rows
             if r["model"] != "ours" and r["status"] == "ok"}
    gpu = any(r.get("gpu_ms") for r in rows)
    header = list(KEYS.values()) + ["params", "ms/step", "median ms"]
    header += ["GPU ms"] * gpu
    header += ["first step ms", "cold start s", "fwd / bwd / opt ms",
               "peak MiB", "tokens/s", "TFLOP/s", "MFU"]
    header += ["vs peer"] * bool(peers)
    header += ["vs reference"] * bool(reference)
    body = []
    for r in rows:
        cells = [r[k] for k in KEYS] + [millions(r["params"])]
        if r["status"] != "ok":
            body.append(cells + [r["status"]] * (len(header) - len(cells)))
            continue
        peer = None
        if r["model"] == "ours":
            peer = peers.get(peer_key(r), {}).get("tokens_per_s")
        phase_ms = " / ".join(fmt(ms) for ms in r["phase_ms"].values())
        mfu = r["mfu"] and f"{100 * r['mfu']:.1f}%"
        cells += [f"{r['mean_ms']:.2f} ± {r['std_ms']:.2f}", r["median_ms"]]
        cells += [r.get("gpu_ms")] * gpu
        cells += [r.get("first_step_ms"), r.get("cold_start_s"),
                  phase_ms or "(one graph)", r["peak_mib"],
                  r["tokens_per_s"], r["tflops"], mfu]
        cells += [ratio(r["tokens_per_s"], peer)] * bool(peers)
        cells += [ratio(r["tokens_per_s"], reference)] * bool(reference)
        body.append(cells)
    rep.table(header, body, fold=range(len(KEYS)))


def compared(by, value, field):
    if value not in by:
        return ""
    row = by[value]
    return row.get(field) if row["status"] == "ok" else row["status"]


def print_compare(rep, rows, axis):  # the values of `axis` side by side
    values = list(dict.fromkeys(r[axis] for r in rows))
    keys = [k for k in KEYS if k != axis]
    lines = {}
    for r in rows:
        lines.setdefault(tuple(r[k] for k in keys), {})[r[axis]] = r
    first, last = values[0], values[-1]
    pair = len(values) == 2
    header = [KEYS[k] for k in keys] + ["params"]
    header += [f"{v} ms" for v in values]
    header += [f"{v} peak MiB" for v in values]
    header += [f"{last} first step ms", f"{last} tokens/s", f"{last} TFLOP/s"]
    header += [f"{last} vs {first}"] * pair
    body = []
    for key, by in lines.items():
        params = next((r["params"] for r in by.values() if r["params"]), None)
        cells = list(key) + [millions(params)]
        cells += [compared(by, v, "mean_ms") for v in values]
        cells += [compared(by, v, "peak_mib") for v in values]
        cells += [compared(by, last, f)
                  for f in ("first_step_ms", "tokens_per_s", "tflops")]
        speedup = ratio(compared(by, first, "mean_ms"),
                        compared(by, last, "mean_ms"))
        body.append(cells + [speedup] * pair)
    rep.table(header, body, fold=range(len(keys)))


def cmd_model(args):
    device = on_device(args)
    # torchrun: the models sharded, a batch a rank
    distributed = "WORLD_SIZE" in os.environ
    rank, world = 0, None
    if distributed:
        rank, _, world, device = ddp.init_distributed()
    if (args.cuda_graphs or args.memory_snapshot or args.nvtx) and device.type != "cuda":
        fail(args, "--cuda_graphs, --memory_snapshot and --nvtx need CUDA")
    combos = list(itertools.product(args.dtype, args.context_length,
                                    args.mode))
    groups = [("ours", s, c, a)
              for s in args.size for c in args.compile for a in args.attn]
    if args.peer:
        groups += [(args.peer, s, c, "sdpa")
                   for s in args.size for c in args.compile]
    rep, rows = Report(args, device, rank), []
    profiler = None
    if args.profile:
        profiler = torch.profiler.profile()
    recompute = []
    if args.act_ckpt_every:
        layers = args.act_ckpt_layers
        recompute.append(f"full {'all' if layers < 0 else layers}")
    if args.selective_recompute:
        recompute.append("selective")
    ours_recompute = " + ".join(recompute) or "none"
    peer_recompute = "every block" if distributed else "none"
    for who, size, how, attn in groups:
        built, status = None, "skipped"
        if rep.elapsed() <= args.time_budget:
            torch._dynamo.reset()  # the last model's code and guards go
            try:
                built = build(who, size, attn, how, args, device, world)
            except Exception as e:  # the weights do not fit: every row says so
                status = failure(e)
            free_memory(device)
        for dtype, ctx, mode in combos:
            cfg = dict(
                model=who, size=size, context_length=ctx,
                batch_size=args.batch_size, dtype=dtype,
                compile=how + " + step graph" * args.cuda_graphs, attn=attn,
                mode=mode,
                recompute=ours_recompute if who == "ours" else peer_recompute)
            if built is None:
                row = dict(cfg, params=None, status=status)
            elif rep.elapsed() > args.time_budget:
                row = dict(cfg, params=built["params"], status="skipped")
            else:
                gpu_ms = (device.type == "cuda" and not args.compare
                          and not distributed)
                row = run_config(cfg, built, device, args, gpu_ms, profiler)
            rows.append(row)
            result = fmt(row.get("mean_ms", row["status"]))
            text = f"{who} {size} {how} {attn} {dtype} ctx {ctx} {mode}"
            rep.progress(len(rows), len(groups) * len(combos),
                         f"{text}: {result}", rows=rows)
        built = None
        free_memory(device)
    rep.say(f"vocab {args.vocab_size}, {args.warmup} warm-up and {args.steps} timed steps; "
            f"fwd: inference forward and loss under no_grad; TFLOP/s by "
            f"model.flops_per_token (the causal half; naive attention in full)\n")
    if args.compare:
        print_compare(rep, rows, args.compare)
    else:
        print_rows(rep, rows, args.reference_tokens_per_s)
    ok = rows[0]["status"] == "ok"
    if args.profile and ok:
        profiler.export_chrome_trace(args.profile)
        top = profiler.key_averages().table(
            sort_by=f"self_{device.type}_time_total", row_limit=12)
        rep.say(f"torch.profiler over the timed steps (Chrome trace: "
                f"{args.profile})\n\n```\n{top}```\n")
    if args.memory_snapshot and ok:
        rep.say(f"Peak allocated per phase of the timed steps (their memory history: "
                f"{args.memory_snapshot})\n")
        rep.table(["phase", "peak MiB"], list(rows[0]["phase_peak_mib"].items()))
    panels = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        if r["status"] != "ok":
            continue
        title = f"{r[args.compare] if args.compare else ''} ms per step"
        series = " ".join(str(r[k]) for k in KEYS if k != args.compare)
        panels[title][series].append((r["context_length"], r["mean_ms"]))
    rep.plot(panels, "context length", "ms per step", log=True)
    if distributed:
        ddp.cleanup_distributed()
    return rows


# ---- attention: our FlashAttention beside PyTorch's
# Parts, most important first (a time budget cuts the last): anchors (dense
# causal bf16, B·S = 16384, H·D = 2048; the 8B model's S, the 2.7B's D);
# varlen (packed documents); sweep (one head over S and D); work (D=64 over
# B·H, each kernel family); sustained (at the power limit); compile (naive
# eager vs compiled).

BWD_FLOPS = 2.5  # attention's backward, in forward FLOPs
FWD_BWD_FLOPS = 3.5
MAX_SEQ = {  # the costly ones capped
    "naive": 16384,
    "naive-compiled": 16384,
    "flex": 65536,
    "sdpa-efficient": 65536,
}


def attention_flops(lengths, num_heads, head_dim):
    """Useful forward FLOPs of causal attention: Q K^T and P V, 2 L^2 D each
    per head, halved."""
    return sum(4 * num_heads * float(n) ** 2 * head_dim / 2 for n in lengths)


@functools.lru_cache(maxsize=None)
def flex_attention(dynamic):
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=dynamic)


def flex(n, device, doc_ids=None, dynamic=False):
    """Causal FlexAttention over n tokens (inside documents, given doc_ids)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, qi, ki):
        return qi >= ki

    def causal_in_documents(b, h, qi, ki):
        return (qi >= ki) & (doc_ids[qi] == doc_ids[ki])

    mask = causal if doc_ids is None else causal_in_documents
    block_mask = create_block_mask(mask, None, None, n, n, device=device)
    return lambda q, k, v: flex_attention(dynamic)(q, k, v, block_mask=block_mask)


def made(fn):  # a make(q, k, v) with nothing to set up
    return lambda q, k, v: fn


def sdpa(q, k, v):  # on SDPA's own choice of backend
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def on_backend(backend, fn):  # fn with flash.BACKEND set for each call
    return unittest.mock.patch.object(flash, "BACKEND", backend)(fn)


def dense_methods(cuda):
    """name -> make(q, k, v) -> fn(q, k, v) on (B, H, S, D); make does the
    per-shape setup, untimed."""
    def ours(q, k, v):
        return flash.flash_attention(q, k, v, causal=True)

    def naive(fn):
        def make(q, k, v):
            mask = model_py.causal_mask(q.shape[-2], q.device)
            return functools.partial(fn, mask=mask)
        return make

    reference = model_py.scaled_dot_product_attention
    methods = {
        "ours": made(ours),
        "naive": naive(reference),
        "naive-compiled": naive(torch.compile(reference)),
    }
    if cuda and flash.gluon and flash._is_sm90(torch.cuda.current_device()):
        methods["ours-triton"] = made(on_backend("triton", ours))
        methods["ours-gluon"] = made(on_backend("gluon", ours))
    if cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        # (a context manager made by contextmanager decorates too)
        for name in ("cudnn", "flash", "efficient"):
            backend = getattr(SDPBackend, f"{name.upper()}_ATTENTION")
            methods[f"sdpa-{name}"] = made(sdpa_kernel(backend)(sdpa))
        methods["flex"] = lambda q, k, v: flex(q.shape[-2], q.device)
    return methods


def padded(cu, length):
    """SDPA on packed (N, H, D) q, k, v laid out as right-padded
    (documents, H, length, D), and back."""
    documents = model_py.PaddedDocuments(cu, int(cu[-1]), length)

    def attend(q, k, v):
        q, k, v = (documents.pad(t).transpose(1, 2) for t in (q, k, v))
        return documents.unpad(sdpa(q, k, v).transpose(1, 2))
    return attend


def packed_methods(cu, max_seqlen, pad_length):
    """dense_methods on packed (N, H, D): sdpa-pad and sdpa-dynamic pad to
    pad_length and to the longest; fa2-varlen: PyTorch's internal FA2."""
    N = int(cu[-1])
    in_documents = flex(N, cu.device, model_py.document_ids(cu, N), None)

    def ours(q, k, v):
        return flash.flash_attn_varlen(q, k, v, cu, max_seqlen)

    def flex_packed(q, k, v):  # as (1, H, N, D)
        o = in_documents(*(t.transpose(0, 1)[None] for t in (q, k, v)))
        return o[0].transpose(0, 1)

    def fa2_varlen(q, k, v):  # an aten op with an autograd formula
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True, False,
            scale=q.shape[-1] ** -0.5)[0]

    methods = {
        "ours": ours,
        "flex": flex_packed,
        "sdpa-pad": padded(cu, pad_length),
        "sdpa-dynamic": padded(cu, max_seqlen),
    }
    if cu.is_cuda and flash.gluon and flash._is_sm90(cu.device.index):
        methods["ours-triton"] = on_backend("triton", ours)
    if cu.is_cuda:
        methods["fa2-varlen"] = fa2_varlen
    return {name: made(fn) for name, fn in methods.items()}


def time_fwd_bwd(make, q, k, v, do, rep, sustain=0):
    """fwd, bwd and fwd+bwd ms (sustain: sustained_ms), the host's ms per
    fwd+bwd, the memory after fwd; "OOM" or "n/a" (not taken here) for times."""
    cuda, readings = q.is_cuda, []
    out = dict.fromkeys(("fwd_ms", "bwd_ms", "fwd_bwd_ms", "host_ms",
                         "mib_after_fwd"))

    def median_ms(fn, host=None):
        if sustain and cuda:
            return sustained_ms(fn, q.device, sustain, readings)
        return kernel_ms(fn, q.device, rep, host)

    try:
        fn = make(q, k, v)
        o = fn(q, k, v)  # compiles, plans and autotunes for the shape
        out["fwd_ms"] = median_ms(lambda: fn(q, k, v))
        if cuda:
            out["mib_after_fwd"] = torch.cuda.memory_allocated(q.device) / 2**20

        def bwd():
            return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

        def fwd_bwd():
            return torch.autograd.grad(fn(q, k, v), (q, k, v), do)

        bwd()
        out["bwd_ms"] = median_ms(bwd)
        host = []
        out["fwd_bwd_ms"] = median_ms(fwd_bwd, host)
        out["host_ms"] = statistics.median(host) if host else None
    except (RuntimeError, NotImplementedError) as e:
        # OOM, or a kernel without a backward (FlexAttention on CPUs)
        status = "OOM" if is_oom(e) else "n/a"
        for key in ("fwd_ms", "bwd_ms", "fwd_bwd_ms"):
            if out[key] is None:
                out[key] = status
    o = fn = None
    free_memory(q.device)
    return dict(out, gpu=readings or None)


def attention_rows(part, case, methods, shape, dtype, flops, rep=50,
                   sustain=0):
    """A row per method (make, or a status) on random q, k, v, do."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(sum(shape))
    q, k, v, do = (torch.randn(shape, device=device, dtype=dtype, generator=g)
                   .requires_grad_(i < 3) for i in range(4))

    def tflops(f, ms):  # a status stays
        return f / ms / 1e9 if isinstance(ms, float) else ms

    rows = []
    for name, make in methods.items():
        if isinstance(make, str):
            times = dict.fromkeys(("fwd_ms", "bwd_ms", "fwd_bwd_ms"), make)
        else:
            times = time_fwd_bwd(make, q, k, v, do, rep, sustain)
        rows.append(dict(
            part=part, case=case, method=name, **times,
            fwd_tflops=tflops(flops, times["fwd_ms"]),
            bwd_tflops=tflops(BWD_FLOPS * flops, times["bwd_ms"]),
            fwd_bwd_tflops=tflops(FWD_BWD_FLOPS * flops, times["fwd_bwd_ms"])))
    return rows


def print_attention(rep, rows):
    gpu = any(r.get("gpu") for r in rows)
    ours = {}
    # a stable sort: ours rows first
    for r in sorted(rows, key=lambda r: not r["method"].startswith("ours")):
        ours.setdefault(r["case"], r)
    body = []
    for r in rows:
        o = ours.get(r["case"])
        vs = "—"
        if o is not None and o is not r:
            vs = " / ".join(ratio(o[k], r[k])
                            for k in ("fwd_tflops", "fwd_bwd_tflops"))
        clock = " / ".join(f"{mhz:.0f} MHz {w:.0f} W"
                           for mhz, w in r.get("gpu") or ())
        body.append([r["case"], r["method"], r["fwd_ms"], r["bwd_ms"],
                     r["fwd_bwd_ms"], r["fwd_tflops"], r["fwd_bwd_tflops"], vs,
                     r.get("host_ms"), r.get("mib_after_fwd")]
                    + [clock or None] * gpu)
    header = ["case", "method", "fwd ms", "bwd ms", "fwd+bwd ms",
              "fwd TFLOP/s", "fwd+bwd TFLOP/s",
              "ours (or the first) vs it, fwd / fwd+bwd",
              "host ms per fwd+bwd", "MiB after fwd"]
    header += ["GPU clock and power (fwd / bwd / fwd+bwd)"] * gpu
    rep.table(header, body, digits=[2, 2, 3, 3, 3, 0, 0, 2, 3, 0, 0])


def attention_cases(cuda):
    bf16, fp32 = torch.bfloat16, torch.float32
    if not cuda:  # the Triton interpreter: tiny stand-ins
        cases = dict.fromkeys(ATTN_PARTS, [(1, 2, 40, 16, fp32)])
        return dict(cases, varlen=[16], compile=[(2, 1, 24, 8, fp32)])
    anchors = [(16384 // s, 2048 // d, s, d, bf16)
               for d in (64, 128) for s in (1024, 4096, 16384)]
    anchors += [(1, 32, 32768, 128, bf16),  # the 8B model's sequence
                (4, 32, 2048, 80, bf16)]  # the 2.7B model's head dim
    return {
        "anchors": anchors,
        "varlen": [64, 128],
        "sweep": [(1, 1, 2 ** i, d, t) for d in (16, 32, 64, 128)
                  for i in range(7, 17) for t in (bf16, fp32)],
        "work": [(b, h, s, 64, bf16) for s in (512, 1024, 2048)
                 for b, h in ((4, 12), (12, 12), (16, 16), (16, 32), (32, 32))],
        "sustained": [(1, 32, 16384, 64, bf16), (1, 16, 16384, 128, bf16),
                      (1, 32, 32768, 128, bf16)],
        "compile": [(8, 1, s, d, fp32)
                    for d in (16, 64, 128) for s in (256, 1024, 4096, 16384)],
    }


def packed_case(d, wanted, device, gen, rep):
    """CUDA: 16384 tokens in lengths log-normal of median e^6 ~ 403, sigma 1,
    in [16, 4096]."""
    if device.type == "cuda":
        h, pad_length, dtype = 2048 // d, 4096, torch.bfloat16
        lens = document_lengths(None, math.exp(6.0), 1.0, 4096, gen,
                                total_tokens=16384).tolist()
    else:
        h, pad_length, dtype = 2, 24, torch.float32
        lens = [1, 5, 17, 9]
    cu = torch.tensor([0] + lens).cumsum(0).to(device, torch.int32)
    methods = packed_methods(cu, max(lens), pad_length)
    chosen = {n: m for n, m in methods.items() if n in wanted}
    case = f"docs={len(lens)} max={max(lens)} tokens={sum(lens)} H={h} D={d}"
    return attention_rows("varlen", case, chosen, (sum(lens), h, d), dtype,
                          attention_flops(lens, h, d), rep)


def dense_case(part, case, methods, wanted, args):
    b, h, s, d, dtype = case
    fp32 = dtype == torch.float32
    names = wanted
    if part == "work":
        names = ["ours", "ours-gluon", "ours-triton", "sdpa-cudnn"]
    if part == "compile":
        names = ["naive", "naive-compiled"]
    flex_ok = (not fp32 and d >= 64
               and (part in ("anchors", "sustained") or s in (1024, 16384)))
    chosen = {}
    for n in names:
        if n not in methods or (n == "flex" and not flex_ok):
            continue
        if s > MAX_SEQ.get(n, s):
            chosen[n] = "skipped"
        elif fp32 and n in ("sdpa-cudnn", "sdpa-flash"):
            chosen[n] = "n/a"
        else:
            chosen[n] = methods[n]
    sustain = args.sustain if part == "sustained" else 0
    name = f"B={b} H={h} S={s} D={d} {str(dtype)[6:]}"
    return attention_rows(part, name, chosen, (b, h, s, d), dtype,
                          b * attention_flops([s], h, d), args.rep, sustain)


def cmd_attention(args):
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    methods = dense_methods(cuda)
    wanted = args.methods or [m for m in methods
                              if m not in ("ours-gluon", "naive-compiled")]
    torch._dynamo.config.cache_size_limit = 64  # Flex compiles per shape
    # the timed backward reuses one compiled graph (retain_graph)
    torch._functorch.config.donated_buffer = False
    table = attention_cases(cuda)
    parts = [part for part in ATTN_PARTS if part in args.parts]
    if not cuda:  # one dense part stands for all
        dense = [p for p in parts if p not in ("varlen", "compile")]
        parts = dense[:1] + [p for p in parts if p in ("varlen", "compile")]
    jobs = [(part, case) for part in parts for case in table[part]]
    rows, rep = [], Report(args, device)
    gen = torch.Generator().manual_seed(1)
    for i, (part, case) in enumerate(jobs):
        if args.time_budget and rep.elapsed() > args.time_budget:
            rep.say(f"time budget reached: {len(jobs) - i} cases left out\n")
            break
        if part == "varlen":
            new = packed_case(case, wanted, device, gen, args.rep)
        else:
            new = dense_case(part, case, methods, wanted, args)
        rows += new
        name = new[0]["case"] if new else case
        rep.progress(i + 1, len(jobs), f"{part} {name}", rows=rows)
    rep.say("Causal. FLOPs: 4·B·H·S²·D/2 forward (the causal half), x2.5 backward, x3.5 "
            "forward+backward; packed cases count the work inside documents only. Times: "
            "medians of calls each with a cold L2 cache and the GPU kept busy until the "
            "host has issued the call (the GPU's work; the host's is its own column).\n")
    print_attention(rep, rows)
    return rows


# ---- varlen, hf: padding strategies, our model or GPT-2

def varlen_inputs(strategy, spans, tokens, ctx, budget, device, hf_model):
    """A batch of documents (token ranges) in `strategy`'s layout: ours as
    train.py makes it; Hugging Face's a row per document, or
    DataCollatorWithFlattening's."""
    layout = strategy.split(":")[1] if hf_model else strategy
    lengths = [e - s for s, e in spans]
    if hf_model and layout == "pack":
        from transformers import DataCollatorWithFlattening
        collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        features = [dict(input_ids=tokens[s:e].tolist(),
                         labels=tokens[s:e].tolist()) for s, e in spans]
        batch = dict(collate(features))
        if strategy.endswith(":compiled"):  # so that it compiles once
            batch.update(max_length_q=ctx, max_length_k=ctx)
    elif layout.startswith("pack"):
        x, y, cu_seqlens, max_seqlen = pack_batch(tokens, spans)
        if layout == "pack_static":
            x, y, cu_seqlens = pad_packed(x, y, cu_seqlens, budget + ctx, 0)
            max_seqlen = ctx
        batch = dict(idx=x, targets=y, cu_seqlens=cu_seqlens,
                     max_seqlen=int(max_seqlen))
    else:
        width = ctx if layout == "pad" else max(lengths)
        x, y = pad_batch(tokens, spans, width, 0)
        real = torch.arange(x.shape[1]) < torch.tensor(lengths)[:, None]
        mask = real.long()
        if hf_model:
            labels = x.masked_fill(mask == 0, -100)
            batch = dict(input_ids=x, attention_mask=mask, labels=labels)
        else:
            batch = dict(idx=x, targets=y)
    return {k: v.to(device) if torch.is_tensor(v) else v
            for k, v in batch.items()}


def varlen_model(args, device, hf_model):
    def ours(attn):
        return TransformerLM(args.vocab_size, args.context_length,
                             args.d_model, args.num_layers, args.num_heads,
                             args.d_ff, attn_impl=attn, device=device)
    if not hf_model:
        return ours
    from transformers import AutoModelForCausalLM, GPT2Config
    hf.register_hf_attention("ours")
    cfg = GPT2Config(vocab_size=args.vocab_size,
                     n_positions=args.context_length, n_embd=args.d_model,
                     n_layer=args.num_layers, n_head=args.num_heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False)

    def make(attn):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
        return model.to(device)
    return make


def print_varlen(rep, rows, strategies):
    # phase -> the first strategy's rate
    base = {r["phase"]: r.get("tokens_per_s") for r in reversed(rows)}
    body = []
    for r in rows:
        ms = r["status"]
        if r["status"] == "ok":
            ms = f"{r['mean_ms']:.2f} ± {r['std_ms']:.2f}"
        real = None
        if "token_slots" in r:
            real = f"{100 * r['real_tokens'] / r['token_slots']:.0f}%"
        rate = r.get("tokens_per_s")
        body.append([r["phase"], r["strategy"], ms, rate,
                     ratio(rate, base[r["phase"]]), real, r.get("peak_mib"),
                     fmt(r.get("loss_first_batch"), 5)])
    rep.table(["phase", "strategy", "ms/step", "real tokens/s",
               f"speedup vs {strategies[0]}", "real / slots", "peak MiB",
               "loss, batch 1 (same weights and targets)"], body, fold=[0])


def cmd_varlen(args):
    device, hf_model = on_device(args), args.command == "hf"
    strategies, phases = args.strategies.split(","), args.phases.split(",")
    rep, ctx = Report(args, device), args.context_length
    cuda = device.type == "cuda"
    g = torch.Generator().manual_seed(args.seed)
    lengths = document_lengths(args.num_docs, args.median_len, args.sigma,
                               ctx, g)
    docs = np.concatenate([[0], np.cumsum(lengths.numpy())]).astype(np.int64)
    tokens = torch.randint(args.vocab_size, (int(docs[-1]),), generator=g)
    tokens = tokens.numpy().astype(np.int64)
    budget = args.batch_size * ctx
    batches = [sample_documents(docs, budget, ctx, g)
               for _ in range(args.warmup + args.steps)]
    make = varlen_model(args, device, hf_model)
    attn = "eager" if hf_model else args.attn
    init = {k: v.clone() for k, v in make(attn).state_dict().items()}
    rep.say(f"Documents: {args.num_docs}, log-normal lengths of median "
            f"{args.median_len:g}, sigma {args.sigma:g} (mean "
            f"{lengths.float().mean():.0f}, max {int(lengths.max())}), in batches up to "
            f"{budget} real tokens. Model: d_model {args.d_model}, {args.num_layers} "
            f"layers, {args.num_heads} heads, vocab {args.vocab_size}, {args.dtype}; "
            f"compile {args.compile} (backend {args.backend}).\n")
    rows = []
    for phase, strategy in itertools.product(phases, strategies):
        row, out = dict(strategy=strategy, phase=phase, status="ok"), {}
        try:
            torch._dynamo.reset()
            net = make(strategy.split(":")[0] if hf_model else args.attn)
            net.load_state_dict(init)
            # (transformers) GPT-2 names no loss type: a warning, a graph break
            net.loss_type = "ForCausalLM"
            compiled = (strategy.endswith(":compiled")
                        or not hf_model and args.compile != "none")
            run = net
            if compiled:
                dynamic = None if hf_model else strategy != "pack_static"
                run = torch.compile(net, backend=args.backend, dynamic=dynamic)
            if hf_model:
                optimizer = torch.optim.AdamW(net.parameters(), lr=6e-4,
                                              fused=cuda)
            else:
                optimizer = AdamW(net.parameters(), lr=1e-4)
            data = [varlen_inputs(strategy, spans, tokens, ctx, budget,
                                  device, hf_model) for spans in batches]
            if hf_model and compiled and ":pack" in strategy:
                for kw in data:  # the row's length changes every step
                    for name in ("input_ids", "labels", "position_ids"):
                        torch._dynamo.mark_dynamic(kw[name], 1)

            def step(batch):
                net.zero_grad(set_to_none=True)
                grad = phase == "train"
                with torch.set_grad_enabled(grad), autocast(args.dtype, device):
                    loss = run(**batch)
                    # (transformers: an output holding it)
                    loss = getattr(loss, "loss", loss)
                if batch is data[0]:  # (a warm-up step: untimed)
                    out["loss"] = float(loss)
                if phase == "train":
                    loss.backward()
                    optimizer.step()

            if strategy == "pack_static":  # its few shapes compiled first
                for batch in {b["cu_seqlens"].shape: b for b in data}.values():
                    step(batch)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            it = iter(data)
            times = time_ms(lambda: step(next(it)), device,
                            warmup=args.warmup, steps=args.steps)
            real = sum(e - s - 1 for spans in batches[args.warmup:]
                       for s, e in spans)
            slots = sum(b["idx" if "idx" in b else "input_ids"].numel()
                        for b in data[args.warmup:])
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
            row.update(summary(times), loss_first_batch=out["loss"],
                       peak_mib=peak, real_tokens=real, token_slots=slots)
            row["tokens_per_s"] = real / sum(times) * 1e3
        except Exception as e:  # (transformers' refusals are paragraphs)
            row["status"] = failure(e, short=True)
        net = run = optimizer = data = None
        free_memory(device)
        rows.append(row)
        rate = fmt(row.get("tokens_per_s"))
        rep.progress(len(rows), len(phases) * len(strategies),
                     f"{strategy} {phase}: {rate} real tokens/s", rows=rows)
    print_varlen(rep, rows, strategies)
    series = {phase: [(r["strategy"], r["tokens_per_s"]) for r in rows
                      if r["phase"] == phase and r["status"] == "ok"]
              for phase in phases}
    rep.plot({"real tokens/s": series}, "strategy", "real tokens/s")
    return rows


# ---- rmsnorm, adamw: our kernels against PyTorch's

def make_adamw(cls, **option):  # each at lr 1e-4, weight decay 0.1
    return lambda params: cls(params, lr=1e-4, weight_decay=0.1, **option)


ADAMW = {
    "ours fused (the Triton kernel)": make_adamw(AdamW, fused=True),
    "ours foreach (fused=False)": make_adamw(AdamW, fused=False),
    "torch fused=True": make_adamw(torch.optim.AdamW, fused=True),
    "torch foreach=True": make_adamw(torch.optim.AdamW, foreach=True),
}


def cmd_rmsnorm(args):
    device = on_device(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rep, rows = Report(args, device), []
    for n, d in args.shapes:
        g = torch.Generator(device=device).manual_seed(n + d)
        x, dy = (torch.randn(n, d, device=device, dtype=dtype, generator=g)
                 .requires_grad_(i == 0) for i in range(2))
        norm = model_py.RMSNorm(d, eps=1e-5, device=device, dtype=dtype)
        gain = 1 + 0.1 * torch.randn(d, device=device, generator=g)
        weight = norm.weight = nn.Parameter(gain.to(dtype))
        methods = {
            "ours": lambda x: flash.rms_norm(x, weight, 1e-5),
            "inductor": torch.compile(norm, dynamic=False),
            "F.rms_norm": lambda x: F.rms_norm(x, (d,), weight, 1e-5),
            "copy": lambda x: x.clone(),
        }
        act, w = n * d * x.element_size(), d * weight.element_size()
        fwd_bytes = 2 * act + w  # x read, y written
        bwd_bytes = 3 * act + w  # x and dy read, dx written
        for name in args.methods:
            fn = methods[name]
            fn(x)  # compiles (inductor) or warms the kernels up
            fwd = kernel_ms(lambda: fn(x), device, args.rep)
            both = fwd_bwd_gb_s = bwd_gb_s = None
            if name != "copy":
                both = kernel_ms(
                    lambda: torch.autograd.grad(fn(x), [x, weight], dy),
                    device, args.rep)
                fwd_bwd_gb_s = (fwd_bytes + bwd_bytes) / both / 1e6
            if both and both > fwd:
                bwd_gb_s = bwd_bytes / (both - fwd) / 1e6
            rows.append(dict(shape=f"{n} x {d}", method=name, fwd_ms=fwd,
                             fwd_bwd_ms=both, fwd_gb_s=fwd_bytes / fwd / 1e6,
                             fwd_bwd_gb_s=fwd_bwd_gb_s, bwd_gb_s=bwd_gb_s))
        free_memory(device)
    copy = {r["shape"]: r["fwd_gb_s"] for r in rows if r["method"] == "copy"}

    def pct(r, key):  # of the copy's GB/s at the same shape
        base = copy.get(r["shape"])
        return r[key] and base and f"{100 * r[key] / base:.0f}%"

    rep.say("GB/s: the bytes each direction must move over its time (the backward's: over "
            "fwd+bwd less fwd); % of copy: that over the copy's GB/s at the same shape.\n")
    body = [[r["shape"], r["method"], r["fwd_ms"], r["fwd_gb_s"],
             pct(r, "fwd_gb_s"), r["fwd_bwd_ms"], r["fwd_bwd_gb_s"],
             pct(r, "fwd_bwd_gb_s"), pct(r, "bwd_gb_s")] for r in rows]
    rep.table(["shape", "method", "fwd ms", "fwd GB/s", "fwd % of copy",
               "fwd+bwd ms", "fwd+bwd GB/s", "fwd+bwd % of copy",
               "bwd % of copy"], body, [0, 0, 3, 0, 0, 3, 0], rows=rows)
    return rows


def cmd_adamw(args):
    device = on_device(args)
    sizes = ["gpt2", "xl"] if device.type == "cuda" else ["tiny"]
    rep, rows = Report(args, device), []
    for size in sizes:
        vocab = dict(gpt2=50304, tiny=512).get(size, 10000)
        net = TransformerLM(vocab, 16, **SIZES[size], device=device)
        ps = [nn.Parameter(t.detach()) for t in net.parameters()]
        for t in ps:
            t.grad = torch.randn_like(t) * 1e-2
        times = {}
        for name, make in ADAMW.items():
            opt = make(ps)
            opt.step()  # makes the state, untimed
            times[name] = kernel_ms(opt.step, device, args.rep)
            rep.progress(len(rows) + len(times), len(sizes) * len(ADAMW),
                         f"{size} {name}: {times[name]:.3f} ms")
        # a step reads p, g, m, v and writes p, m, v: 28 bytes a parameter
        n = sum(t.numel() for t in ps)
        fused = times["torch fused=True"]
        rows += [dict(size=size, params=n, optimizer=name, ms=ms,
                      tb_s=28 * n / ms / 1e9, vs_torch_fused=ratio(ms, fused))
                 for name, ms in times.items()]
        net = ps = opt = None
        free_memory(device)
    body = [[r["size"], millions(r["params"]), r["optimizer"], r["ms"],
             r["tb_s"], r["vs_torch_fused"]] for r in rows]
    rep.table(["size", "parameters", "optimizer", "ms/step",
               "TB/s (28 bytes a parameter)", "vs torch fused"], body,
              digits=[0, 0, 0, 3], rows=rows)
    return rows


# ---- ddp: all-reduce, data-parallel variants (under torchrun)

def _build_variant(variant, net, opt_cls, lr):
    """(ddp.Parallel, optimizer) of a DDP_VARIANTS name; net on its device."""
    impl, *options = variant.split("+")
    impl, _, size = impl.partition("-")
    unknown = set(options) - {"zero1", "bf16", "zero_redundancy"}
    if impl not in ddp.IMPLS or unknown or (size and impl != "bucketed"):
        raise ValueError(f"unknown variant {variant!r}; expected "
                         "impl[-MiB][+zero1][+bf16] with impl one of "
                         f"{ddp.IMPLS}, e.g. {DDP_VARIANTS}")
    dtype = torch.bfloat16 if "bf16" in options else None
    w = ddp.wrap(net, impl, bucket_size_mb=float(size or 25),
                 compute_dtype=dtype)
    if "zero_redundancy" in options:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return w, ZeroRedundancyOptimizer(w.parameters(), lr=lr,
                                          optimizer_class=opt_cls,
                                          weight_decay=0.1)
    return w, w.make_optimizer(opt_cls, zero1="zero1" in options, lr=lr,
                               weight_decay=0.1)


def slowest(times):
    """Per step, the slowest rank's ms (a step ends when every rank has)."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, times)
    return [max(ts[i] for ts in per_rank) for i in range(len(times))]


def allreduce_rows(args, device, world):
    """algbw: a call's bytes over its median time; busbw = algbw * 2 (N - 1) /
    N"""
    rows = []
    for size in args.allreduce_mb:
        x = torch.ones(int(size * 2**20) // 4, device=device)

        def refill():  # so that the sum stays finite
            x.fill_(1.0)
            dist.barrier()

        times = slowest(time_ms(lambda: dist.all_reduce(x), device,
                                warmup=args.warmup, steps=args.steps,
                                setup=refill))
        algbw = x.numel() * 4 / (statistics.median(times) / 1e3) / 2**30
        rows.append(dict(size_mib=size, ranks=world, **summary(times),
                         algbw_gib_s=algbw,
                         busbw_gib_s=algbw * 2 * (world - 1) / world))
    return rows


def variant_row(variant, args, device, x, y, vocab):
    cuda = device.type == "cuda"

    def memory():  # the peak so far, GiB
        return torch.cuda.max_memory_allocated(device) / 2**30 if cuda else math.nan

    free_memory(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    r, before, after = dict(variant=variant), [], []  # filled by each step
    try:
        torch.manual_seed(0)
        net = TransformerLM(vocab, args.context_length, **SIZES[args.preset],
                            device=device, attn_impl="flash" if cuda else "naive")
        wrapped, optimizer = _build_variant(variant, net, AdamW, 1e-4)
        r["peak_after_init_gib"] = memory()

        def step():
            with autocast("bf16" if cuda else "fp32", device):
                loss = wrapped(x, targets=y)
            loss.backward()
            wrapped.finish()
            before.append(memory())
            optimizer.step()
            after.append(memory())
            optimizer.zero_grad(set_to_none=True)
            r["loss"] = loss.detach()

        times = time_ms(step, device, warmup=args.warmup, steps=args.steps,
                        setup=dist.barrier)
        r["ms_per_step"] = statistics.median(slowest(times))
        # ZeroRedundancyOptimizer's local optimizer; DTensors: their shards
        state = getattr(optimizer, "optim", optimizer).state.values()
        state_bytes = sum(getattr(v, "_local_tensor", v).numel()
                          * v.element_size() for s in state
                          for v in s.values() if torch.is_tensor(v))
        r.update(peak_before_step_gib=max(before),
                 peak_after_step_gib=max(after), loss=r["loss"].item(),
                 optimizer_state_gib=state_bytes / 2**30)
    except Exception as e:  # (a baseline missing from this torch build)
        r["error"] = failure(e, short=True)
    return r


def ddp_cells(r, none):  # none: the ms of the variant "none"
    if "error" in r:
        return [r["variant"], r["error"]] + [""] * 7
    ms = r["ms_per_step"]
    comm = ms - none if none and r["variant"] != "none" else None
    return [r["variant"], ms, none and f"{100 * none / ms:.1f}%", comm,
            r["peak_after_init_gib"], r["peak_before_step_gib"],
            r["peak_after_step_gib"], f"{r['optimizer_state_gib']:.3g}",
            r["loss"]]


def cmd_ddp(args):
    rank, _, world, device = ddp.init_distributed()
    if not dist.is_initialized():
        fail(args, "needs several processes: run it under torchrun --nproc_per_node=N")
    rep, results = Report(args, device, rank), []
    allreduce = allreduce_rows(args, device, world)
    if allreduce:
        rep.say(f"All-reduce of fp32 tensors, {dist.get_backend()}; each call's time is "
                f"the slowest rank's\n")
        body = [[f"{r['size_mib']:g}", r["ranks"], r["median_ms"],
                 r["mean_ms"], r["algbw_gib_s"], r["busbw_gib_s"]]
                for r in allreduce]
        rep.table(["MiB", "ranks", "median ms", "mean ms", "algbw GiB/s",
                   "busbw GiB/s"], body, digits=[0, 0, 3, 3, 1, 1])
    vocab = 512 if args.preset == "tiny" else 50304
    # each rank its slice of the global batch
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    x, y = (torch.randint(0, vocab, (args.batch_size, args.context_length),
                          device=device, generator=g) for _ in range(2))
    for variant in args.variants:
        r = variant_row(variant, args, device, x, y, vocab)
        errors = [None] * world
        dist.all_gather_object(errors, r.get("error"))
        if any(errors):
            r = dict(variant=variant, error=next(e for e in errors if e))
        results.append(r)
        rep.progress(len(results), len(args.variants),
                     f"{variant}: {r.get('error') or r['ms_per_step']} ms")
    none = next((r["ms_per_step"] for r in results
                 if r["variant"] == "none" and "error" not in r), None)
    if results:
        rep.say(f"Data parallel: {args.preset}, vocab {vocab}, batch "
                f"{args.batch_size}/rank x {world} ranks, T {args.context_length}; "
                f"ms/step: the median of the slowest rank's; comm ms: step - none, the "
                f"communication not hidden behind compute\n")
        rep.table(["variant", "ms/step", "scaling vs none", "comm ms",
                   "peak init GiB", "peak before step GiB",
                   "peak after step GiB", "opt state GiB/rank", "loss"],
                  [ddp_cells(r, none) for r in results],
                  digits=[0, 1, 0, 1, 2, 2, 2, 0, 3])
    rep.save(allreduce=allreduce, results=results)
    ddp.cleanup_distributed()


# ---- bpe: our tokenizer against HF tokenizers and tiktoken (CPU)

def cmd_bpe(args):
    import tiktoken
    from bpe import Tokenizer, peak_rss_mb
    path, special = args.input, args.special
    workers, repeats = args.num_workers, args.repeats
    cpu, size = torch.device("cpu"), os.path.getsize(path)
    rep, train = Report(args, cpu), {"ours": [], "hf": []}
    rep.say(f"{path}: {size / 1e6:.1f} MB, vocab_size {args.vocab_size}, {workers} workers "
            f"of {os.cpu_count()} CPUs, python {platform.python_version()}, tiktoken "
            f"{tiktoken.__version__}\n")
    with tempfile.TemporaryDirectory(prefix="bench_bpe_") as tok_dir:
        for which in ("ours", "hf") * repeats:
            command = [sys.executable, os.path.abspath(__file__), "_bpe_train",
                       which, path, str(args.vocab_size), special,
                       str(workers), tok_dir]
            r = subprocess.run(command, capture_output=True, text=True,
                               stdin=subprocess.DEVNULL)
            if r.returncode != 0:
                last = r.stderr.strip().splitlines()[-1:]
                fail(args, f"the {which} training run failed: {last}")
            train[which].append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(f"train {which}: {train[which][-1]}", file=sys.stderr,
                  flush=True)
        tok = Tokenizer.from_files(os.path.join(tok_dir, "vocab.json"),
                                   os.path.join(tok_dir, "merges.txt"),
                                   [special])
    median_s = {w: statistics.median(x["seconds"] for x in runs) if runs
                else None for w, runs in train.items()}
    body = []
    for which, label in (("ours", "bpe.train_bpe"),
                         ("hf", "HF tokenizers BpeTrainer (ByteLevel)")):
        runs = train[which]
        seconds = ", ".join(fmt(x["seconds"], 1) for x in runs) or None
        body.append([label, median_s[which], seconds]
                    + [max((x[k] for x in runs), default=None)
                       for k in ("rss_mb", "worker_rss_mb")])
    rep.table([f"train, vocab {args.vocab_size}, {workers} workers",
               f"wall s (median of {repeats})", "all runs", "peak RSS main MB",
               "peak RSS largest worker MB"], body, digits=[2, 1, 2, 0, 0])
    vs_hf = median_s["ours"] / median_s["hf"] if median_s["hf"] else None
    rep.say(f"ratio ours / HF: {fmt(vs_hf)}x\n")
    peer = tok._tiktoken  # tiktoken's own Encoding of our ranks
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    docs = text.split(special)  # ~1 MB pieces of whole documents
    k = max(1, len(docs) * 2**20 // max(len(text), 1))
    pieces = [special.join(docs[i:i + k]) + special * (i + k < len(docs))
              for i in range(0, len(docs), k)]

    def timed(fn, what, want=None):
        """(median seconds over --repeats calls, the ids); the ids checked."""
        out = {}

        def call():
            out["ids"] = fn()
        seconds = statistics.median(time_ms(call, cpu, steps=repeats)) / 1e3
        if want is not None and out["ids"] != want:
            fail(args, f"{what} gives other ids than tiktoken on {path}")
        return seconds, out["ids"]

    t_peer, ids = timed(lambda: peer.encode(text, allowed_special="all"),
                        "tiktoken")

    def tiktoken_batch():
        return peer.encode_batch(pieces, num_threads=workers,
                                 allowed_special="all")
    t_batch, batch_ids = timed(tiktoken_batch, "")

    def encode_file():
        chunks = tok.encode_file(path, workers, verbose=False)
        return np.concatenate(list(chunks)).tolist()

    cases = [
        ("1 thread: Tokenizer.encode(text) vs tiktoken encode(text, allowed_special='all')",
         timed(lambda: tok.encode(text), "Tokenizer.encode", ids)[0], t_peer),
        (f"{workers} threads: Tokenizer.encode_batch(1 MB pieces) vs "
         "tiktoken encode_batch",
         timed(lambda: tok.encode_batch(pieces, workers),
               "Tokenizer.encode_batch", batch_ids)[0], t_batch),
        (f"{workers} threads: Tokenizer.encode_file(path) (reads the file) "
         "vs tiktoken encode_batch",
         timed(encode_file, "Tokenizer.encode_file", ids)[0], t_batch),
    ]
    encode = [dict(case=c, ours_s=o, tiktoken_s=t, ours_mb_s=size / o / 1e6,
                   tiktoken_mb_s=size / t / 1e6, ours_vs_tiktoken=t / o)
              for c, o, t in cases]
    body = [[e["case"], e["ours_mb_s"], e["tiktoken_mb_s"],
             e["ours_vs_tiktoken"]] for e in encode]
    rep.table([f"encode {size / 1e6:.1f} MB, {len(ids):,} tokens "
               f"({size / len(ids):.2f} bytes/token)", "ours MB/s",
               "tiktoken MB/s", "ours / tiktoken"], body, [2, 1, 1, 2])
    rep.say(f"peak RSS of this process (encode side, torch imported): "
            f"{peak_rss_mb()[0]:.0f} MB")
    rep.save(bytes=size, tokens=len(ids), train=train, train_median_s=median_s,
             ours_vs_hf=vs_hf, encode=encode)
    return rep.data


# ---- sass: what the compiler made of flash.py's attention kernels for an H100/H200 (sm_90), on any machine ----------

SASS_TYPES = {"LSE": "*fp32", "DELTA": "*fp32", "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32",
              "counter": "*i32", "qk_scale": "fp32", "sm_scale": "fp32",
              **{t: "*bf16" for t in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}}


def sass_stats(kernel_fn, types, constexprs, options, gluon_source=False):
    """One kernel compiled for sm_90 and read with the cuobjdump and ptxas Triton carries: a row for cmd_sass's table.
    Pointers and the integers Triton would specialize are marked multiples of 16, as at the dense shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    source = ASTSource
    if gluon_source:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in kernel_fn.arg_names}
    skip = {p.name for p in kernel_fn.params if p.do_not_specialize}
    attrs = {}
    for i, name in enumerate(kernel_fn.arg_names):
        kind = signature[name]
        for path, t in ([((i, j), t) for j, t in enumerate(kind)] if isinstance(kind, tuple) else [((i,), kind)]):
            if t.startswith("*") or (t == "i32" and name not in skip):
                attrs[path] = [["tt.divisibility", 16]]
    kernel = triton.compile(source(fn=kernel_fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        run = lambda *a: subprocess.run(a, capture_output=True, text=True)  # noqa: E731
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


def sass_rows(flash, d, varlen, causal):
    """bench.py sass's rows for head dim d: the Triton kernels (head dims with a tile class of their own) and the
    Gluon ones, each as flash.py launches it (the backward's DKV_TMA as at S=1024)."""
    rows = []
    if (d, 2) in flash.FWD_CONFIGS:
        common = dict(HEAD_DIM=d, CAUSAL=causal, VARLEN=varlen, PREC="tf32")
        for name, tuned, table, extra in (("fwd (Triton)", flash._attn_fwd, flash.FWD_CONFIGS, {}),
                                          ("dq (Triton)", flash._attn_bwd_dq, flash.DQ_CONFIGS, {}),
                                          ("dkdv (Triton)", flash._attn_bwd_dkdv, flash.DKDV_CONFIGS,
                                           dict(GROUP=1, EVEN_Q=not varlen))):
            fn = getattr(tuned, "fn", tuned)  # the JITFunction under the autotuner
            m, n, w, s = table[(d, 2)][0]
            cx = dict(common, BLOCK_M=m, BLOCK_N=n, **extra)
            options = {"num_warps": w, "num_stages": s}
            rows.append([d, name, str((m, n, w, s))] + sass_stats(fn, SASS_TYPES, cx, options))
    tiles = flash._gluon_head_tiles(d) if flash.gluon is not None else None
    if tiles is None:
        return rows
    main, tail = tiles

    def desc(rows, cols, dtype="bf16", swizzle=None):  # the type of a descriptor of (rows x cols) tiles
        block = [rows, 1, cols] if varlen else [1, 1, rows, cols]
        layout = flash._smem_layout(tuple(block), torch.float32 if dtype == "fp32" else torch.bfloat16, swizzle)
        return f"tensordesc<{dtype}{block},{layout!r}>"

    def descs(cols, **rows):  # name=rows: tiles of (rows x cols)
        return {name: desc(r, cols) for name, r in rows.items()}

    m, n, stages, q_bufs = flash.GLUON_FWD_CONFIGS[main + tail]
    cx = dict(NUM_STAGES=stages, Q_BUFS=q_bufs, CAUSAL=causal, HEAD_MAJOR=not varlen, DYNAMIC=True, O_TMA=tail == 0)
    types = dict(SASS_TYPES, **descs(main, q_desc=m, k_desc=n, v_desc=n, o_desc=m),
                 **descs(tail or main, qt_desc=m, kt_desc=n, vt_desc=n))
    rows.append([d, "fwd (Gluon, sm90)", str((2 * m, n, 9, stages))] + sass_stats(
        flash._gl_attn_fwd, types, cx, {"num_warps": 4, "maxnreg": 168}, gluon_source=True))
    m, n, stages, split, persistent, dq_swizzle = flash.GLUON_BWD_CONFIGS[main + tail]
    cx = dict(NUM_STAGES=stages, CAUSAL=causal, DYNAMIC=persistent,
              DKV_TMA=flash._gluon_bwd_dkv_tma(tail, persistent, 1024, split))
    dq = desc(m, main // split, "fp32", dq_swizzle)  # (a tail's dQ tiles: the default swizzle)
    types = dict(SASS_TYPES, dq_desc=dq, dqt_desc=desc(m, tail, "fp32") if tail else dq,
                 **descs(main, q_desc=m, k_desc=n, v_desc=n, do_desc=m, dk_desc=n, dv_desc=n),
                 **descs(tail or main, qt_desc=m, kt_desc=n, vt_desc=n, dot_desc=m))
    rows.append([d, "bwd (Gluon, sm90)", str((m, 2 * n, 10, stages))] + sass_stats(
        flash._gl_attn_bwd, types, cx, {"num_warps": 4, "maxnreg": 168}, gluon_source=True))
    return rows


def cmd_sass(args):
    """Compile the attention kernels for sm_90 without a GPU and print registers, spills, SASS size, shared memory
    (a Hopper block has at most 227 KiB) and whether ptxas serialized the tensor-core (wgmma) instructions (its
    notes C7514/C7515, a slower kernel). Run it after changing a kernel's loop structure or a config, with the
    Triton the GPU machine has, installed aside:
        pip install --no-deps --target /tmp/triton36 triton==3.6.0
        PYTHONPATH=/tmp/triton36 python bench.py sass"""
    if flash.INTERPRET:  # the kernels were defined for the interpreter: compile them in a process that does not
        env = dict(os.environ, TRITON_INTERPRET="0")
        return subprocess.run([sys.executable, os.path.abspath(__file__), "sass"] + args.argv, env=env).returncode
    rep = Report(args, torch.device("cpu"))
    rep.say(f"Triton {triton.__version__}, sm_90, bf16, {'non-causal' if args.full else 'causal'}, "
            f"{'packed' if args.varlen else 'dense'}; integer arguments marked divisible by 16 as at the dense "
            f"shapes, except do_not_specialize ones\n")
    rows = [row for d in map(int, args.head_dims.split(",")) for row in sass_rows(flash, d, args.varlen, not args.full)]
    rep.table(["D", "kernel", "config (M, N, warps, stages)", "registers", "stack bytes", "spill loads",
               "spill stores", "SASS instructions", "shared KiB", "wgmma serialized"], rows, digits=1, rows=rows)
    return 0


# ---- dispatch -------------------------------------------------------------------------------------------------------

RUN = dict(
    model=cmd_model,
    attention=cmd_attention,
    varlen=cmd_varlen,
    hf=cmd_varlen,
    rmsnorm=cmd_rmsnorm,
    adamw=cmd_adamw,
    ddp=cmd_ddp,
    allreduce=cmd_ddp,
    bpe=cmd_bpe,
    sass=cmd_sass,
)


def main(argv=None):
    """Runs one subcommand; returns its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = cli().parse_args(argv)
    args.argv = argv[1:]  # (the header's command line)
    rc = RUN[args.command](args)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
