"""Where does the backward's time go between flash.py's kernels and the autograd call a user makes? bench.py
attention timed our D=128, S=4096 backward at 2.15 ms (call 24) while flash._backward alone took 1.90 ms
(gpu/autotune_check.py, call 23). For each ANCHORS shape at S=4096: the direct call, the autograd call
(torch.autograd.grad through flash.flash_attention, as bench.py times it), and a CUDA profile of the autograd call
listing every kernel with its time. Run from the repository root on a GPU: python gpu/bwd_gap.py"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import triton  # noqa: E402

import flash  # noqa: E402


def main():
    torch.manual_seed(0)
    for B, H, S, d in ((4, 16, 4096, 128), (4, 32, 4096, 64)):
        q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
        do = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16)
        o = flash.flash_attention(q, k, v, causal=True)
        o_, lse = flash._forward(q.detach(), k.detach(), v.detach(), True)
        grad = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        direct = lambda: flash._backward(do, q.detach(), k.detach(), v.detach(), o_, lse, True)
        grad(), direct()
        for rep in (25, 100):
            print(f"B={B} H={H} S={S} D={d} rep={rep}: direct {triton.testing.do_bench(direct, rep=rep):.3f} ms, "
                  f"autograd {triton.testing.do_bench(grad, rep=rep):.3f} ms", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                grad()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
