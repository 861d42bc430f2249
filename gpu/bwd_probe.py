"""Backward-kernel probe for issue 4: why does FlexAttention's backward (one launch, dQ programs beside dK/dV
programs, 7 tile matmuls like ours) take 1.9 ms where our two passes took 2.2 ms at D=128, S=4096? Each variant
below is a stripped copy of flash.py's kernels (dense, causal, S a multiple of the tiles, MHA) changing one thing:

    dkdv-cur        flash.py's dK/dV kernel as it is (forced tiles)
    dkdv-spec       flash.py's dK/dV kernel without do_not_specialize (the L strides specialized too)
    dkdv-flex       loop body in FlexAttention's order: L loaded before QK^T, dO after P^T, Delta after dV; the
                    mask applied to the scores before exp2; Q read as a (D, BLOCK_M) transposed tile
    dq-cur          flash.py's dQ kernel (forced tiles)
    dq-spec         flash.py's dQ kernel without do_not_specialize
    dq-flex         dQ loop body in FlexAttention's order, K and V read as (D, BLOCK_N) tiles, V after P
    dq-vlate        dq-flex with K and V read as (BLOCK_N, D) row tiles as flash.py does (V still after P)

Call 17 (BENCHMARKS.md) also timed variants since dropped from the list: dkdv-flex with Q read as (BLOCK_M, D) rows
(as fast as dkdv-flex: the load order is what matters), with the diagonal and full tiles in one loop (as fast), and
one fused launch of dQ and dK/dV programs as FlexAttention has (slower than two launches: 2.05 vs 1.83 ms at D=128).
flash.py's dK/dV kernel took FlexAttention's order (call 18) yet stayed 16-20% slower than dkdv-flex (calls 19-21):
ptxas serialized its wgmma instructions (a diagonal loop of variable length before the main loop; gpu/sass_stats.py
shows the note). Since session 5 it matches dkdv-flex (calls 22, 24), and flash.py specializes the lengths in both
backward kernels, so dkdv-spec and dq-spec differ from dkdv-cur and dq-cur only in the L strides: their gaps (up to
9%) show this probe's run-to-run noise between variants.

Checks every variant against flash.py's backward, times each with do_bench and prints one table.
Run from the repository root on a GPU: python gpu/bwd_probe.py"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import flash  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _tile_t(X, base, offs, offs_d, stride_s, T: tl.constexpr):
    """Rows offs of X as a (D, len(offs)) tile: read transposed from memory (T) or read as rows and transposed."""
    if T:
        x_t = tl.load(X + base + offs[None, :] * stride_s + offs_d[:, None])
    else:
        x_t = tl.trans(tl.load(X + base + offs[:, None] * stride_s + offs_d[None, :]))
    return x_t


@triton.jit
def _dkdv_loop(dk, dv, k, v, Q, DO, LSE_h, DELTA_h, base, offs_n, lo, hi, stride_s, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, QT: tl.constexpr, MASK: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        lse2 = tl.load(LSE_h + offs_m) * 1.4426950408889634
        q_t = _tile_t(Q, base, offs_m, offs_d, stride_s, QT)
        s_t = tl.dot(k, q_t) * qk_scale
        if MASK:
            s_t = tl.where(offs_m[None, :] >= offs_n[:, None], s_t, -1.0e6)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        do = tl.load(DO + base + offs_m[:, None] * stride_s + offs_d[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = tl.load(DELTA_h + offs_m)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(do.dtype), tl.trans(q_t), dk)
    return dk, dv


@triton.jit
def _dkdv_body(Q, K, V, DO, DK, DV, LSE, DELTA, bh, pid_n, S, stride_h, stride_s, qk_scale, sm_scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QT: tl.constexpr,
               ONE_LOOP: tl.constexpr):
    base = bh.to(tl.int64) * stride_h
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + base + offs_n[:, None] * stride_s + offs_d[None, :])
    v = tl.load(V + base + offs_n[:, None] * stride_s + offs_d[None, :])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    LSE_h = LSE + bh.to(tl.int64) * S
    DELTA_h = DELTA + bh.to(tl.int64) * S
    if ONE_LOOP:
        dk, dv = _dkdv_loop(dk, dv, k, v, Q, DO, LSE_h, DELTA_h, base, offs_n, start_n, S, stride_s, qk_scale,
                            HEAD_DIM, BLOCK_M, QT, True)
    else:
        dk, dv = _dkdv_loop(dk, dv, k, v, Q, DO, LSE_h, DELTA_h, base, offs_n, start_n, start_n + BLOCK_N, stride_s,
                            qk_scale, HEAD_DIM, BLOCK_M, QT, True)
        dk, dv = _dkdv_loop(dk, dv, k, v, Q, DO, LSE_h, DELTA_h, base, offs_n, start_n + BLOCK_N, S, stride_s,
                            qk_scale, HEAD_DIM, BLOCK_M, QT, False)
    tl.store(DK + base + offs_n[:, None] * stride_s + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty))
    tl.store(DV + base + offs_n[:, None] * stride_s + offs_d[None, :], dv.to(DV.dtype.element_ty))


@triton.jit
def _dq_loop(dq, q, do, lse2, delta, K, V, base, offs_m, lo, hi, stride_s, qk_scale,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, KT: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_t = _tile_t(K, base, offs_n, offs_d, stride_s, KT)
        s = tl.dot(q, k_t) * qk_scale
        if MASK:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, -1.0e6)
        p = tl.math.exp2(s - lse2[:, None])
        v_t = _tile_t(V, base, offs_n, offs_d, stride_s, KT)
        dp = tl.dot(do, v_t)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq)
    return dq


@triton.jit
def _dq_body(Q, K, V, DO, DQ, LSE, DELTA, bh, pid_m, S, stride_h, stride_s, qk_scale, sm_scale,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KT: tl.constexpr):
    base = bh.to(tl.int64) * stride_h
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * stride_s + offs_d[None, :])
    do = tl.load(DO + base + offs_m[:, None] * stride_s + offs_d[None, :])
    lse2 = tl.load(LSE + bh.to(tl.int64) * S + offs_m) * 1.4426950408889634
    delta = tl.load(DELTA + bh.to(tl.int64) * S + offs_m)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_hi = (start_m // BLOCK_N) * BLOCK_N  # key tiles wholly left of the first query row need no mask
    dq = _dq_loop(dq, q, do, lse2, delta, K, V, base, offs_m, 0, full_hi, stride_s, qk_scale, HEAD_DIM, BLOCK_N,
                  False, KT)
    dq = _dq_loop(dq, q, do, lse2, delta, K, V, base, offs_m, full_hi, start_m + BLOCK_M, stride_s, qk_scale,
                  HEAD_DIM, BLOCK_N, True, KT)
    tl.store(DQ + base + offs_m[:, None] * stride_s + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty))


@triton.jit
def _dkdv_probe(Q, K, V, DO, DK, DV, LSE, DELTA, S, stride_h, stride_s, qk_scale, sm_scale,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QT: tl.constexpr,
                ONE_LOOP: tl.constexpr):
    _dkdv_body(Q, K, V, DO, DK, DV, LSE, DELTA, tl.program_id(0), tl.program_id(1), S, stride_h, stride_s, qk_scale,
               sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, QT, ONE_LOOP)


@triton.jit
def _dq_probe(Q, K, V, DO, DQ, LSE, DELTA, S, stride_h, stride_s, qk_scale, sm_scale,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KT: tl.constexpr):
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    _dq_body(Q, K, V, DO, DQ, LSE, DELTA, tl.program_id(0), pid_m, S, stride_h, stride_s, qk_scale, sm_scale,
             HEAD_DIM, BLOCK_M, BLOCK_N, KT)


# flash.py's own kernels compiled without do_not_specialize: Triton then also specializes the L/Delta strides and the
# length bucket (divisible by 16 or not); calls 21-22 measured the lengths' specialization, which flash.py now has
DKDV_SPECIALIZED = triton.jit(flash._attn_bwd_dkdv.fn)
DQ_SPECIALIZED = triton.jit(flash._attn_bwd_dq.fn)


def main():
    torch.manual_seed(0)
    smoke = not torch.cuda.is_available()  # interpreter run on small fp32 shapes: checks the script, times nothing
    lines = []
    for d in (64,) if smoke else (128, 64):
        B, H, S = (1, 1, 256) if smoke else (4, 2048 // d, 4096)
        q, k, v, do = (torch.randn(B, H, S, d, device="cpu" if smoke else "cuda",
                                   dtype=torch.float32 if smoke else torch.bfloat16) for _ in range(4))
        o, lse = flash._forward(q, k, v, True)
        ref_dq, ref_dk, ref_dv = flash._backward(do, q, k, v, o, lse, True)
        delta = (o.float() * do.float()).sum(-1)
        scale = d ** -0.5
        args = (S, q.stride(1), q.stride(2), LOG2E * scale, scale)
        outs = [torch.empty_like(q) for _ in range(3)]
        dq_, dk_, dv_ = outs

        def dkdv(cfg, qt, one_loop, cur=False, kernel=flash._attn_bwd_dkdv):
            m, n, w, s = cfg
            if cur:
                return lambda: kernel[(B * H, S // n)](
                    q, k, v, do, dk_, dv_, lse, delta, lse, lse, *flash._strides(q, False), *flash._strides(k, False),
                    *flash._strides(v, False), *flash._strides(do, False), *flash._strides(dk_, False),
                    *flash._strides(dv_, False), H * S, S, S, S, H, LOG2E * scale, scale, S, HEAD_DIM=d,
                    CAUSAL=True, VARLEN=False, PREC=flash._precision(q.dtype), TMA=False, GROUP=1, EVEN_Q=True,
                    BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
            return lambda: _dkdv_probe[(B * H, S // n)](q, k, v, do, dk_, dv_, lse, delta, *args, HEAD_DIM=d,
                                                         BLOCK_M=m, BLOCK_N=n, QT=qt, ONE_LOOP=one_loop,
                                                         num_warps=w, num_stages=s)

        def dq(cfg, cur=False, kt=1, kernel=flash._attn_bwd_dq):
            m, n, w, s = cfg
            if cur:
                return lambda: kernel[(B * H, S // m)](
                    q, k, v, do, dq_, lse, delta, lse, lse, *flash._strides(q, False), *flash._strides(k, False),
                    *flash._strides(v, False), *flash._strides(do, False), *flash._strides(dq_, False), H * S, S, S,
                    S, H, 1, LOG2E * scale, scale, S, HEAD_DIM=d, CAUSAL=True, VARLEN=False, PREC=flash._precision(q.dtype), TMA=False,
                    BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
            return lambda: _dq_probe[(B * H, S // m)](q, k, v, do, dq_, lse, delta, *args, HEAD_DIM=d, BLOCK_M=m,
                                                       BLOCK_N=n, KT=kt, num_warps=w, num_stages=s)

        cur_dkdv = flash.DKDV_CONFIGS[(d, 2)][0]
        cur_dq = flash.DQ_CONFIGS[(d, 2)][0]
        variants = [("dkdv-cur", cur_dkdv, dkdv(cur_dkdv, 0, 0, cur=True), "kv"),
                    ("dkdv-spec", cur_dkdv, dkdv(cur_dkdv, 0, 0, cur=True, kernel=DKDV_SPECIALIZED), "kv"),
                    ("dkdv-flex", cur_dkdv, dkdv(cur_dkdv, 1, 0), "kv")]
        for cfg in dict.fromkeys([cur_dq, (128, 64, 8, 3), (128, 32, 4, 3)]):
            variants.append(("dq-cur", cfg, dq(cfg, cur=True), "q"))
            variants.append(("dq-spec", cfg, dq(cfg, cur=True, kernel=DQ_SPECIALIZED), "q"))
            variants.append(("dq-flex", cfg, dq(cfg), "q"))
            variants.append(("dq-vlate", cfg, dq(cfg, kt=0), "q"))
        for name, cfg, fn, what in variants:
            for t in outs:
                t.fill_(float("nan"))
            try:
                fn()
                if not smoke:
                    torch.cuda.synchronize()
                pairs = {"kv": [(dk_, ref_dk), (dv_, ref_dv)], "q": [(dq_, ref_dq)]}[what]
                err = max(((a.float() - r.float()).abs().max() / r.float().abs().max()).item() for a, r in pairs)
                ms = float("nan") if smoke else triton.testing.do_bench(fn, warmup=10, rep=40)
            except Exception as e:  # e.g. out of shared memory
                print(f"D={d} {name} {cfg}: failed {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            npairs = B * H * S * S / 2
            mm = {"kv": 4, "q": 3}[what]
            tf = mm * 2 * d * npairs / ms / 1e9
            print(f"D={d} {name} {cfg}: {ms:.3f} ms, {tf:.0f} TFLOP/s, rel err {err:.1e}", flush=True)
            lines.append(f"| {d} | {name} | {cfg} | {ms:.3f} | {tf:.0f} | {err:.1e} |")
    print(f"\nB*S = 16384, H*D = 2048, S = 4096, causal bf16, {'smoke' if smoke else torch.cuda.get_device_name()}, "
          f"{time.strftime('%Y-%m-%d')}; TFLOP/s count the variant's tile matmuls (dK/dV 4, dQ 3)")
    print("| D | variant | config | ms | TFLOP/s | max rel err |\n|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
