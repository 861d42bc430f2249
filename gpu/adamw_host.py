"""Why our AdamW step costs milliseconds of host time inside a compiled GPT-2-small training step (gpu/gpt2_profile.py
showed 9.6 ms host for a 0.84 ms kernel): counts chunk-table rebuilds, reports synchronizing CUDA calls
(torch.cuda.set_sync_debug_mode) and profiles opt.step() on the host. Run from the repository root:
python gpu/adamw_host.py"""
import cProfile
import os
import pstats
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import bench  # noqa: E402
import train  # noqa: E402
from model import TransformerLM, cross_entropy  # noqa: E402


def main():
    torch.manual_seed(0)
    net = TransformerLM(50304, 1024, 768, 12, 12, 2048, attn_impl="sdpa", tie_embeddings=True, device="cuda")
    opt = train.AdamW(net.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    loss_fn = torch.compile(lambda a, b: cross_entropy(net(a), b))
    x, y = bench.random_batch(50304, 12, 1024, "cuda", torch.Generator().manual_seed(0))
    builds = {"n": 0}
    real = train._chunk_table

    def counting(*a):
        builds["n"] += 1
        return real(*a)
    train._chunk_table = counting

    def fwd_bwd():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = loss_fn(x, y)
        loss.backward()
    for _ in range(6):
        fwd_bwd()
        opt.step()
    torch.cuda.synchronize()
    builds["n"] = 0
    host = {"after backward": 0.0, "after a sync": 0.0}
    for _ in range(5):
        fwd_bwd()
        t0 = time.perf_counter()
        opt.step()
        host["after backward"] += (time.perf_counter() - t0) * 200
        torch.cuda.synchronize()
        fwd_bwd()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        host["after a sync"] += (time.perf_counter() - t0) * 200
    print(f"opt.step() host ms: {host}; chunk-table builds in 10 steps: {builds['n']}")
    fwd_bwd()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    torch.cuda.set_sync_debug_mode(0)
    print(f"synchronizing calls in one opt.step(): {len(caught)}")
    for w in caught[:5]:
        print("  ", str(w.message)[:300])
    fwd_bwd()
    prof = cProfile.Profile()
    prof.enable()
    opt.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumtime").print_stats(18)


if __name__ == "__main__":
    main()
