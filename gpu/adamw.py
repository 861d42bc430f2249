"""Our AdamW step (train.AdamW: the fused Triton kernel, and the foreach path) vs torch.optim.AdamW fused / foreach
on GPT-2-small-sized parameters (issue 3: ours within 1.2x of fused), after checking the fused kernel against the
foreach path. Run from the repository root on a GPU: python gpu/adamw.py"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import train  # noqa: E402
from model import TransformerLM  # noqa: E402

torch.manual_seed(0)
model = TransformerLM(50304, 1024, 768, 12, 12, 3072, device="cuda")
kw = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def fresh():
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) * 1e-3
    return params


def bench(make, steps=50):
    params = fresh()
    opt = make(params)
    for _ in range(5):
        opt.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1000


a, b = fresh(), fresh()
oa, ob = train.AdamW(a, fused=True, **kw), train.AdamW(b, fused=False, **kw)
for _ in range(3):
    oa.step()
    ob.step()
err = max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))
print(f"fused vs foreach after 3 steps: max relative difference {err:.2e}")
assert err < 1e-5, err

rows = []
for block in (1024, 2048, 4096):
    train.ADAMW_BLOCK = block
    rows.append((f"ours fused (Triton, {block}-element chunks)", bench(lambda ps: train.AdamW(ps, fused=True, **kw))))
train.ADAMW_BLOCK = 2048
rows.append(("ours foreach (fused=False)", bench(lambda ps: train.AdamW(ps, fused=False, **kw))))
fused = bench(lambda ps: torch.optim.AdamW(ps, fused=True, **kw))
rows.append(("torch fused=True", fused))
rows.append(("torch foreach=True", bench(lambda ps: torch.optim.AdamW(ps, foreach=True, **kw))))
n = sum(p.numel() for p in model.parameters())
print(f"AdamW step, {n / 1e6:.1f}M fp32 params, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}")
print("| optimizer | ms/step | vs fused |\n|---|---|---|")
for name, ms in rows:
    print(f"| {name} | {ms:.3f} | {ms / fused:.2f}x |")
