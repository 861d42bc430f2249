"""Attention benchmark (SPEC §7.5, issue 4 §6), written to be pasted into bench.py as `cmd_attention`:

    python bench.py attention                 # H200: §7.5 sweep + ANCHORS shapes + packed documents (~8 min)
    python bench.py attention --quick         # a few shapes; on CPU a tiny smoke test (naive + ours, interpreter)
    python bench.py attention --json out.json --plot attention.png

Ours (flash.flash_attention / flash_attn_varlen) against PyTorch SDPA's flash, cuDNN and memory-efficient backends,
FlexAttention (compiled) and naive PyTorch; forward, backward and forward+backward with triton.testing.do_bench.
FLOPs: 4·B·H·S²·D/2 for a causal forward (half of QKᵀ and PV), ×2.5 for backward, ×3.5 for forward+backward
(ANCHORS.md convention); packed documents count only the useful work, Σ 4·H·L²·D/2.
On a machine without CUDA, TRITON_INTERPRET=1 must be set before flash (triton) is imported.
"""
import argparse
import datetime
import json
import math
import time

import torch

import flash

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
    import torch.nn.functional as F

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
    methods = {"ours": lambda q, k, v: (lambda q, k, v: flash.flash_attention(q, k, v, causal=True)),
               "naive": lambda q, k, v: (lambda q, k, v: flash.attention_reference(q, k, v, True)[0])}
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


def varlen_case(lens, h, d, dtype, rep, with_peers=True):
    """Ours (packed) vs FlexAttention with a document mask vs SDPA flash on documents padded to the batch max."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    total, max_len = sum(lens), max(lens)
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
    gen = torch.Generator(device=device).manual_seed(total + d)
    q, k, v = (torch.randn(total, h, d, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(q.shape, device=device, dtype=dtype, generator=gen)
    useful = sum(4 * h * n * n * d / 2 for n in lens)
    case = f"docs={len(lens)} max={max_len} tokens={total} H={h} D={d}"
    makes = {"ours varlen": lambda q, k, v: (lambda q, k, v: flash.flash_attn_varlen(q, k, v, cu, max_len))}
    if torch.cuda.is_available() and with_peers:
        from torch.nn.attention import SDPBackend
        doc_ids = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
        to_dense = lambda x: x.detach().transpose(0, 1)[None].contiguous().requires_grad_()
        makes["flex doc-mask"] = ("dense", lambda q, k, v: _flex(q, k, v, doc_ids))
        makes["sdpa-flash dyn-pad"] = ("padded", _sdpa(SDPBackend.FLASH_ATTENTION))
    rows = []
    for name, make in makes.items():
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


def markdown_table(rows):
    """One line per (case, method): ms and TFLOP/s, plus ours' fwd+bwd speed over the method's (>1: ours faster)."""
    ours = {r["case"]: r for r in rows if r["method"].startswith("ours")}
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


def plot(rows, path):
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
    p = argparse.ArgumentParser(prog="bench.py attention", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few shapes (CPU: tiny interpreter smoke test)")
    p.add_argument("--json", help="write all rows to this JSON file")
    p.add_argument("--plot", help="write a PNG of the sweep (needs matplotlib)")
    p.add_argument("--rep", type=int, default=50, help="do_bench repetition time per measurement, ms")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    methods = dense_methods()
    jobs = []  # (tag, b, h, s, d, dtype)
    if not cuda:
        jobs += [("sweep", 1, 2, s, 16, torch.float32) for s in (16, 40)]
    elif args.quick:
        jobs += [("sweep", 1, 16, s, d, torch.bfloat16) for d in (64, 128) for s in (1024, 4096)]
    else:
        jobs += [("sweep", 1, 1, s, d, dt) for dt in (torch.bfloat16, torch.float32) for d in SWEEP_D for s in SWEEP_SEQ]
        jobs += [("anchors", 16384 // s, 2048 // d, s, d, torch.bfloat16) for d, s in ANCHOR_SHAPES]
    rows, t0 = [], time.time()
    for i, (tag, b, h, s, d, dt) in enumerate(jobs):
        ms = {n: m for n, m in methods.items() if n != "flex" or (dt != torch.float32 and d >= 64)}
        rows += dense_case(b, h, s, d, dt, ms, args.rep, tag)
        el = time.time() - t0
        print(f"[{i + 1}/{len(jobs)}] {tag} B={b} H={h} S={s} D={d} {dt}: {el:.0f}s elapsed, "
              f"ETA {el / (i + 1) * (len(jobs) - i - 1):.0f}s", flush=True)
    gen = torch.Generator().manual_seed(1)
    for d in ((16,) if not cuda else (64, 128)):
        lens = anchor_doc_lengths(gen=gen) if cuda else [1, 5, 17, 9]
        rows += varlen_case(lens, 2048 // d if cuda else 2, d, torch.bfloat16 if cuda else torch.float32, args.rep)
        print(f"varlen D={d}: {time.time() - t0:.0f}s elapsed", flush=True)
    device = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)"
    print(f"\n`python bench.py attention {' '.join(argv)}` — {datetime.date.today()} — {device}, torch "
          f"{torch.__version__}; causal; TFLOP/s as in the module docstring\n")
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(argv=argv, device=device, date=str(datetime.date.today()), rows=rows), f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return rows
