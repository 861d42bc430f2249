"""One optimizer step over the parameters of a model, ours against torch's, on the same tensors:
train.AdamW (the fused Triton kernel, then its foreach path, fused=False) and torch.optim.AdamW (fused=True, then
foreach=True). Sizes: gpt2 (a GPT-2-small-sized TransformerLM, untied: 190.5M parameters) and xl (the 2.7B shape at
vocab 10000: 3.4B). Checks first that the fused kernel and the foreach path agree after three steps.

    python gpu/adamw_ab.py [--sizes gpt2,xl] [--rep 100]

Prints a table: ms per step, the bytes a step must move (p, g, m, v read; p, m, v written: 28 per parameter) over
that time, and each optimizer's time against torch's fused one.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import triton  # noqa: E402

import bench  # noqa: E402
import train  # noqa: E402
from model import TransformerLM  # noqa: E402

SIZES = {"gpt2": (50304, 1024, dict(d_model=768, num_layers=12, num_heads=12, d_ff=2048)),
         "xl": (10000, 2048, {k: bench.SIZES["xl"][k] for k in ("d_model", "num_layers", "num_heads", "d_ff")})}
OPTIMIZERS = {
    "ours fused (train.AdamW, the Triton kernel)": lambda ps: train.AdamW(ps, lr=1e-4, weight_decay=0.1),
    "ours foreach (train.AdamW, fused=False)": lambda ps: train.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=False),
    "torch fused=True": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=True),
    "torch foreach=True": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=True),
}


def params_of(size, device):
    vocab, ctx, dims = SIZES[size]
    net = TransformerLM(vocab, ctx, dims["d_model"], dims["num_layers"], dims["num_heads"], dims["d_ff"],
                        device=device)
    ps = [p.detach() for p in net.parameters()]
    del net
    return ps


def check(device):
    """The fused kernel and the foreach path after three steps on the gpt2 size: their largest relative difference."""
    base = params_of("gpt2", device)
    runs = []
    for fused in (True, False):
        ps = [torch.nn.Parameter(p.clone()) for p in base]
        opt = train.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=fused)
        gen = torch.Generator(device).manual_seed(0)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-2
            opt.step()
        runs.append(ps)
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*runs))


def main(argv):
    p = argparse.ArgumentParser(prog="gpu/adamw_ab.py")
    p.add_argument("--sizes", default="gpt2,xl")
    p.add_argument("--rep", type=int, default=100, help="ms of timed steps per optimizer (do_bench's rep)")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    sizes = args.sizes.split(",")
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"--sizes: {s!r} is not one of {', '.join(SIZES)}")
    diff = check(device)
    print(f"fused kernel against the foreach path after 3 steps: max relative difference {diff:.1e}", flush=True)
    if diff > 1e-5:
        raise SystemExit("the fused kernel and the foreach path disagree")
    rows = []
    for size in sizes:
        ps = [torch.nn.Parameter(t) for t in params_of(size, device)]
        n = sum(t.numel() for t in ps)
        gen = torch.Generator(device).manual_seed(1)
        for t in ps:
            t.grad = torch.randn(t.shape, device=device, generator=gen) * 1e-3
        times = {}
        for name, make in OPTIMIZERS.items():
            opt = make(ps)
            opt.step()  # the state is made here, not timed
            times[name] = triton.testing.do_bench(opt.step, warmup=5, rep=args.rep, return_mode="median")
            del opt
            torch.cuda.empty_cache()
            print(f"{size} {name:45s} {times[name]:8.3f} ms", flush=True)
        ref = times["torch fused=True"]
        rows += [(size, n, name, ms, 28 * n / ms / 1e9, ms / ref) for name, ms in times.items()]
        del ps
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n")
    print("| size | parameters | optimizer | ms/step | TB/s (28 bytes a parameter) | vs torch fused |")
    print("|---|---|---|---|---|---|")
    for size, n, name, ms, tbs, ratio in rows:
        print(f"| {size} | {n / 1e6:,.1f}M | {name} | {ms:.3f} | {tbs:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1:])
