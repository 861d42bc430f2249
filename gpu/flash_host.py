"""Where the host time of a flash.py call goes (issue 4: our forward+backward costs about 0.7 ms of host time per
call eager, more under torch.compile, against 0.2 ms for SDPA). Times calls on a tiny shape (so the GPU work is
negligible), eager and compiled, ours vs SDPA, then profiles the Python side with cProfile. Run from the repository
root on a GPU: python gpu/flash_host.py"""
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flash  # noqa: E402
from overhead import per_call_us  # noqa: E402  (gpu/ is on the path when this file runs)


def profile(name, fn, n=100, top=22):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    print(f"\n### cProfile: {name}, {n} calls (tottime order)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main():
    x = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)  # (B, S, H, D) as the model has them
    q, k, v = (x.clone().requires_grad_() for _ in range(3))
    do = torch.randn_like(x)

    def ours(q, k, v):
        return flash.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)
    ours_c, sdpa_c = torch.compile(ours), torch.compile(sdpa)
    step = lambda f: (lambda: f(q, k, v).backward(do))
    rows = [("ours eager", step(ours)), ("ours compiled", step(ours_c)), ("SDPA eager", step(sdpa)),
            ("SDPA compiled", step(sdpa_c))]
    print("| fwd+bwd (B=1, S=128, H=2, D=64, bf16) | us per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {per_call_us(fn):.0f} |", flush=True)
    profile("ours eager fwd+bwd", step(ours))
    profile("ours compiled fwd+bwd", step(ours_c))


if __name__ == "__main__":
    main()
