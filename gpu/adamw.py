"""Our AdamW step (train.AdamW, foreach) vs torch.optim.AdamW fused / foreach on GPT-2-small-sized parameters
(issue 3: ours within 1.2x of fused). Run from the repository root on a GPU: python gpu/adamw.py"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import time, torch, train
from model import TransformerLM
torch.manual_seed(0)
model = TransformerLM(50304, 1024, 768, 12, 12, 3072, device="cuda")
def bench(make):
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = make(params)
    for _ in range(5):
        opt.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 50 * 1000
kw = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
ours = bench(lambda ps: train.AdamW(ps, **kw))
fused = bench(lambda ps: torch.optim.AdamW(ps, fused=True, **kw))
foreach = bench(lambda ps: torch.optim.AdamW(ps, foreach=True, **kw))
n = sum(p.numel() for p in model.parameters())
print(f"AdamW step, {n / 1e6:.1f}M fp32 params, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}")
print("| optimizer | ms/step | vs fused |\n|---|---|---|")
for name, ms in (("ours (train.AdamW, foreach)", ours), ("torch fused=True", fused), ("torch foreach=True", foreach)):
    print(f"| {name} | {ms:.3f} | {ms / fused:.2f}x |")
