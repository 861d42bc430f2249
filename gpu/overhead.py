"""Host-side cost per call of flash.py on tiny shapes (the GPU work is negligible there, so the time per call is
launch and Python overhead), against SDPA. Run from the repository root on a GPU: python gpu/overhead.py"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flash  # noqa: E402


def per_call_us(fn, n=300):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    q, k, v, do = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(4))
    qp, kp, vp, dop = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v, do))
    cu = torch.tensor([0, 50, 128], dtype=torch.int32, device="cuda")
    o, lse = flash._forward(q.detach(), k.detach(), v.detach(), True)
    rows = [
        ("flash._forward (launcher only)", lambda: flash._forward(q.detach(), k.detach(), v.detach(), True)),
        ("flash._backward (launcher only)", lambda: flash._backward(do.detach(), q.detach(), k.detach(), v.detach(), o,
                                                                    lse, True)),
        ("flash_attention fwd (custom op)", lambda: flash.flash_attention(q.detach(), k.detach(), v.detach())),
        ("flash_attention fwd+bwd", lambda: flash.flash_attention(q, k, v).backward(do)),
        ("flash_attn_varlen fwd+bwd", lambda: flash.flash_attn_varlen(qp, kp, vp, cu, 78).backward(dop)),
        ("SDPA fwd", lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True)),
        ("SDPA fwd+bwd", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)),
    ]
    print("| call (B=1, H=2, S=128, D=64, bf16) | us per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {per_call_us(fn):.0f} |", flush=True)


if __name__ == "__main__":
    main()
