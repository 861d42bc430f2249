"""Where the time of a packed training step goes (issue 7), on one GPU: the bench.py varlen setup (same model,
same long-tailed documents), train steps for pad and pack eager and compiled, pack at larger token budgets, and
the top CUDA kernels of one eager pad and one eager pack step. Run from the repository root:
python gpu/varlen_probe.py [OUT_DIR]"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench  # noqa: E402
from model import TransformerLM, cross_entropy  # noqa: E402
from train import AdamW, pack_batch, pad_batch, sample_documents  # noqa: E402

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
smoke = not torch.cuda.is_available()  # a tiny CPU run that only checks the script
dev = torch.device("cpu" if smoke else "cuda")
ctx, V = (64, 500) if smoke else (1024, 10000)
g = torch.Generator().manual_seed(0)
lengths = bench.document_lengths(20000, 200.0, 0.8, ctx, g)
docs = np.concatenate([[0], np.cumsum(lengths.numpy())]).astype(np.int64)
tokens = torch.randint(V, (int(docs[-1]),), generator=g).numpy().astype(np.int64)
net = TransformerLM(V, ctx, *((32, 1, 2, 64) if smoke else (768, 12, 12, 3072)), attn_impl="naive" if smoke else "flash",
                    device=dev)
opt = AdamW(net.parameters(), lr=1e-4)


def sync():
    if not smoke:
        torch.cuda.synchronize()


def inputs(strategy, spans):
    if strategy == "pack":
        x, y, cu, mx = pack_batch(tokens, spans)
        return x.to(dev), y.to(dev), dict(cu_seqlens=cu.to(dev), max_seqlen=mx)
    x, y = pad_batch(tokens, spans, ctx, 0)
    return x.to(dev), y.to(dev), {}


def step(fn, x, y, kw):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(dev.type, torch.bfloat16, enabled=not smoke):
        loss = cross_entropy(fn(x, **kw), y)
    loss.backward()
    opt.step()


def run(name, strategy, budget, fn, n_warm=3, n=8):
    batches = [sample_documents(docs, budget, ctx, g) for _ in range(n_warm + n)]
    data = [inputs(strategy, s) for s in batches]
    real = [sum(e - s - 1 for s, e in sp) for sp in batches]
    for d in data[:n_warm]:
        step(fn, *d)
    sync()
    t0 = time.perf_counter()
    for d in data[n_warm:]:
        step(fn, *d)
    sync()
    dt = time.perf_counter() - t0
    tps = sum(real[n_warm:]) / dt
    print(f"| {name} | {strategy} | {budget} | {1e3 * dt / n:.1f} | {tps:,.0f} |", flush=True)
    return tps


def profile(strategy, budget):
    spans = sample_documents(docs, budget, ctx, g)
    d = inputs(strategy, spans)
    step(net, *d)
    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                             + ([] if smoke else [torch.profiler.ProfilerActivity.CUDA])) as prof:
        step(net, *d)
        sync()
    table = prof.key_averages().table(sort_by="cpu_time_total" if smoke else "cuda_time_total", row_limit=25, max_name_column_width=70)
    with open(os.path.join(out_dir, f"profile_{strategy}.txt"), "w") as f:
        f.write(table)
    print(f"\n### top ops, one eager {strategy} step (budget {budget})\n{table}", flush=True)


print("| model | strategy | real-token budget | ms/step | real tokens/s |\n|---|---|---|---|---|")
res = {}
K = 64 if smoke else 8192
res["pad"] = run("eager", "pad", K, net)
res["pack"] = run("eager", "pack", K, net)
res["pack16"] = run("eager", "pack", 2 * K, net)
res["pack32"] = run("eager", "pack", 4 * K, net)
profile("pack", K)
profile("pad", K)
compiled = torch.compile(net)
res["cpad"] = run("compiled", "pad", K, compiled)
res["cpack"] = run("compiled", "pack", K, compiled, n_warm=4)
res["cpack32"] = run("compiled", "pack", 4 * K, compiled, n_warm=4)
print({k: round(v / res["pad"], 2) for k, v in res.items()})
