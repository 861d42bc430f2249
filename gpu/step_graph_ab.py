"""The GPT-2-small step (bench.py gpt2's shape: batch 12 x 1024, vocab 50304, tied, flash, bf16 autocast, our
AdamW) replayed as CUDA graphs two ways in one process on one GPU:

    A  torch.compile(mode="reduce-overhead"): forward and backward replayed as CUDA graphs, AdamW launched eagerly
       (bench.py gpt2 ':graphs'; train.py --cuda_graphs=True for packed batches)
    B  the default-mode compiled step captured whole (forward, backward, AdamW) by train.capture_step and replayed
       (bench.py gpt2 ':step_graph'; train.py --cuda_graphs=True for concat batches)
    B' B's graph replayed without optimizer.advance() (the step size stays the captured one: only to isolate what
       the host's part costs)

    python gpu/step_graph_ab.py

Prints per variant the median wall time of 30 steps each followed by a synchronize (as bench.py gpt2 and nanoGPT's
bench time them), the median GPU time of 10 steps issued back to back while the GPU is kept busy (events around each
step), and the median GPU time of 10 steps each issued alone behind a busy GPU and followed by a synchronize
(bench.time_ms(host_ahead=True), bench.py gpt2's GPU ms)."""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import bench  # noqa: E402
from model import TransformerLM  # noqa: E402
from train import AdamW, capture_step, warmup_step  # noqa: E402

V, T, B = 50304, 1024, 12


def build(device, capturable=False):
    torch.manual_seed(0)
    net = TransformerLM(V, T, 768, 12, 12, 2048, attn_impl="flash", tie_embeddings=True, device=device)
    return net, AdamW(net.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, capturable=capturable)


def wall_ms(step, n=30):
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def gpu_ms(step, n=10):
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # the host issues every step before the GPU starts the first
    for a, b in events:
        a.record()
        step()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def isolated_ms(step, device):
    return statistics.median(bench.time_ms(step, device, warmup=1, steps=10, host_ahead=True))


def main():
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    x, y = bench.random_batch(V, B, T, device, torch.Generator().manual_seed(0))
    rows = {}
    net, opt = build(device)
    f = torch.compile(lambda a, b: net(a, targets=b), mode="reduce-overhead")

    def step_a():
        torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f(x, y)
        loss.backward()
        opt.step()
    for _ in range(15):
        step_a()
    rows["A reduce-overhead"] = (wall_ms(step_a), gpu_ms(step_a), isolated_ms(step_a, device))
    del net, opt, f
    torch._dynamo.reset()
    bench.free_memory(device)

    net, opt = build(device, capturable=True)
    f = torch.compile(lambda a, b: net(a, targets=b))

    def step_b():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f(x, y)
        loss.backward()
        opt.step()
        return loss.detach()
    side = torch.cuda.Stream()
    for _ in range(3):  # compile and warm up outside the capture
        warmup_step(step_b, side)
    replay = capture_step(step_b, opt)
    losses = [replay().item() for _ in range(5)]
    if not losses[-1] < losses[0]:
        raise SystemExit(f"the captured step does not train: losses {losses}")
    rows["B whole step, capture_step"] = (wall_ms(replay), gpu_ms(replay), isolated_ms(replay, device))
    rows["B' B without advance()"] = (wall_ms(replay.graph.replay), gpu_ms(replay.graph.replay),
                                      isolated_ms(replay.graph.replay, device))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; B's losses over 5 replays: "
          f"{', '.join(f'{v:.3f}' for v in losses)}\n")
    print("| variant | wall ms (median, synchronized steps) | GPU ms (median, back to back) | GPU ms (median, "
          "each step alone) |\n|---|---|---|---|")
    for name, (wall, gpu, alone) in rows.items():
        print(f"| {name} | {wall:.2f} | {gpu:.2f} | {alone:.2f} |")


if __name__ == "__main__":
    main()
