"""Warp-specialization probe for issue 4. Triton 3.6 has an automatic warp-specialization pass for Hopper
(`tl.range(..., warp_specialize=True)`): a producer warp issues the TMA loads while consumer warpgroups do the
matmuls and the softmax, FA3's schedule, which flash.py's kernels do not get. Compiled for sm_90 on a CPU machine
the pass only takes a loop that loads through TMA descriptors, runs at num_warps=4 and has no `if` in its body: a
causal loop split into full and diagonal tiles, or with the mask under an `if`, is left alone (or, in the split
form, crashes the pass), so these kernels run one loop over every visited tile and apply the causal mask to each.

Stripped kernels (dense, causal, bf16, S a multiple of 128, one K/V head per query head), each with WS on and off:

    fwd-ws      forward, one program per 128-row query tile, K and V through TMA
    dkdv-ws     dK/dV pass in flash.py's loop order, Q and dO through TMA

(A dQ pass written the same way makes the pass fail in the sm_90 compile, for every tile config tried.)

timed against flash.py's own kernels and SDPA's cuDNN backend on the ANCHORS shapes, each checked against flash.py.
Run from the repository root on a GPU: python gpu/ws_probe.py

Call 21 (BENCHMARKS.md): with warp specialization on, every kernel that ran gave wrong results (errors of 0.2-0.35
of the largest value, or NaN) and none was faster than the same kernel without it at 8 warps, so Triton 3.6's Hopper
pass is not usable here; the same kernels without it are correct."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flash  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _desc(base, S, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    return tl.make_tensor_descriptor(base, shape=[S, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK, HEAD_DIM])


@triton.jit
def _fwd_ws(Q, K, V, O, LSE, S, stride_h, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, WS: tl.constexpr):
    bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    base = bh.to(tl.int64) * stride_h
    kd = _desc(K + base, S, HEAD_DIM, BLOCK_N)
    vd = _desc(V + base, S, HEAD_DIM, BLOCK_N)
    q = _desc(Q + base, S, HEAD_DIM, BLOCK_M).load([start_m, 0])
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in tl.range(0, start_m + BLOCK_M, BLOCK_N, warp_specialize=WS):
        k = kd.load([start_n, 0])
        qk = tl.dot(q, k.T) * qk_scale
        qk = tl.where((start_n + offs_n)[None, :] <= offs_m[:, None], qk, -1.0e6)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = vd.load([start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    _desc(O + base, S, HEAD_DIM, BLOCK_M).store([start_m, 0], (acc / l_i[:, None]).to(O.dtype.element_ty))
    tl.store(LSE + bh.to(tl.int64) * S + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453)


@triton.jit
def _dkdv_ws(Q, K, V, DO, DK, DV, LSE2, DELTA, S, stride_h, qk_scale, sm_scale, HEAD_DIM: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr):
    bh = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N
    base = bh.to(tl.int64) * stride_h
    qd = _desc(Q + base, S, HEAD_DIM, BLOCK_M)
    dod = _desc(DO + base, S, HEAD_DIM, BLOCK_M)
    k = _desc(K + base, S, HEAD_DIM, BLOCK_N).load([start_n, 0])
    v = _desc(V + base, S, HEAD_DIM, BLOCK_N).load([start_n, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    LSE_h = LSE2 + bh.to(tl.int64) * S
    DELTA_h = DELTA + bh.to(tl.int64) * S
    for start_m in tl.range(start_n, S, BLOCK_M, warp_specialize=WS):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        lse2 = tl.load(LSE_h + offs_m)
        q = qd.load([start_m, 0])
        s_t = tl.dot(k, q.T) * qk_scale
        s_t = tl.where(offs_m[None, :] >= offs_n[:, None], s_t, -1.0e6)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        do = dod.load([start_m, 0])
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = tl.load(DELTA_h + offs_m)
        dp_t = tl.dot(v, do.T)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    _desc(DK + base, S, HEAD_DIM, BLOCK_N).store([start_n, 0], (dk * sm_scale).to(DK.dtype.element_ty))
    _desc(DV + base, S, HEAD_DIM, BLOCK_N).store([start_n, 0], dv.to(DV.dtype.element_ty))


def _alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def main():
    triton.set_allocator(_alloc)
    torch.manual_seed(0)
    lines = []
    cases = [(4, 16, 4096, 128), (1, 16, 16384, 128), (4, 32, 4096, 64)]
    for B, H, S, d in cases:
        q, k, v, do = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        o_ref, lse_ref = flash._forward(q, k, v, True)
        _, dk_ref, dv_ref = flash._backward(do, q, k, v, o_ref, lse_ref, True)
        lse2 = lse_ref * LOG2E
        delta = (o_ref.float() * do.float()).sum(-1)
        scale = d ** -0.5
        o_, dk_, dv_ = (torch.empty_like(q) for _ in range(3))
        lse_ = torch.empty_like(lse_ref)
        pairs = B * H * S * S / 2
        variants = [("fwd flash.py", "fwd", None, lambda: flash._forward(q, k, v, True)),
                    ("fwd sdpa-cudnn", "fwd", None, lambda: _cudnn(q, k, v))]
        for ws, (m, n, w, s) in ((1, (128, 128, 4, 2)), (1, (128, 64, 4, 3)), (0, (128, 128, 4, 2)),
                                 (0, (128, 64, 8, 3))):
            variants.append((f"fwd-ws{ws}", "fwd", (m, n, w, s), lambda m=m, n=n, w=w, s=s, ws=ws: _fwd_ws[
                (B * H, S // m)](q, k, v, o_, lse_, S, S * d, LOG2E * scale, HEAD_DIM=d, BLOCK_M=m, BLOCK_N=n,
                                 WS=bool(ws), num_warps=w, num_stages=s)))
        variants.append(("dkdv flash.py", "kv", flash.DKDV_CONFIGS[(d, 2)][0], _flash_dkdv(q, k, v, do, dk_, dv_,
                                                                                        lse_ref, delta)))
        for ws, (m, n, w, s) in ((1, (64, 128, 4, 2)), (1, (32, 128, 4, 3)), (1, (64, 64, 4, 3)),
                                 (0, (64, 128, 4, 2)), (0, (64, 128, 8, 3))):
            variants.append((f"dkdv-ws{ws}", "kv", (m, n, w, s), lambda m=m, n=n, w=w, s=s, ws=ws: _dkdv_ws[
                (B * H, S // n)](q, k, v, do, dk_, dv_, lse2, delta, S, S * d, LOG2E * scale, scale, HEAD_DIM=d,
                                 BLOCK_M=m, BLOCK_N=n, WS=bool(ws), num_warps=w, num_stages=s)))
        variants.append(("bwd sdpa-cudnn", "bwd", None, _cudnn_bwd(q, k, v, do)))
        for name, what, cfg, fn in variants:
            for t in (o_, dk_, dv_, lse_):
                t.fill_(float("nan"))
            try:
                t0 = time.time()
                fn()
                torch.cuda.synchronize()
                first = time.time() - t0
                err = float("nan")
                if cfg is not None and not name.startswith(("dkdv flash", "fwd flash")):
                    got = {"fwd": [(o_, o_ref)], "kv": [(dk_, dk_ref), (dv_, dv_ref)]}[what]
                    err = max(((a.float() - r.float()).abs().max() / r.float().abs().max()).item() for a, r in got)
                    if what == "fwd":
                        err = max(err, (lse_ - lse_ref).abs().max().item())
                ms = triton.testing.do_bench(fn, warmup=10, rep=40)
            except Exception as e:  # e.g. the pass rejects a config, out of shared memory
                print(f"{(B, H, S, d)} {name} {cfg}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            mm = {"fwd": 2, "kv": 4, "bwd": 5}[what]
            tf = mm * 2 * d * pairs / ms / 1e9
            print(f"{(B, H, S, d)} {name} {cfg}: {ms:.3f} ms, {tf:.0f} TFLOP/s, err {err:.1e}, first call "
                  f"{first:.1f} s", flush=True)
            lines.append(f"| B={B} H={H} S={S} D={d} | {name} | {cfg} | {ms:.3f} | {tf:.0f} | {err:.1e} |")
    print(f"\ncausal bf16, {torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; TFLOP/s count the kernel's tile matmuls (fwd 2, dK/dV 4, cuDNN "
          f"bwd 5); err: max abs error / max abs of flash.py's result")
    print("| case | variant | config | ms | TFLOP/s | err |\n|---|---|---|---|---|---|")
    print("\n".join(lines))


def _cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _cudnn_bwd(q, k, v, do):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    return lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)


def _flash_dkdv(q, k, v, do, dk_, dv_, lse, delta):
    B, H, S, d = q.shape
    m, n, w, s = flash.DKDV_CONFIGS[(d, 2)][0]
    scale = d ** -0.5
    return lambda: flash._attn_bwd_dkdv[(B * H, S // n)](
        q, k, v, do, dk_, dv_, lse, delta, lse, lse, *flash._strides(q, False), *flash._strides(k, False),
        *flash._strides(v, False), *flash._strides(do, False), *flash._strides(dk_, False), *flash._strides(dv_, False),
        H * S, S, S, S, H, LOG2E * scale, scale, S, HEAD_DIM=d, CAUSAL=True, VARLEN=False, PREC="tf32", TMA=False,
        GROUP=1, EVEN_Q=True, BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)


if __name__ == "__main__":
    main()
