"""Where a compiled GPT-2-small training step spends its time: ours (TransformerLM, tied, sdpa, our AdamW) vs the
torch.nn GPT-2 peer of bench.py gpt2 (torch fused AdamW), same batch. Prints per step the host time of each phase
(until the call returns), the GPU time between phase boundaries (CUDA events), the kernel time by category and
the top kernels. Run from the repository root: python gpu/gpt2_profile.py [--attn flash]"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench  # noqa: E402
from model import TransformerLM, cross_entropy  # noqa: E402
from train import AdamW  # noqa: E402

V, T, B, D, L, H = 50304, 1024, 12, 768, 12, 12


def category(name):
    n = name.lower()
    for key, cat in (("gemm", "matmul"), ("nvjet", "matmul"), ("cutlass", "matmul"), ("sm90", "matmul"),
                     ("flash", "attention"), ("fmha", "attention"), ("attn", "attention"), ("adamw", "optimizer"),
                     ("triton", "fused elementwise/reduction (inductor)"), ("elementwise", "eager elementwise")):
        if key in n:
            return cat
    return "other"


def run(name, net, loss_of, opt):
    loss_fn = torch.compile(loss_of)
    gen = torch.Generator().manual_seed(0)
    x, y = bench.random_batch(V, B, T, "cuda", gen)

    marks = []

    def mark():
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((time.perf_counter(), ev))

    def step():
        mark()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = loss_fn(x, y)
        mark()
        loss.backward()
        mark()
        opt.step()
        mark()
    for _ in range(8):
        step()
    torch.cuda.synchronize()
    host, gpu = [0.0] * 3, [0.0] * 3
    n = 10
    for _ in range(n):
        marks.clear()
        step()
        torch.cuda.synchronize()
        for i in range(3):
            host[i] += (marks[i + 1][0] - marks[i][0]) * 1e3 / n
            gpu[i] += marks[i][1].elapsed_time(marks[i + 1][1]) / n
    wall = sum(gpu)
    print(f"\n## {name}: phases (forward+loss, backward, optimizer) host ms " + ", ".join(f"{h:.2f}" for h in host)
          + "; GPU ms between the marks " + ", ".join(f"{g:.2f}" for g in gpu) + f"; step {wall:.2f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / 3 / 1e3
    print(f"## {name}: {total:.2f} ms of kernel time per step")
    cats = {}
    for e in events:
        cats[category(e.key)] = cats.get(category(e.key), 0) + e.self_device_time_total / 3 / 1e3
    for c, ms in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"  {c:45s} {ms:7.2f} ms")
    print("  top kernels (ms per step, calls per step):")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:22]:
        print(f"  {e.self_device_time_total / 3 / 1e3:7.3f} {e.count // 3:4d}  {e.key[:110]}")


def main():
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    attn = sys.argv[sys.argv.index("--attn") + 1] if "--attn" in sys.argv else "sdpa"
    ours = TransformerLM(V, T, D, L, H, 2048, attn_impl=attn, tie_embeddings=True, device="cuda")
    run(f"ours ({attn})", ours, lambda a, b: cross_entropy(ours(a), b),
        AdamW(ours.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1))
    del ours
    peer = bench.PeerGPT(V, T, D, L, H, device="cuda")
    run("peer", peer, lambda a, b: F.cross_entropy(peer(a).flatten(0, 1), b.flatten()),
        torch.optim.AdamW(peer.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True))


if __name__ == "__main__":
    main()
