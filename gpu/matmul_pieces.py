"""The matmuls of one block of the 2.7B step timed alone (8192 tokens, d_model 2560, d_ff 10240, bf16,
triton.testing.do_bench medians): three q/k/v products against one over the concatenated weights, forward and
backward; weight gradients in bf16 and then cast against written in fp32 by the GEMM; the MLP's shapes; the cast of
one block's fp32 weights to bf16. BENCHMARKS.md (What we tried, the 2.7B step) quotes it.

    python gpu/matmul_pieces.py
"""
import torch
import triton


def main():
    torch.manual_seed(0)
    dev = "cuda"
    M, d, f = 8192, 2560, 10240
    bf = torch.bfloat16
    def t(fn, n=50):
        return triton.testing.do_bench(fn, warmup=25, rep=n, return_mode="median")
    rows = []
    def row(name, ms, flops=None, bytes_=None):
        s = f"{name:55s} {ms*1e3:9.1f} us"
        if flops: s += f"  {flops/ms/1e9:7.1f} TFLOP/s"
        if bytes_: s += f"  {bytes_/ms/1e9:7.2f} TB/s"
        rows.append(s); print(s, flush=True)
    x = torch.randn(M, d, device=dev, dtype=bf)
    W = [torch.randn(d, d, device=dev, dtype=bf) / 50 for _ in range(3)]
    Wc = torch.cat(W)
    F2 = 2 * M * d * d
    row("fwd q,k,v: 3 mm", t(lambda: [x @ w.T for w in W]), 3 * F2)
    row("fwd qkv: 1 mm vs cat weight", t(lambda: x @ Wc.T), 3 * F2)
    dq = [torch.randn(M, d, device=dev, dtype=bf) for _ in range(3)]
    dqc = torch.cat(dq, 1)
    def dx3():
        g = dq[0] @ W[0]; g = g + dq[1] @ W[1]; return g + dq[2] @ W[2]
    row("bwd dX: 3 mm + 2 add", t(dx3), 3 * F2)
    row("bwd dX: 1 mm K=7680", t(lambda: dqc @ Wc), 3 * F2)
    row("bwd cat dq,dk,dv", t(lambda: torch.cat(dq, 1)), bytes_=6 * M * d * 2)
    row("bwd dW: 3 mm bf16 out", t(lambda: [g.T @ x for g in dq]), 3 * F2)
    row("bwd dW: 3 mm bf16 + .float()", t(lambda: [(g.T @ x).float() for g in dq]), 3 * F2)
    try:
        row("bwd dW: 3 mm fp32 out", t(lambda: [torch.mm(g.T, x, out_dtype=torch.float32) for g in dq]), 3 * F2)
        row("bwd dW: 1 mm fp32 out (7680x2560)", t(lambda: torch.mm(dqc.T, x, out_dtype=torch.float32)), 3 * F2)
    except Exception as e:
        print("out_dtype failed:", repr(e)[:200])
    row("bwd dW: 1 mm bf16 out (7680x2560)", t(lambda: dqc.T @ x), 3 * F2)
    # FFN shapes
    W1 = torch.randn(f, d, device=dev, dtype=bf) / 50
    W13 = torch.randn(2 * f, d, device=dev, dtype=bf) / 50
    h = torch.randn(M, f, device=dev, dtype=bf)
    h2 = torch.randn(M, 2 * f, device=dev, dtype=bf)
    FF = 2 * M * d * f
    row("fwd w1: x@W1^T (M x 10240)", t(lambda: x @ W1.T), FF)
    row("fwd w1,w3 as one (M x 20480)", t(lambda: x @ W13.T), 2 * FF)
    row("fwd w2: h@W2^T (K=10240)", t(lambda: h @ W1), FF)
    row("bwd dW w1: bf16", t(lambda: h.T @ x), FF)
    row("bwd dW w1: bf16 + float", t(lambda: (h.T @ x).float()), FF)
    try:
        row("bwd dW w1: fp32 out", t(lambda: torch.mm(h.T, x, out_dtype=torch.float32)), FF)
        row("bwd dW w2: fp32 out (2560x10240)", t(lambda: torch.mm(x.T, h, out_dtype=torch.float32)), FF)
    except Exception as e:
        print("out_dtype failed:", repr(e)[:200])
    row("bwd dW w2: bf16 (2560x10240)", t(lambda: x.T @ h), FF)
    row("bwd dW w1,w3 as one: bf16", t(lambda: h2.T @ x), 2 * FF)
    row("bwd dW o_proj 2560^2 bf16", t(lambda: dq[0].T @ x), F2)
    # casts of one layer's weights
    P = 4 * d * d + 3 * d * f
    w32 = torch.randn(P, device=dev)
    row("cast layer weights fp32->bf16", t(lambda: w32.to(bf)), bytes_=6 * P)
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
