"""Every GPU kernel of the stack, each beside the plain PyTorch it must equal. Map:

  1. Attention references: naive attention (dense, packed), the kernels' tiled PyTorch twin
  2. Attention in Triton (FlashAttention-2): forward, dQ pass, dK/dV pass, their launchers
  3. Attention on Hopper in Gluon (FlashAttention-3's design: TMA, warp specialization,
     async wgmma)
  4. Attention entry points: _launcher, the one choice between the Triton and Gluon kernels;
     one autograd Function; flash_attention, flash_attn_varlen, FlashAttentionTriton
  5. AdamW's fused step kernel and its launcher (train.AdamW is the optimizer)
  6. Cross-entropy rows with their gradient in place (the fused LM head's inner step)
  7. RMSNorm, with and without the residual add: one kernel each way

Attention: S = Q K^T / sqrt(d); P = softmax(S) by rows (causal: key j > i masked, SDPA's
top-left alignment); O = P V; L = logsumexp of S's rows. The forward keeps a running max and
sum (online softmax); the backward recomputes P = exp(S - L) tile by tile, with
Delta = rowsum(dO * O): dS = P * (dP - Delta), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d),
dV = P^T dO. FLASH_BACKEND=triton or =gluon forces a kernel family (default: auto). Without
CUDA, importing this file sets TRITON_INTERPRET=1 (Triton's interpreter).
"""
import functools
import math
import os
import sys
from typing import Optional

import numpy as np
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

# no GPU and triton imported already (by torch.compile, say): too late to set TRITON_INTERPRET
_INTERPRET_TOO_LATE = (not torch.cuda.is_available() and "triton" in sys.modules
                       and "TRITON_INTERPRET" not in os.environ)
if not torch.cuda.is_available():  # must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BACKEND = os.environ.get("FLASH_BACKEND", "auto")  # 'auto' | 'triton' | 'gluon'; read at each call
LOG2E = 1.4426950408889634  # scores in base 2 for exp2 (kernels write it as a literal)


# ----------------------------------------------------------------------
# 1. Attention references: naive attention and the tiled PyTorch twin of the kernels

def attention_reference(q, k, v, causal=False):
    """Naive attention on (..., H, S, D) with k/v (..., H_kv, S_k, D) -> (O, L), L the
    logsumexp of the scores. Materializes the (S, S_k) scores: for tests and as a baseline."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v, lse


def attention_varlen_reference(q, k, v, cu_seqlens, causal=True, cu_seqlens_k=None):
    """Packed (total_tokens, H, D) attention, one document at a time -> (O, L), L of shape
    (H, total_tokens) as flash-attn's varlen kernels lay it out."""
    cu_q = cu_seqlens.tolist()
    cu_k = cu_q if cu_seqlens_k is None else cu_seqlens_k.tolist()
    o = q.new_zeros(q.shape)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"))
    for i in range(len(cu_q) - 1):
        (a, b), (c, d) = cu_q[i:i + 2], cu_k[i:i + 2]
        if b == a or d == c:
            continue
        q_i, k_i, v_i = q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)
        o_i, lse_i = attention_reference(q_i, k_i, v_i, causal)
        o[a:b], lse[:, a:b] = o_i.transpose(0, 1), lse_i
    return o, lse


TWIN_TILE = 64


class FlashAttentionPyTorch(torch.autograd.Function):
    """Tiled FlashAttention-2 in plain PyTorch on (..., seq, d), the kernels' readable twin:
    online softmax, a recomputing backward; saves L, (..., seq_q)."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        n_q, n_k, scale = q.shape[-2], k.shape[-2], 1.0 / math.sqrt(q.shape[-1])
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
        for i0 in range(0, n_q, TWIN_TILE):
            q_i = q[..., i0:i0 + TWIN_TILE, :].to(acc_dtype)
            rows = torch.arange(i0, i0 + q_i.shape[-2], device=q.device)
            m_i = torch.full(q_i.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
            l_i = torch.zeros_like(m_i)
            acc = torch.zeros(q_i.shape[:-1] + (v.shape[-1],), dtype=acc_dtype, device=q.device)
            n_end = n_k
            if causal:  # key tiles right of the diagonal: never visited
                n_end = min(n_k, i0 + q_i.shape[-2])
            for j0 in range(0, n_end, TWIN_TILE):
                k_j = k[..., j0:j0 + TWIN_TILE, :].to(acc_dtype)
                v_j = v[..., j0:j0 + TWIN_TILE, :].to(acc_dtype)
                s = (q_i @ k_j.transpose(-1, -2)) * scale
                if causal and j0 + k_j.shape[-2] - 1 > i0:  # the diagonal tile: compares
                    cols = torch.arange(j0, j0 + k_j.shape[-2], device=q.device)
                    # finite: no inf - inf in a masked row
                    s = s.masked_fill(cols[None, :] > rows[:, None], -1e6)
                m_new = torch.maximum(m_i, s.amax(-1))
                p = torch.exp(s - m_new[..., None])
                alpha = torch.exp(m_i - m_new)
                l_i = alpha * l_i + p.sum(-1)
                acc = alpha[..., None] * acc + p @ v_j
                m_i = m_new
            o[..., i0:i0 + TWIN_TILE, :] = (acc / l_i[..., None]).to(q.dtype)
            lse[..., i0:i0 + TWIN_TILE] = m_i + torch.log(l_i)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        causal = ctx.causal
        acc_dtype = lse.dtype
        n_q, n_k, scale = q.shape[-2], k.shape[-2], 1.0 / math.sqrt(q.shape[-1])
        delta = (do.to(acc_dtype) * o.to(acc_dtype)).sum(-1)  # Delta = rowsum(dO * O)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc_dtype, device=q.device) for x in (q, k, v))
        for j0 in range(0, n_k, TWIN_TILE):
            k_j = k[..., j0:j0 + TWIN_TILE, :].to(acc_dtype)
            v_j = v[..., j0:j0 + TWIN_TILE, :].to(acc_dtype)
            cols = torch.arange(j0, j0 + k_j.shape[-2], device=q.device)
            for i0 in range(j0 if causal else 0, n_q, TWIN_TILE):  # causal: from the diagonal
                sl = slice(i0, i0 + TWIN_TILE)
                q_i, do_i = q[..., sl, :].to(acc_dtype), do[..., sl, :].to(acc_dtype)
                rows = torch.arange(i0, i0 + q_i.shape[-2], device=q.device)
                s = (q_i @ k_j.transpose(-1, -2)) * scale
                p = torch.exp(s - lse[..., sl, None])
                if causal:
                    p = p.masked_fill(cols[None, :] > rows[:, None], 0.0)
                dv[..., j0:j0 + TWIN_TILE, :] += p.transpose(-1, -2) @ do_i
                ds = p * (do_i @ v_j.transpose(-1, -2) - delta[..., sl, None])
                dq[..., sl, :] += (ds @ k_j) * scale
                dk[..., j0:j0 + TWIN_TILE, :] += (ds.transpose(-1, -2) @ q_i) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


# ----------------------------------------------------------------------
# 2. Attention in Triton (FlashAttention-2). One layout serves dense and packed inputs:
#      base + batch * stride_b + head * stride_h + (seq_start + row) * stride_s + dim
#    dense (B, H, S, D): seq_start 0; packed (total, H, D): stride_b 0 and
#    seq_start = cu_seqlens[batch]. L and Delta are fp32, (B, H, S) dense, (H, total) packed.
#    Few integers are specialized: compiling is the cold start.

# the tuning space: (head-dim class, element size) -> [(BLOCK_M, BLOCK_N, warps, stages)], best
# first (in the dK/dV pass BLOCK_N is the key tile held in registers)
FWD_CONFIGS = {
    (64, 2): [(128, 64, 8, 3), (128, 64, 4, 3)], (64, 4): [(64, 32, 4, 2), (64, 64, 4, 2)],
    (128, 2): [(128, 64, 8, 3), (128, 128, 8, 2)], (128, 4): [(64, 32, 4, 2), (32, 32, 4, 2)],
    (256, 2): [(64, 32, 4, 2), (64, 64, 8, 2)], (256, 4): [(32, 32, 4, 2), (32, 16, 4, 1)]}
DQ_CONFIGS = {
    (64, 2): [(128, 64, 8, 3), (128, 32, 4, 3)], (64, 4): [(64, 32, 4, 2), (64, 64, 4, 2)],
    (128, 2): [(128, 64, 8, 3), (64, 64, 4, 3)], (128, 4): [(64, 32, 4, 2), (32, 32, 4, 2)],
    (256, 2): [(64, 32, 4, 2), (32, 32, 4, 2)], (256, 4): [(32, 32, 4, 2), (32, 16, 4, 1)]}
DKDV_CONFIGS = {
    (64, 2): [(32, 128, 4, 3), (64, 64, 4, 3)], (64, 4): [(32, 64, 4, 2), (64, 64, 4, 2)],
    (128, 2): [(64, 128, 8, 3), (64, 64, 4, 3)], (128, 4): [(32, 64, 4, 2), (32, 32, 4, 2)],
    (256, 2): [(32, 64, 4, 2), (32, 32, 4, 2)], (256, 4): [(32, 32, 4, 2), (16, 32, 4, 1)]}
TUNING_KEY = ["SEQ_BUCKET", "HEAD_DIM", "CAUSAL", "VARLEN", "PREC"]


def _autotuned(table, interpreted):
    """triton.autotune among table[(head-dim class, element size)], its pick cached on disk;
    in the interpreter the tiles `interpreted` (BLOCK_M, BLOCK_N), below the test lengths."""
    def wrap(kernel):
        if INTERPRET:
            tiles = {"BLOCK_M": lambda _: interpreted[0], "BLOCK_N": lambda _: interpreted[1]}
            return triton.heuristics(tiles)(kernel)
        every = sorted({cfg for cfgs in table.values() for cfg in cfgs})
        configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                   for m, n, w, s in every]

        def prune(configs, named_args, **kwargs):
            d, dtype = kwargs["HEAD_DIM"], named_args["Q"].dtype
            wanted = table[(64 if d <= 64 else d, 4 if dtype == torch.float32 else 2)]
            return [c for c in configs
                    if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                    in wanted]

        tune = triton.autotune(configs, key=TUNING_KEY, cache_results=True,
                               prune_configs_by={"early_config_prune": prune})
        return tune(kernel)
    return wrap


@triton.jit
def _rows(base, stride, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """A BLOCK x HEAD_DIM tile of pointers at row 0 of one head of one sequence."""
    rows = tl.arange(0, BLOCK)[:, None] * stride
    return base + rows + tl.arange(0, HEAD_DIM)[None, :]


@triton.jit
def _load_rows(src, start, stride, seqlen, offs, MASKED: tl.constexpr):
    if MASKED:  # rows past the end load as zeros
        return tl.load(src + start * stride, mask=(start + offs)[:, None] < seqlen, other=0.0)
    return tl.load(src + start * stride)


@triton.jit
def _store_rows(dst, start, stride, seqlen, offs, x):
    mask = (start + offs)[:, None] < seqlen
    tl.store(dst + start * stride, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _sequence(cu_seqlens_q, cu_seqlens_k, num_heads, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(b, h, first query row, seqlen_q, first key row, seqlen_k) of program_id(0) = b x h;
    packed, sequence b's rows (starts in 64 bits: start * stride may pass 2^31)."""
    pid_bh = tl.program_id(0)
    b, h = pid_bh // num_heads, pid_bh % num_heads
    q_start, k_start = tl.full([], 0, tl.int64), tl.full([], 0, tl.int64)
    if VARLEN:
        q0, q1 = tl.load(cu_seqlens_q + b), tl.load(cu_seqlens_q + b + 1)
        k0, k1 = tl.load(cu_seqlens_k + b), tl.load(cu_seqlens_k + b + 1)
        q_start, seqlen_q = q0.to(tl.int64), q1 - q0
        k_start, seqlen_k = k0.to(tl.int64), k1 - k0
    return b, h, q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, lo, hi,
               offs_m, offs_n, seqlen_k, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    """The online softmax over key tiles [lo, hi): m_i running max, l_i running sum,
    acc = unnormalized P V."""
    for start_n in range(lo, hi, BLOCK_N):
        k = _load_rows(k_src, start_n, stride_ks, seqlen_k, offs_n, MASKED)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        if MASKED:  # ragged end and, when causal, the diagonal: the only tiles that compare
            cols = start_n + offs_n
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            qk = tl.where(keep, qk, -1.0e6)  # finite: a fully masked row gives no inf - inf
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_src, start_n, stride_vs, seqlen_k, offs_n, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@_autotuned(FWD_CONFIGS, (32, 16))
@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "seqlen_q", "seqlen_k", "SEQ_BUCKET"])
def _attn_fwd(Q, K, V, O, LSE, cu_seqlens_q, cu_seqlens_k,
              stride_qb, stride_qh, stride_qs,
              stride_kb, stride_kh, stride_ks,
              stride_vb, stride_vh, stride_vs,
              stride_ob, stride_oh, stride_os,
              stride_lb, stride_lh,
              seqlen_q, seqlen_k, num_heads, group, qk_scale, SEQ_BUCKET,
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
              VARLEN: tl.constexpr, PREC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch x head): O and L of BLOCK_M rows. Only the diagonal
    tile and a ragged end compare indices."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # the diagonal starts on a key-tile boundary
    qk_scale = tl.cast(qk_scale, tl.float32)  # a Python float may come typed fp64
    b, h, q_start, seqlen_q, k_start, seqlen_k = _sequence(
        cu_seqlens_q, cu_seqlens_k, num_heads, seqlen_q, seqlen_k, VARLEN)
    # longest causal tiles launch first
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    if start_m >= seqlen_q:  # a tile past its sequence's end exits at once
        return
    b64 = b.to(tl.int64)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_m0
    offs_n = tl.arange(0, BLOCK_N)
    kv_h = h // group
    q_base = Q + b64 * stride_qb + h * stride_qh + q_start * stride_qs
    k_base = K + b64 * stride_kb + kv_h * stride_kh + k_start * stride_ks
    v_base = V + b64 * stride_vb + kv_h * stride_vh + k_start * stride_vs
    q_src = _rows(q_base, stride_qs, HEAD_DIM, BLOCK_M)
    k_src = _rows(k_base, stride_ks, HEAD_DIM, BLOCK_N)
    v_src = _rows(v_base, stride_vs, HEAD_DIM, BLOCK_N)
    q = _load_rows(q_src, start_m, stride_qs, seqlen_q, offs_m0, True)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = seqlen_k
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N  # key tiles below it need no index compare
    if CAUSAL:  # no key tile right of the diagonal
        hi = tl.minimum(seqlen_k, start_m + BLOCK_M)
        full_hi = tl.minimum(start_m, full_hi)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs,
                               0, full_hi, offs_m, offs_n, seqlen_k, qk_scale,
                               MASKED=False, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N, PREC=PREC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs,
                               full_hi, hi, offs_m, offs_n, seqlen_k, qk_scale,
                               MASKED=True, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N, PREC=PREC)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row with no keys writes O = 0
    o_base = O + b64 * stride_ob + h * stride_oh + q_start * stride_os
    o_dst = _rows(o_base, stride_os, HEAD_DIM, BLOCK_M)
    _store_rows(o_dst, start_m, stride_os, seqlen_q, offs_m0, acc * (1.0 / l_safe)[:, None])
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453  # natural log: L = m + log(l)
    l_base = LSE + b64 * stride_lb + h * stride_lh + q_start
    tl.store(l_base + offs_m, lse, mask=offs_m < seqlen_q)


@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "seqlen_q"])
def _attn_bwd_delta(O, DO, DELTA, DQ, cu_seqlens_q,
                    stride_ob, stride_oh, stride_os,
                    stride_dob, stride_doh, stride_dos,
                    stride_dqb, stride_dqh, stride_dqs,
                    stride_lb, stride_lh,
                    seqlen_q, num_heads, head_dim, dq_cols,
                    HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    """The Gluon backward's pre-pass: Delta = rowsum(dO * O) in fp32, and the first dq_cols
    columns of DQ (the fp32 buffer it adds dQ into) zeroed."""
    b, h, q_start, seqlen_q, _, _ = _sequence(cu_seqlens_q, cu_seqlens_q, num_heads,
                                              seqlen_q, seqlen_q, VARLEN)
    start_m = tl.program_id(1) * BLOCK_M
    if start_m >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_m0
    offs_d = tl.arange(0, HEAD_DIM)
    keep = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    o_ptr = (O + b64 * stride_ob + h * stride_oh
             + (q_start + offs_m)[:, None] * stride_os + offs_d[None, :])
    o = tl.load(o_ptr, mask=keep, other=0.0)
    do_ptr = (DO + b64 * stride_dob + h * stride_doh
              + (q_start + offs_m)[:, None] * stride_dos + offs_d[None, :])
    do = tl.load(do_ptr, mask=keep, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    l_base = DELTA + b64 * stride_lb + h * stride_lh + q_start
    tl.store(l_base + offs_m, delta, mask=offs_m < seqlen_q)
    tl.store(DQ + b64 * stride_dqb + h * stride_dqh
             + (q_start + offs_m)[:, None] * stride_dqs + offs_d[None, :],
             tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32),
             mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < dq_cols))


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, lo, hi,
              offs_m, offs_n, seqlen_k, qk_scale,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
              PREC: tl.constexpr, HEAD_DIM: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        k = _load_rows(k_src, start_n, stride_ks, seqlen_k, offs_n, MASKED)
        if HEAD_DIM > 64:  # where V loads is tuned per head dim: beside K here, after P below
            v = _load_rows(v_src, start_n, stride_vs, seqlen_k, offs_n, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            cols = start_n + offs_n
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            p = tl.where(keep, p, 0.0)
        if HEAD_DIM <= 64:
            v = _load_rows(v_src, start_n, stride_vs, seqlen_k, offs_n, MASKED)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])  # dS = P * (dP - Delta)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@_autotuned(DQ_CONFIGS, (32, 16))
@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "SEQ_BUCKET"])
def _attn_bwd_dq(Q, K, V, O, DO, DQ, LSE, DELTA, cu_seqlens_q, cu_seqlens_k,
                 stride_qb, stride_qh, stride_qs,
                 stride_kb, stride_kh, stride_ks,
                 stride_vb, stride_vh, stride_vs,
                 stride_ob, stride_oh, stride_os,
                 stride_dob, stride_doh, stride_dos,
                 stride_dqb, stride_dqh, stride_dqs,
                 stride_lb, stride_lh,
                 seqlen_q, seqlen_k, num_heads, group, qk_scale, sm_scale, SEQ_BUCKET,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                 VARLEN: tl.constexpr, PREC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 1: one program per query tile, over key tiles up to the diagonal; dQ, and Delta
    for pass 2. qk_scale = log2(e) / sqrt(d), sm_scale = 1 / sqrt(d)."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    qk_scale = tl.cast(qk_scale, tl.float32)  # as in _attn_fwd
    sm_scale = tl.cast(sm_scale, tl.float32)
    b, h, q_start, seqlen_q, k_start, seqlen_k = _sequence(
        cu_seqlens_q, cu_seqlens_k, num_heads, seqlen_q, seqlen_k, VARLEN)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    if start_m >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_m0
    offs_n = tl.arange(0, BLOCK_N)
    kv_h = h // group
    q_src = _rows(Q + b64 * stride_qb + h * stride_qh + q_start * stride_qs,
                  stride_qs, HEAD_DIM, BLOCK_M)
    q = _load_rows(q_src, start_m, stride_qs, seqlen_q, offs_m0, True)
    do_src = _rows(DO + b64 * stride_dob + h * stride_doh + q_start * stride_dos,
                   stride_dos, HEAD_DIM, BLOCK_M)
    do = _load_rows(do_src, start_m, stride_dos, seqlen_q, offs_m0, True)
    o_src = _rows(O + b64 * stride_ob + h * stride_oh + q_start * stride_os,
                  stride_os, HEAD_DIM, BLOCK_M)
    o = _load_rows(o_src, start_m, stride_os, seqlen_q, offs_m0, True)
    # rows past seqlen_q load as zeros: Delta 0 there
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row_ok = offs_m < seqlen_q
    l_off = b64 * stride_lb + h * stride_lh + q_start + offs_m
    tl.store(DELTA + l_off, delta, mask=row_ok)
    lse2 = tl.load(LSE + l_off, mask=row_ok, other=0.0) * 1.4426950408889634
    k_base = K + b64 * stride_kb + kv_h * stride_kh + k_start * stride_ks
    v_base = V + b64 * stride_vb + kv_h * stride_vh + k_start * stride_vs
    k_src = _rows(k_base, stride_ks, HEAD_DIM, BLOCK_N)
    v_src = _rows(v_base, stride_vs, HEAD_DIM, BLOCK_N)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = seqlen_k
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N  # key tiles below it need no index compare
    if CAUSAL:  # no key tile right of the diagonal
        hi = tl.minimum(seqlen_k, start_m + BLOCK_M)
        full_hi = tl.minimum(start_m, full_hi)
    dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs,
                   0, full_hi, offs_m, offs_n, seqlen_k, qk_scale, MASKED=False,
                   CAUSAL=CAUSAL, BLOCK_N=BLOCK_N, PREC=PREC, HEAD_DIM=HEAD_DIM)
    dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs,
                   full_hi, hi, offs_m, offs_n, seqlen_k, qk_scale, MASKED=True,
                   CAUSAL=CAUSAL, BLOCK_N=BLOCK_N, PREC=PREC, HEAD_DIM=HEAD_DIM)
    dq_base = DQ + b64 * stride_dqb + h * stride_dqh + q_start * stride_dqs
    dq_dst = _rows(dq_base, stride_dqs, HEAD_DIM, BLOCK_M)
    _store_rows(dq_dst, start_m, stride_dqs, seqlen_q, offs_m0, dq * sm_scale)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_src, do_src, LSE_h, DELTA_h, stride_qs, stride_dos, lo, hi,
                offs_n, seqlen_q, qk_scale,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, PREC: tl.constexpr):
    # On the transposed scores (keys x queries): P^T, dP^T and dS^T need no transposes. Each
    # operand loads just before its matmul. MASKED: rows may pass seqlen_q (loaded as zeros,
    # L = 0 too: they add nothing); CAUSAL: the tiles cross the diagonal.
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        if MASKED:
            lse2 = tl.load(LSE_h + offs_m, mask=offs_m < seqlen_q, other=0.0)
        else:
            lse2 = tl.load(LSE_h + offs_m)
        lse2 = lse2 * 1.4426950408889634
        q = _load_rows(q_src, start_m, stride_qs, seqlen_q, offs_m0, MASKED)
        s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
        if CAUSAL:
            s_t = tl.where(offs_m[None, :] >= offs_n[:, None], s_t, -1.0e6)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        do = _load_rows(do_src, start_m, stride_dos, seqlen_q, offs_m0, MASKED)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PREC)
        if MASKED:
            delta = tl.load(DELTA_h + offs_m, mask=offs_m < seqlen_q, other=0.0)
        else:
            delta = tl.load(DELTA_h + offs_m)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PREC)
    return dk, dv


@_autotuned(DKDV_CONFIGS, (16, 32))
@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "SEQ_BUCKET"])
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, cu_seqlens_q, cu_seqlens_k,
                   stride_qb, stride_qh, stride_qs,
                   stride_kb, stride_kh, stride_ks,
                   stride_vb, stride_vh, stride_vs,
                   stride_dob, stride_doh, stride_dos,
                   stride_dkb, stride_dkh, stride_dks,
                   stride_dvb, stride_dvh, stride_dvs,
                   stride_lb, stride_lh,
                   seqlen_q, seqlen_k, num_kv_heads, qk_scale, sm_scale, SEQ_BUCKET,
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                   VARLEN: tl.constexpr, PREC: tl.constexpr,
                   GROUP: tl.constexpr, EVEN_Q: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 2: one program per key tile and K/V head, K_j and V_j in registers, over its
    group's query tiles from the diagonal on; dK and dV stored once."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0)
    tl.static_assert(128 % BLOCK_N == 0)  # the host decides EVEN_Q for 128 rows
    qk_scale = tl.cast(qk_scale, tl.float32)  # as in _attn_fwd
    sm_scale = tl.cast(sm_scale, tl.float32)
    b, hk, q_start, seqlen_q, k_start, seqlen_k = _sequence(
        cu_seqlens_q, cu_seqlens_k, num_kv_heads, seqlen_q, seqlen_k, VARLEN)
    # causal: the first key tiles have the most query rows, so they launch first
    start_n = tl.program_id(1) * BLOCK_N
    if start_n >= seqlen_k:
        return
    b64 = b.to(tl.int64)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_n0
    k_src = _rows(K + b64 * stride_kb + hk * stride_kh + k_start * stride_ks,
                  stride_ks, HEAD_DIM, BLOCK_N)
    k = _load_rows(k_src, start_n, stride_ks, seqlen_k, offs_n0, True)
    v_src = _rows(V + b64 * stride_vb + hk * stride_vh + k_start * stride_vs,
                  stride_vs, HEAD_DIM, BLOCK_N)
    v = _load_rows(v_src, start_n, stride_vs, seqlen_k, offs_n0, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dk_dst = DK + b64 * stride_dkb + hk * stride_dkh + k_start * stride_dks
    dv_dst = DV + b64 * stride_dvb + hk * stride_dvh + k_start * stride_dvs
    # causal: query rows before start_n see none of these keys, rows past the tile all of them
    if CAUSAL:
        if start_n >= seqlen_q:  # keys no query reaches (seqlen_k > seqlen_q): zero gradients
            dk_tile = _rows(dk_dst, stride_dks, HEAD_DIM, BLOCK_N)
            _store_rows(dk_tile, start_n, stride_dks, seqlen_k, offs_n0, dk)
            dv_tile = _rows(dv_dst, stride_dvs, HEAD_DIM, BLOCK_N)
            _store_rows(dv_tile, start_n, stride_dvs, seqlen_k, offs_n0, dv)
            return
    lo = 0
    if CAUSAL:
        lo = start_n + BLOCK_N
    # A diagonal loop of fixed trip count, then the other rows in one loop masked only at a
    # ragged end (EVEN_Q): other loop shapes make ptxas serialize the wgmma instructions.
    # GROUP (query heads per K/V head) is a constexpr: with one, the outer loop goes.
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + b64 * stride_qb + h * stride_qh + q_start * stride_qs
        do_base = DO + b64 * stride_dob + h * stride_doh + q_start * stride_dos
        q_src = _rows(q_base, stride_qs, HEAD_DIM, BLOCK_M)
        do_src = _rows(do_base, stride_dos, HEAD_DIM, BLOCK_M)
        if EVEN_Q:  # the L strides are multiples of 128: so written, L loads in wide copies
            l_off = (b64 * (stride_lb // 128) + h * (stride_lh // 128)) * 128
        else:
            l_off = b64 * stride_lb + h * stride_lh + q_start
        LSE_h, DELTA_h = LSE + l_off, DELTA + l_off
        # with EVEN_Q, a diagonal tile that starts before seqlen_q ends before it
        if CAUSAL:
            dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, LSE_h, DELTA_h,
                                 stride_qs, stride_dos, start_n, start_n + BLOCK_N,
                                 offs_n, seqlen_q, qk_scale, MASKED=not EVEN_Q,
                                 CAUSAL=True, BLOCK_M=BLOCK_M, PREC=PREC)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, LSE_h, DELTA_h,
                             stride_qs, stride_dos, lo, seqlen_q,
                             offs_n, seqlen_q, qk_scale, MASKED=not EVEN_Q,
                             CAUSAL=False, BLOCK_M=BLOCK_M, PREC=PREC)
    dk_tile = _rows(dk_dst, stride_dks, HEAD_DIM, BLOCK_N)
    _store_rows(dk_tile, start_n, stride_dks, seqlen_k, offs_n0, dk * sm_scale)
    dv_tile = _rows(dv_dst, stride_dvs, HEAD_DIM, BLOCK_N)
    _store_rows(dv_tile, start_n, stride_dvs, seqlen_k, offs_n0, dv)


# Launchers: dense (B, H, S, D) when cu_seqlens_q is None, packed (total, H, D) otherwise.

def _pow2(n):  # SEQ_BUCKET (the tuning key's length class), and the kernels' tile width
    return max(16, triton.next_power_of_2(n))


def _empty_out(x):  # x's own layout when dense (a (B, S, H, D) view's transpose back is free)
    if x.stride(-1) == 1:
        return torch.empty_like(x)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _unit_stride(x, width=None):  # x zero-padded to `width` columns, its last stride 1
    if width not in (None, x.shape[-1]):
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(varlen, *xs):  # the (b, h, s) strides of each tensor in turn (packed: no b)
    if varlen:
        return tuple(s for x in xs for s in (0, x.stride(1), x.stride(0)))
    return tuple(s for x in xs for s in x.stride()[:3])


def _precision(dtype):  # fp32 inputs follow PyTorch's matmul setting: fp32 unless TF32 is allowed
    if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _layout(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
    """(batch, heads, kv_heads, seqlen_q, seqlen_k, L's strides (b, h)) of a call."""
    if cu_seqlens_q is not None:
        batch = cu_seqlens_q.shape[0] - 1
        return batch, q.shape[1], k.shape[1], max_seqlen_q, max_seqlen_k, (0, q.shape[0])
    b, heads, s = q.shape[:3]
    return b, heads, k.shape[1], s, k.shape[2], (heads * s, s)


def _fwd_outputs(q, cu_seqlens_q):  # O, and L: (B, H, S) dense, (H, total) packed
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else q.shape[:3]
    return _empty_out(q), q.new_empty(lse_shape, dtype=torch.float32)


def _require_triton_device(x, who="flash"):
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"{who}: the Triton kernels need CUDA tensors (got {x.device}); "
                           "on CPU set TRITON_INTERPRET=1 before triton is imported")
    if INTERPRET and _INTERPRET_TOO_LATE:
        raise RuntimeError(f"{who}: triton was imported before flash.py could set "
                           "TRITON_INTERPRET=1 (there is no GPU), so the kernels cannot run in "
                           "the interpreter; import flash.py first (model.py and train.py do) "
                           "or set TRITON_INTERPRET=1 before anything imports triton")


def _triton_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
    """(O, L) of attention with the Triton kernel; dense, or packed when cu_seqlens_q is given."""
    _require_triton_device(q)
    if INTERPRET and q.dtype == torch.bfloat16:  # no bf16 arithmetic there: fp32 copies
        o, lse = _triton_forward(q.float(), k.float(), v.float(), cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k, causal)
        return o.to(q.dtype), lse
    varlen = cu_seqlens_q is not None
    batch, heads, kv_heads, seqlen_q, seqlen_k, (lb, lh) = _layout(
        q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    o, lse = _fwd_outputs(q, cu_seqlens_q)
    if batch * heads * seqlen_q == 0:
        return o.zero_(), lse.fill_(float("-inf"))
    d, d_pad = q.shape[-1], _pow2(q.shape[-1])
    qp, kp, vp = (_unit_stride(x, d_pad) for x in (q, k, v))
    op = o if d_pad == d else _empty_out(qp)
    if not varlen:  # (not read: any pointer)
        cu_seqlens_q = cu_seqlens_k = lse

    def grid(meta):
        return batch * heads, triton.cdiv(seqlen_q, meta["BLOCK_M"])
    _attn_fwd[grid](qp, kp, vp, op, lse, cu_seqlens_q, cu_seqlens_k,
                    *_strides(varlen, qp, kp, vp, op), lb, lh,
                    seqlen_q, seqlen_k, heads, heads // kv_heads, LOG2E / math.sqrt(d),
                    _pow2(seqlen_q), HEAD_DIM=d_pad, CAUSAL=causal, VARLEN=varlen,
                    PREC=_precision(q.dtype))
    if op is not o:
        o.copy_(op[..., :d])
    return o, lse


def _triton_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, causal):
    """(dQ, dK, dV) with the Triton kernels: the dQ pass (which works out Delta too), then the
    dK/dV pass."""
    _require_triton_device(q)
    if INTERPRET and q.dtype == torch.bfloat16:  # no bf16 arithmetic there: fp32 copies
        grads = _triton_backward(do.float(), q.float(), k.float(), v.float(), o.float(), lse,
                                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal)
        return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
    varlen = cu_seqlens_q is not None
    batch, heads, kv_heads, seqlen_q, seqlen_k, (lb, lh) = _layout(
        q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = _empty_out(q), _empty_out(k), _empty_out(v)
    if batch * heads * seqlen_q == 0 or seqlen_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    d, d_pad = q.shape[-1], _pow2(q.shape[-1])
    dop, qp, kp, vp, op = (_unit_stride(x, d_pad) for x in (do, q, k, v, o))
    dqp, dkp, dvp = (g if d_pad == d else _empty_out(x)
                     for g, x in ((dq, qp), (dk, kp), (dv, vp)))
    if not varlen:
        cu_seqlens_q = cu_seqlens_k = lse
    delta, scale = torch.empty_like(lse), 1.0 / math.sqrt(d)
    common = dict(SEQ_BUCKET=_pow2(max(seqlen_q, seqlen_k)), HEAD_DIM=d_pad, CAUSAL=causal,
                  VARLEN=varlen, PREC=_precision(q.dtype))

    def dq_grid(meta):
        return batch * heads, triton.cdiv(seqlen_q, meta["BLOCK_M"])

    def dkdv_grid(meta):
        return batch * kv_heads, triton.cdiv(seqlen_k, meta["BLOCK_N"])
    _attn_bwd_dq[dq_grid](
        qp, kp, vp, op, dop, dqp, lse, delta, cu_seqlens_q, cu_seqlens_k,
        *_strides(varlen, qp, kp, vp, op, dop, dqp), lb, lh,
        seqlen_q, seqlen_k, heads, heads // kv_heads, LOG2E * scale, scale, **common)
    _attn_bwd_dkdv[dkdv_grid](
        qp, kp, vp, dop, dkp, dvp, lse, delta, cu_seqlens_q, cu_seqlens_k,
        *_strides(varlen, qp, kp, vp, dop, dkp, dvp), lb, lh,
        seqlen_q, seqlen_k, kv_heads, LOG2E * scale, scale, **common,
        GROUP=heads // kv_heads, EVEN_Q=not varlen and seqlen_q % 128 == 0)
    for g, gp in ((dq, dqp), (dk, dkp), (dv, dvp)):
        if gp is not g:
            g.copy_(gp[..., :d])
    return dq, dk, dv


# ----------------------------------------------------------------------
# 3. Attention on Hopper in Gluon, after FlashAttention-3. Forward: a work item is 2 x BLOCK_M
#    query rows; a producer warp streams K_j, V_j through a ring of shared-memory slots by TMA,
#    two consumer warpgroups take turns on the tensor cores (one's softmax under the other's
#    matmuls). Backward: a CTA per key tile, dQ added up by TMA reduce-adds. The state travels
#    in aggregates; a partition reads schedule -> mainloop -> epilogue. Head dims 65 to 96 run
#    as 64 plus a tail of 16 or 32 columns.

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.experimental.gluon.language._core import builtin as _gl_builtin
    from triton.language.core import _aggregate as aggregate
    from triton._C.libtriton import ir as _ir
    # (named async_load / async_store after Triton 3.6)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    @_gl_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """TMA reduce-add of a shared-memory tile into global memory: the compiler has the
        operation, Triton 3.6's Gluon does not name it."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(
            _ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)
except ImportError:  # a Triton without Gluon: the Triton kernels serve everything
    gluon = None

# tile width -> (BLOCK_M per consumer warpgroup, BLOCK_N, K/V stages, Q tiles per warpgroup)
GLUON_FWD_CONFIGS = {64: (64, 128, 3, 2), 80: (64, 128, 3, 2), 96: (64, 128, 3, 2),
                     128: (64, 128, 2, 1)}
# tile width -> (BLOCK_M, BLOCK_N per consumer warpgroup, Q/dO stages, dQ split (2: each
# warpgroup makes half of dQ's columns), persistent grid, the dQ tiles' swizzle bytes (32 at
# D=128: with 128 its 8-byte stores hit one bank))
GLUON_BWD_CONFIGS = {64: (64, 64, 3, 1, True, 128), 80: (64, 64, 3, 1, True, 128),
                     96: (64, 64, 2, 1, True, 128), 128: (64, 64, 2, 2, False, 32)}
# up to this many keys a sequence the backward stores full dK/dV tiles by TMA at D=128
GLUON_BWD_DKV_TMA_MAX_SEQLEN = 4096

if gluon is not None:
    # an integer argument as a field: a tensor, or a constexpr where Triton specialized it
    _GL_INT = (gl.tensor, gl.constexpr)

    @gluon.constexpr_function
    def _gl_int(x):
        return x if isinstance(x, gl.tensor) else gl.constexpr(x)

    @gluon.jit
    def _gl_ring(n, SLOTS: gl.constexpr):
        """Use n of a ring of SLOTS buffers: (its slot, the phase its barriers wait for). A
        producer waits for phase ^ 1 on the empty barriers, which start as if released."""
        return n % SLOTS, (n // SLOTS) & 1

    @aggregate
    class _Schedule:
        """A persistent CTA's work items (DYNAMIC): its producer claims the next untaken item
        from `counter` and hands it to the other partitions through a two-slot ring."""
        ring: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        counter: gl.tensor
        DYNAMIC: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, *, ring, ready, empty, counter, DYNAMIC):
            self.ring = ring
            self.ready = ready
            self.empty = empty
            self.counter = counter
            self.DYNAMIC = gl.constexpr(DYNAMIC)

        @gluon.jit
        def publish(self, n, item):  # the producer: item into the ring, once it is free
            s, phase = _gl_ring(n, 2)
            mbarrier.wait(self.empty.index(s), phase ^ 1)
            layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
            self.ring.index(s).store(gl.full([1], item, gl.int32, layout))
            mbarrier.arrive(self.ready.index(s), count=1)

        @gluon.jit
        def read(self, n):  # a reader: the CTA's n-th work item
            s, phase = _gl_ring(n, 2)
            mbarrier.wait(self.ready.index(s), phase)
            layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
            item = gl.max(self.ring.index(s).load(layout), 0)
            mbarrier.arrive(self.empty.index(s), count=1)
            # lane 0's value (every lane holds it): tells the compiler it is warp-uniform
            return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 0x1f, -1;", "=r,r",
                                             [item], dtype=gl.int32, is_pure=True, pack=1)

        @gluon.jit
        def first(self):  # a reader's first item: from the ring, or a CTA per item: its own
            return self.read(0) if self.DYNAMIC else gl.program_id(0)

        @gluon.jit
        def claim(self):  # the producer: the next item no CTA has taken yet
            return gl.num_programs(0) + gl.atomic_add(self.counter, 1, sem="relaxed")

    @gluon.jit
    def _gl_tiles(desc, n: gl.constexpr):  # n shared-memory tiles of desc's block
        return gl.allocate_shared_memory(desc.dtype, [n] + desc.block_type.shape, desc.layout)

    @gluon.jit
    def _gl_bars(n: gl.constexpr):  # n mbarriers (the caller initializes them)
        return gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())

    @gluon.jit
    def _gl_init_bars(n: gl.constexpr, bars, arrivals: gl.constexpr):
        for i in gl.static_range(n):  # bars[j][i]: arrivals[j] arrivals
            for j in gl.static_range(len(bars)):
                mbarrier.init(bars[j].index(i), count=arrivals[j])

    @gluon.jit
    def _gl_schedule(counter, DYNAMIC: gl.constexpr):  # its barriers not yet initialized
        ring_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        ring = gl.allocate_shared_memory(gl.int32, [2, 1], ring_layout)
        return _Schedule(ring=ring, ready=_gl_bars(2), empty=_gl_bars(2), counter=counter,
                         DYNAMIC=DYNAMIC)

    @gluon.jit
    def _gl_doc_slot(cu_seqlens, n_docs, g, TILE: gl.constexpr):
        """Packed, a work item per slot g of TILE rows: document b owns the slots
        [cu[b] // TILE + b, cu[b + 1] // TILE + b + 1). Returns (b, its first row, its length,
        b's tile at slot g)."""
        CHUNK: gl.constexpr = 256
        WARPS: gl.constexpr = gl.num_warps()
        chunk_layout: gl.constexpr = gl.BlockedLayout([CHUNK // (32 * WARPS)], [32], [WARPS], [0])
        offs = gl.arange(0, CHUNK, layout=chunk_layout)
        count = gl.to_tensor(0)
        for c in range(0, n_docs, CHUNK):
            d = c + offs
            first = gl.load(cu_seqlens + d, mask=d < n_docs, other=0) // TILE + d
            count += gl.sum(((first <= g) & (d < n_docs)).to(gl.int32), 0)
        b = count - 1  # (document 0's first slot is 0 <= g)
        start = gl.load(cu_seqlens + b)
        length = gl.load(cu_seqlens + b + 1) - start
        return b, start, length, g - (start // TILE + b)

    @gluon.jit
    def _gl_softmax(s, m_i, l_i, start_n, offs_m, offs_n, seqlen_k, qk_scale, masked,
                    CAUSAL: gl.constexpr):
        """One online-softmax step on a key tile's scores, in base 2: P, m_i, l_i and alpha
        (which rescales acc)."""
        if masked:  # ragged end and, when causal, the diagonal tile
            cols = start_n + offs_n
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            s = gl.where(keep, s, -1.0e6)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)  # max of the scaled scores (scale > 0)
        p = gl.exp2(s * qk_scale - m_new[:, None])  # one FMA and one exp2 per score
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _gl_load_tile(desc, tail_desc, bars, tiles, tail_tiles, i, b, h, row,
                      EXPECT: gl.constexpr):
        """TMA loads of a tile from `row` of head h (dense: of sequence b) into tiles[i] and
        tail_tiles[i], onto bars[i], which first expects EXPECT such loads."""
        HEAD_DIM: gl.constexpr = desc.block_type.shape[-1]
        TAIL: gl.constexpr = _gl_tail(desc, tail_desc)
        if EXPECT > 0:
            nbytes: gl.constexpr = desc.block_type.nbytes + (
                tail_desc.block_type.nbytes if TAIL > 0 else 0)
            mbarrier.expect(bars.index(i), EXPECT * nbytes)
        bar, dst, tail_dst = bars.index(i), tiles.index(i), tail_tiles.index(i)
        _tma_load(desc, [row, h, 0] if _gl_packed(desc) else [b, h, row, 0], bar, dst)
        if TAIL > 0:
            tail_at = [row, h, HEAD_DIM] if _gl_packed(desc) else [b, h, row, HEAD_DIM]
            _tma_load(tail_desc, tail_at, bar, tail_dst)

    @gluon.jit
    def _gl_store_tile(desc, tiles, i, b, h, row):  # tiles[i], written and fenced, by TMA
        _tma_store(desc, [row, h, 0] if _gl_packed(desc) else [b, h, row, 0], tiles.index(i))

    @gluon.constexpr_function
    def _gl_mma_layout(n):  # a warpgroup's wgmma accumulator layout for tiles n columns wide
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, n, 16])

    @gluon.constexpr_function
    def _gl_tail(desc, tail_desc):  # the tail tiles' width (0: no tail, the main descriptor)
        width = tail_desc.block_type.shape[-1]
        return 0 if width == desc.block_type.shape[-1] else width

    @gluon.constexpr_function
    def _gl_rows(desc):  # the rows of a descriptor's tiles
        shape = desc.block_type.shape
        return shape[0] if len(shape) == 3 else shape[2]

    @gluon.constexpr_function
    def _gl_packed(desc):  # VARLEN: packed descriptors are (total, H, D), dense (B, H, S, D)
        return len(desc.block_type.shape) == 3

    # The work counts change from batch to batch: not specialized on, so that a new number of
    # rows or documents compiles nothing
    _GL_COUNTS = ["n_docs", "n_items"]

    # ---- the forward ----

    @aggregate
    class _FwdConfig:
        """The forward's tiling (GLUON_FWD_CONFIGS) and problem. HEAD_MAJOR: one head's items
        in a row (K, V shared in L2); O_TMA: full O tiles leave by TMA; m_tiles: items per
        batch x head (packed: slots)."""
        HEAD_DIM: gl.constexpr
        TAIL: gl.constexpr
        BLOCK_M: gl.constexpr
        BLOCK_N: gl.constexpr
        NUM_STAGES: gl.constexpr
        Q_BUFS: gl.constexpr
        CAUSAL: gl.constexpr
        VARLEN: gl.constexpr
        HEAD_MAJOR: gl.constexpr
        O_TMA: gl.constexpr
        cu_seqlens_q: gl.tensor
        qk_scale: gl.tensor
        head_dim: _GL_INT
        seqlen_q: _GL_INT
        seqlen_k: _GL_INT
        num_heads: _GL_INT
        group: _GL_INT
        m_tiles: _GL_INT
        n_bh: _GL_INT
        n_docs: _GL_INT
        n_items: _GL_INT

        @gluon.constexpr_function
        def __init__(self, *, HEAD_DIM, TAIL, BLOCK_M, BLOCK_N, NUM_STAGES, Q_BUFS, CAUSAL, VARLEN,
                     HEAD_MAJOR, O_TMA, cu_seqlens_q, qk_scale, head_dim, seqlen_q, seqlen_k,
                     num_heads, group, m_tiles, n_bh, n_docs, n_items):
            self.HEAD_DIM = gl.constexpr(HEAD_DIM)
            self.TAIL = gl.constexpr(TAIL)
            self.BLOCK_M = gl.constexpr(BLOCK_M)
            self.BLOCK_N = gl.constexpr(BLOCK_N)
            self.NUM_STAGES = gl.constexpr(NUM_STAGES)
            self.Q_BUFS = gl.constexpr(Q_BUFS)
            self.CAUSAL = gl.constexpr(CAUSAL)
            self.VARLEN = gl.constexpr(VARLEN)
            self.HEAD_MAJOR = gl.constexpr(HEAD_MAJOR)
            self.O_TMA = gl.constexpr(O_TMA)
            self.cu_seqlens_q = cu_seqlens_q
            self.qk_scale = qk_scale
            self.head_dim = _gl_int(head_dim)
            self.seqlen_q = _gl_int(seqlen_q)
            self.seqlen_k = _gl_int(seqlen_k)
            self.num_heads = _gl_int(num_heads)
            self.group = _gl_int(group)
            self.m_tiles = _gl_int(m_tiles)
            self.n_bh = _gl_int(n_bh)
            self.n_docs = _gl_int(n_docs)
            self.n_items = _gl_int(n_items)

        @gluon.jit
        def item(self, t):
            """Work item t (longest first) -> (b, h, q_start, seqlen_q, seqlen_k, start_m, key
            tiles, n_full of them without compares). Empty items: start_m >= seqlen_q."""
            if self.HEAD_MAJOR:
                bh, pid_m = t // self.m_tiles, self.m_tiles - 1 - t % self.m_tiles
            else:
                bh, pid_m = t % self.n_bh, self.m_tiles - 1 - t // self.n_bh
            q_start, seqlen_q, seqlen_k = 0, self.seqlen_q, self.seqlen_k
            if self.VARLEN:  # bh is the head, pid_m a slot
                h = bh
                b, q_start, seqlen_q, pid_m = _gl_doc_slot(self.cu_seqlens_q, self.n_docs, pid_m,
                                                           2 * self.BLOCK_M)
                seqlen_k = seqlen_q
            else:
                b, h = bh // self.num_heads, bh % self.num_heads
            start_m = pid_m * 2 * self.BLOCK_M
            hi = gl.minimum(seqlen_k, start_m + 2 * self.BLOCK_M) if self.CAUSAL else seqlen_k
            n_full = seqlen_k // self.BLOCK_N  # key tiles with no index compare
            if self.CAUSAL:
                n_full = gl.minimum(start_m, n_full * self.BLOCK_N) // self.BLOCK_N
            return b, h, q_start, seqlen_q, seqlen_k, start_m, gl.cdiv(hi, self.BLOCK_N), n_full

    @aggregate
    class _FwdGlobal:
        """The forward's TMA descriptors (tails: the main ones where there are none); O and L
        as pointers."""
        q: tma.tensor_descriptor
        k: tma.tensor_descriptor
        v: tma.tensor_descriptor
        qt: tma.tensor_descriptor
        kt: tma.tensor_descriptor
        vt: tma.tensor_descriptor
        o: tma.tensor_descriptor
        O: gl.tensor
        LSE: gl.tensor
        stride_ob: _GL_INT
        stride_oh: _GL_INT
        stride_os: _GL_INT
        stride_lb: _GL_INT
        stride_lh: _GL_INT

        @gluon.constexpr_function
        def __init__(self, *, q, k, v, qt, kt, vt, o, O, LSE, stride_ob, stride_oh, stride_os,
                     stride_lb, stride_lh):
            self.q = q
            self.k = k
            self.v = v
            self.qt = qt
            self.kt = kt
            self.vt = vt
            self.o = o
            self.O = O
            self.LSE = LSE
            self.stride_ob = _gl_int(stride_ob)
            self.stride_oh = _gl_int(stride_oh)
            self.stride_os = _gl_int(stride_os)
            self.stride_lb = _gl_int(stride_lb)
            self.stride_lh = _gl_int(stride_lh)

    @aggregate
    class _FwdShared:
        """The forward's tiles and barriers: q 2 x Q_BUFS tiles, k/v a ring of NUM_STAGES, o
        one per warpgroup; turn: the warpgroups' turns at the MMAs."""
        q: gl.shared_memory_descriptor
        k: gl.shared_memory_descriptor
        v: gl.shared_memory_descriptor
        qt: gl.shared_memory_descriptor
        kt: gl.shared_memory_descriptor
        vt: gl.shared_memory_descriptor
        o: gl.shared_memory_descriptor
        q_ready: gl.shared_memory_descriptor
        q_empty: gl.shared_memory_descriptor
        k_ready: gl.shared_memory_descriptor
        k_empty: gl.shared_memory_descriptor
        v_ready: gl.shared_memory_descriptor
        v_empty: gl.shared_memory_descriptor
        turn: gl.shared_memory_descriptor

        @gluon.constexpr_function
        def __init__(self, *, q, k, v, qt, kt, vt, o, q_ready, q_empty, k_ready, k_empty, v_ready,
                     v_empty, turn):
            self.q = q
            self.k = k
            self.v = v
            self.qt = qt
            self.kt = kt
            self.vt = vt
            self.o = o
            self.q_ready = q_ready
            self.q_empty = q_empty
            self.k_ready = k_ready
            self.k_empty = k_empty
            self.v_ready = v_ready
            self.v_empty = v_empty
            self.turn = turn

    @gluon.jit
    def _gl_fwd_consumer(WG: gl.constexpr, cfg, glob, smem, sched):
        """One consumer warpgroup: BLOCK_M rows of each work item. TAIL > 0: the last TAIL
        columns in tiles of their own, one more matmul each for S and O."""
        HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
        TAIL: gl.constexpr = cfg.TAIL
        BLOCK_M: gl.constexpr = cfg.BLOCK_M
        BLOCK_N: gl.constexpr = cfg.BLOCK_N
        NUM_STAGES: gl.constexpr = cfg.NUM_STAGES
        N_PV: gl.constexpr = 2 if TAIL > 0 else 1  # wgmma groups of one P V product
        s_layout: gl.constexpr = _gl_mma_layout(BLOCK_N)
        o_layout: gl.constexpr = _gl_mma_layout(HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = smem.q.dtype
        if TAIL > 0:
            ot_layout: gl.constexpr = _gl_mma_layout(TAIL)
            pt_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ot_layout, k_width=2)
            row_ot: gl.constexpr = gl.SliceLayout(1, ot_layout)
        # so far: K/V tiles (the ring's position), turns, items done, items taken
        it, w, n_done, n_seen = 0, 0, 0, 0
        item = sched.first()
        while item < cfg.n_items:
            b, h, q_start, seqlen_q_b, seqlen_k_b, start_m, n_tiles, n_full = cfg.item(item)
            if start_m < seqlen_q_b:
                rows0 = start_m + WG * BLOCK_M
                offs_m = rows0 + gl.arange(0, BLOCK_M, layout=row_s)
                offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
                l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=row_s)
                acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
                if TAIL > 0:
                    acc_t = gl.zeros([BLOCK_M, TAIL], gl.float32, layout=ot_layout)
                s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
                q_slot, q_phase = _gl_ring(n_done, cfg.Q_BUFS)
                qi = 2 * q_slot + WG
                q = smem.q.index(qi).reshape([BLOCK_M, HEAD_DIM])
                if TAIL > 0:
                    qt = smem.qt.index(qi).reshape([BLOCK_M, TAIL])
                mbarrier.wait(smem.q_ready.index(qi), q_phase)

                # mainloop: S_0 and its softmax, then per key tile j: S_j and P_(j-1) V_(j-1)
                # issued, S_j's softmax under the second matmul
                slot, phase = _gl_ring(it, NUM_STAGES)
                mbarrier.wait(smem.k_ready.index(slot), phase)
                k = smem.k.index(slot).reshape([BLOCK_N, HEAD_DIM])
                mbarrier.wait(smem.turn.index(WG), (w & 1) ^ 1 ^ WG)
                s = warpgroup_mma(q, k.permute((1, 0)), s, use_acc=False, is_async=True)
                if TAIL > 0:
                    s = warpgroup_mma(qt, smem.kt.index(slot).reshape([BLOCK_N, TAIL]).permute(
                        (1, 0)), s, is_async=True)
                mbarrier.arrive(smem.turn.index(1 - WG), count=1)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                mbarrier.arrive(smem.k_empty.index(slot), count=1)
                p, m_i, l_i, alpha = _gl_softmax(s, m_i, l_i, 0, offs_m, offs_n, seqlen_k_b,
                                                 cfg.qk_scale, n_full == 0, cfg.CAUSAL)
                p = gl.convert_layout(p.to(dtype), p_layout)
                if TAIL > 0:
                    p_t = gl.convert_layout(p, pt_layout)
                for j in range(1, n_tiles):
                    slot, phase = _gl_ring(it + j, NUM_STAGES)
                    prev, prev_phase = _gl_ring(it + j - 1, NUM_STAGES)
                    mbarrier.wait(smem.k_ready.index(slot), phase)
                    k = smem.k.index(slot).reshape([BLOCK_N, HEAD_DIM])
                    mbarrier.wait(smem.v_ready.index(prev), prev_phase)
                    v = smem.v.index(prev).reshape([BLOCK_N, HEAD_DIM])
                    mbarrier.wait(smem.turn.index(WG), ((w + j) & 1) ^ 1 ^ WG)
                    # S_j = Q K_j^T
                    s = warpgroup_mma(q, k.permute((1, 0)), s, use_acc=False, is_async=True)
                    if TAIL > 0:
                        s = warpgroup_mma(qt, smem.kt.index(slot).reshape([BLOCK_N, TAIL]).permute(
                            (1, 0)), s, is_async=True)
                    # O += P_(j-1) V_(j-1)
                    acc = warpgroup_mma(p, v, acc, is_async=True)
                    if TAIL > 0:
                        acc_t = warpgroup_mma(p_t, smem.vt.index(prev).reshape([BLOCK_N, TAIL]),
                                              acc_t, is_async=True)
                    mbarrier.arrive(smem.turn.index(1 - WG), count=1)
                    # S_j ready; P V runs on
                    s = warpgroup_mma_wait(num_outstanding=N_PV, deps=(s,))
                    mbarrier.arrive(smem.k_empty.index(slot), count=1)
                    p_next, m_i, l_i, alpha = _gl_softmax(s, m_i, l_i, j * BLOCK_N, offs_m, offs_n,
                                                          seqlen_k_b, cfg.qk_scale, j >= n_full,
                                                          cfg.CAUSAL)
                    if TAIL > 0:
                        acc, acc_t, p, p_t = warpgroup_mma_wait(num_outstanding=0,
                                                                deps=(acc, acc_t, p, p_t))
                        acc_t = acc_t * gl.convert_layout(alpha, row_ot)[:, None]
                    else:
                        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
                    mbarrier.arrive(smem.v_empty.index(prev), count=1)
                    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                    p = gl.convert_layout(p_next.to(dtype), p_layout)
                    if TAIL > 0:
                        p_t = gl.convert_layout(p, pt_layout)
                # every S of this item is made: Q's slot is free
                mbarrier.arrive(smem.q_empty.index(qi), count=1)
                last, phase = _gl_ring(it + n_tiles - 1, NUM_STAGES)
                mbarrier.wait(smem.v_ready.index(last), phase)
                v = smem.v.index(last).reshape([BLOCK_N, HEAD_DIM])
                mbarrier.wait(smem.turn.index(WG), ((w + n_tiles) & 1) ^ 1 ^ WG)
                acc = warpgroup_mma(p, v, acc, is_async=True)
                if TAIL > 0:
                    acc_t = warpgroup_mma(p_t, smem.vt.index(last).reshape([BLOCK_N, TAIL]), acc_t,
                                          is_async=True)
                mbarrier.arrive(smem.turn.index(1 - WG), count=1)
                if TAIL > 0:
                    acc, acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_t))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(smem.v_empty.index(last), count=1)

                # epilogue: O = acc / l and L = m + log(l)
                l_safe = gl.where(l_i == 0.0, 1.0, l_i)
                l_inv = 1.0 / l_safe  # one division per row, then a multiply per element
                out = (acc * gl.convert_layout(l_inv, row_o)[:, None]).to(
                    glob.O.dtype.element_ty)
                o_base = (b.to(gl.int64) * glob.stride_ob + h * glob.stride_oh
                          + q_start.to(gl.int64) * glob.stride_os)
                # full tiles (a packed one reaching past its document would write the next one's;
                # a dense one is clipped by the descriptor, but Triton 3.6 fails to compile a
                # kernel whose O goes unused)
                staged = rows0 + BLOCK_M <= seqlen_q_b if cfg.O_TMA else False
                if staged:  # through shared memory, stored by TMA while this warpgroup goes on
                    tma.store_wait(0)  # the previous item's store has read the buffer
                    smem.o.index(WG).reshape([BLOCK_M, HEAD_DIM]).store(out)
                    fence_async_shared()
                    _gl_store_tile(glob.o, smem.o, WG, b, h, q_start + rows0)
                else:
                    rows = rows0 + gl.arange(0, BLOCK_M, layout=row_o)
                    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
                    gl.store(glob.O + o_base + rows[:, None].to(gl.int64) * glob.stride_os
                             + cols[None, :], out,
                             mask=(rows[:, None] < seqlen_q_b) & (cols[None, :] < cfg.head_dim))
                if TAIL > 0:
                    rows = rows0 + gl.arange(0, BLOCK_M, layout=row_ot)
                    cols = HEAD_DIM + gl.arange(0, TAIL, layout=gl.SliceLayout(0, ot_layout))
                    out = acc_t * gl.convert_layout(l_inv, row_ot)[:, None]
                    gl.store(glob.O + o_base + rows[:, None].to(gl.int64) * glob.stride_os
                             + cols[None, :], out.to(glob.O.dtype.element_ty),
                             mask=(rows[:, None] < seqlen_q_b) & (cols[None, :] < cfg.head_dim))
                l_base = b.to(gl.int64) * glob.stride_lb + h * glob.stride_lh + q_start
                gl.store(glob.LSE + l_base + offs_m,
                         (m_i + gl.log2(l_safe)) * 0.6931471805599453,
                         mask=offs_m < seqlen_q_b)
                it, w, n_done = it + n_tiles, w + n_tiles + 1, n_done + 1
            n_seen += 1
            item = sched.read(n_seen) if sched.DYNAMIC else item + gl.num_programs(0)
        if cfg.O_TMA:
            tma.store_wait(0)  # the last store has read its buffer before shared memory goes

    @gluon.jit
    def _gl_fwd_loader(cfg, glob, smem, sched):
        """The producer warp: per work item both warpgroups' Q tiles, then K_j and V_j into
        ring slots once both consumers have released them."""
        # n_seen: items taken (the schedule ring's position)
        it, n_done, item, n_seen = 0, 0, gl.program_id(0), 0
        while item < cfg.n_items:
            if sched.DYNAMIC:
                sched.publish(n_seen, item)
            b, h, q_start, seqlen_q_b, seqlen_k_b, start_m, n_tiles, n_full = cfg.item(item)
            if start_m < seqlen_q_b:
                kv_h = h // cfg.group
                for wg in gl.static_range(2):
                    q_slot, q_phase = _gl_ring(n_done, cfg.Q_BUFS)
                    qi = 2 * q_slot + wg
                    mbarrier.wait(smem.q_empty.index(qi), q_phase ^ 1)
                    _gl_load_tile(glob.q, glob.qt, smem.q_ready, smem.q, smem.qt, qi, b, h,
                                  q_start + start_m + wg * cfg.BLOCK_M, 1)
                for j in range(n_tiles):
                    slot, phase = _gl_ring(it + j, cfg.NUM_STAGES)
                    row = q_start + j * cfg.BLOCK_N
                    mbarrier.wait(smem.k_empty.index(slot), phase ^ 1)
                    _gl_load_tile(glob.k, glob.kt, smem.k_ready, smem.k, smem.kt, slot, b, kv_h,
                                  row, 1)
                    mbarrier.wait(smem.v_empty.index(slot), phase ^ 1)
                    _gl_load_tile(glob.v, glob.vt, smem.v_ready, smem.v, smem.vt, slot, b, kv_h,
                                  row, 1)
                it, n_done = it + n_tiles, n_done + 1
            n_seen += 1
            item = sched.claim() if sched.DYNAMIC else item + gl.num_programs(0)
        if sched.DYNAMIC:
            sched.publish(n_seen, item)  # past the last: the consumers stop

    @gluon.jit(do_not_specialize=_GL_COUNTS + ["m_tiles", "n_bh"])
    def _gl_attn_fwd(q_desc, k_desc, v_desc, qt_desc, kt_desc, vt_desc, o_desc,
                     O, LSE, cu_seqlens_q, counter,
                     stride_ob, stride_oh, stride_os,
                     stride_lb, stride_lh,
                     head_dim, seqlen_q, seqlen_k, num_heads, group,
                     m_tiles, n_bh, n_docs, n_items, qk_scale,
                     NUM_STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
                     CAUSAL: gl.constexpr, HEAD_MAJOR: gl.constexpr,
                     DYNAMIC: gl.constexpr, O_TMA: gl.constexpr):
        """n_items = m_tiles * n_bh work items (_FwdConfig.item): a CTA each, or DYNAMIC a
        persistent grid (_Schedule). The descriptors' blocks give the tiling."""
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[-1]
        TAIL: gl.constexpr = _gl_tail(q_desc, qt_desc)
        q_smem = _gl_tiles(q_desc, 2 * Q_BUFS)
        k_smem, v_smem = _gl_tiles(k_desc, NUM_STAGES), _gl_tiles(v_desc, NUM_STAGES)
        # the head dim's last TAIL columns (no tail: its descriptors and tiles go unused)
        qt_smem = _gl_tiles(qt_desc, 2 * Q_BUFS) if TAIL > 0 else q_smem
        kt_smem = _gl_tiles(kt_desc, NUM_STAGES) if TAIL > 0 else k_smem
        vt_smem = _gl_tiles(vt_desc, NUM_STAGES) if TAIL > 0 else v_smem
        # each warpgroup's O tile on its way to the TMA store
        o_smem = _gl_tiles(o_desc, 2) if O_TMA else q_smem
        q_ready, q_empty = _gl_bars(2 * Q_BUFS), _gl_bars(2 * Q_BUFS)
        k_ready, k_empty = _gl_bars(NUM_STAGES), _gl_bars(NUM_STAGES)
        v_ready, v_empty = _gl_bars(NUM_STAGES), _gl_bars(NUM_STAGES)
        turn = _gl_bars(2)
        sched = _gl_schedule(counter, DYNAMIC)
        # both consumers read the schedule's slots and release the K and V slots
        _gl_init_bars(2, (turn, sched.ready, sched.empty), (1, 1, 2))
        _gl_init_bars(2 * Q_BUFS, (q_ready, q_empty), (1, 1))
        _gl_init_bars(NUM_STAGES, (k_ready, k_empty, v_ready, v_empty), (1, 2, 1, 2))
        smem = _FwdShared(q=q_smem, k=k_smem, v=v_smem, qt=qt_smem, kt=kt_smem, vt=vt_smem,
                          o=o_smem, q_ready=q_ready, q_empty=q_empty, k_ready=k_ready,
                          k_empty=k_empty, v_ready=v_ready, v_empty=v_empty, turn=turn)
        cfg = _FwdConfig(HEAD_DIM=HEAD_DIM, TAIL=TAIL, BLOCK_M=_gl_rows(q_desc),
                         BLOCK_N=_gl_rows(k_desc), NUM_STAGES=NUM_STAGES, Q_BUFS=Q_BUFS,
                         CAUSAL=CAUSAL, VARLEN=_gl_packed(q_desc), HEAD_MAJOR=HEAD_MAJOR,
                         O_TMA=O_TMA, cu_seqlens_q=cu_seqlens_q, qk_scale=qk_scale,
                         head_dim=head_dim, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                         num_heads=num_heads, group=group, m_tiles=m_tiles, n_bh=n_bh,
                         n_docs=n_docs, n_items=n_items)
        glob = _FwdGlobal(q=q_desc, k=k_desc, v=v_desc, qt=qt_desc, kt=kt_desc, vt=vt_desc,
                          o=o_desc, O=O, LSE=LSE, stride_ob=stride_ob, stride_oh=stride_oh,
                          stride_os=stride_os, stride_lb=stride_lb, stride_lh=stride_lh)
        gl.warp_specialize([(_gl_fwd_consumer, (0, cfg, glob, smem, sched)),
                            (_gl_fwd_consumer, (gl.constexpr(1), cfg, glob, smem, sched)),
                            (_gl_fwd_loader, (cfg, glob, smem, sched))], [4, 1], [240, 24])

    # ---- the backward ----
    # Work items of 2 x BLOCK_N keys of one K/V head, BLOCK_N per consumer warpgroup; the
    # producer streams every query tile (Q_i, dO_i, L_i, Delta_i) of the group's heads. Per
    # query tile a consumer makes five matmuls on transposed scores:
    #   S^T = K Q_i^T,  dP^T = V dO_i^T,  P^T = exp2(S^T * scale - L_i),
    #   dS^T = P^T * (dP^T - Delta_i),  dV += P^T dO_i,  dK += dS^T Q_i,  dQ_i = dS K
    # (dS^T through shared memory, read transposed). A dQ warp adds each dQ share into an fp32
    # buffer by TMA reduce-adds. With the dQ split (D=128) each warpgroup makes half of dQ_i's
    # columns over both K tiles.

    @aggregate
    class _BwdConfig:
        """The backward's tiling (GLUON_BWD_CONFIGS) and problem. DQ_COLS: the dQ columns a
        warpgroup makes; DKV_TMA: full dK/dV tiles leave by TMA; n_tiles: items per batch x
        K/V head (packed, persistent: slots)."""
        HEAD_DIM: gl.constexpr
        TAIL: gl.constexpr
        BLOCK_M: gl.constexpr
        BLOCK_N: gl.constexpr
        NUM_STAGES: gl.constexpr
        DQ_COLS: gl.constexpr
        CAUSAL: gl.constexpr
        VARLEN: gl.constexpr
        DKV_TMA: gl.constexpr
        cu_seqlens_q: gl.tensor
        qk_scale: gl.tensor
        sm_scale: gl.tensor
        seqlen_q: _GL_INT
        seqlen_k: _GL_INT
        num_kv_heads: _GL_INT
        group: _GL_INT
        head_dim: _GL_INT
        n_tiles: _GL_INT
        n_docs: _GL_INT
        n_items: _GL_INT

        @gluon.constexpr_function
        def __init__(self, *, HEAD_DIM, TAIL, BLOCK_M, BLOCK_N, NUM_STAGES, DQ_COLS, CAUSAL, VARLEN,
                     DKV_TMA, cu_seqlens_q, qk_scale, sm_scale, seqlen_q, seqlen_k, num_kv_heads, group,
                     head_dim, n_tiles, n_docs, n_items):
            self.HEAD_DIM = gl.constexpr(HEAD_DIM)
            self.TAIL = gl.constexpr(TAIL)
            self.BLOCK_M = gl.constexpr(BLOCK_M)
            self.BLOCK_N = gl.constexpr(BLOCK_N)
            self.NUM_STAGES = gl.constexpr(NUM_STAGES)
            self.DQ_COLS = gl.constexpr(DQ_COLS)
            self.CAUSAL = gl.constexpr(CAUSAL)
            self.VARLEN = gl.constexpr(VARLEN)
            self.DKV_TMA = gl.constexpr(DKV_TMA)
            self.cu_seqlens_q = cu_seqlens_q
            self.qk_scale = qk_scale
            self.sm_scale = sm_scale
            self.seqlen_q = _gl_int(seqlen_q)
            self.seqlen_k = _gl_int(seqlen_k)
            self.num_kv_heads = _gl_int(num_kv_heads)
            self.group = _gl_int(group)
            self.head_dim = _gl_int(head_dim)
            self.n_tiles = _gl_int(n_tiles)
            self.n_docs = _gl_int(n_docs)
            self.n_items = _gl_int(n_items)

        @gluon.jit
        def item(self, t, SLOTS: gl.constexpr):
            """Work item t -> (b, hk, q_start, seqlen_q, seqlen_k, start_n, m_lo, n_iter): keys
            from start_n of one batch x K/V head, seen by query tiles m_lo to m_lo + n_iter - 1
            of its group's heads. Empty items: start_n >= seqlen_k."""
            bh, pid_n = t // self.n_tiles, t % self.n_tiles
            q_start, seqlen_q, seqlen_k = 0, self.seqlen_q, self.seqlen_k
            if self.VARLEN and SLOTS:  # bh is the K/V head, pid_n a slot
                hk = bh
                b, q_start, seqlen_q, pid_n = _gl_doc_slot(self.cu_seqlens_q, self.n_docs, pid_n,
                                                           2 * self.BLOCK_N)
                seqlen_k = seqlen_q
            else:
                b, hk = bh // self.num_kv_heads, bh % self.num_kv_heads
                if self.VARLEN:
                    q_start = gl.load(self.cu_seqlens_q + b)
                    seqlen_q = gl.load(self.cu_seqlens_q + b + 1) - q_start
                    seqlen_k = seqlen_q
            start_n = pid_n * 2 * self.BLOCK_N
            # causal: query rows before start_n see none of these keys
            m_lo = start_n // self.BLOCK_M if self.CAUSAL else 0
            n_iter = gl.maximum(gl.cdiv(seqlen_q, self.BLOCK_M) - m_lo, 0)
            return b, hk, q_start, seqlen_q, seqlen_k, start_n, m_lo, n_iter

    @aggregate
    class _BwdGlobal:
        """The backward's TMA descriptors (tails: the main ones where there are none); dK, dV,
        L, Delta as pointers."""
        q: tma.tensor_descriptor
        k: tma.tensor_descriptor
        v: tma.tensor_descriptor
        do: tma.tensor_descriptor
        dq: tma.tensor_descriptor
        qt: tma.tensor_descriptor
        kt: tma.tensor_descriptor
        vt: tma.tensor_descriptor
        dot: tma.tensor_descriptor
        dqt: tma.tensor_descriptor
        dk: tma.tensor_descriptor
        dv: tma.tensor_descriptor
        DK: gl.tensor
        DV: gl.tensor
        LSE: gl.tensor
        DELTA: gl.tensor
        stride_dkb: _GL_INT
        stride_dkh: _GL_INT
        stride_dks: _GL_INT
        stride_dvb: _GL_INT
        stride_dvh: _GL_INT
        stride_dvs: _GL_INT
        stride_lb: _GL_INT
        stride_lh: _GL_INT

        @gluon.constexpr_function
        def __init__(self, *, q, k, v, do, dq, qt, kt, vt, dot, dqt, dk, dv, DK, DV, LSE, DELTA,
                     stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
                     stride_lb, stride_lh):
            self.q = q
            self.k = k
            self.v = v
            self.do = do
            self.dq = dq
            self.qt = qt
            self.kt = kt
            self.vt = vt
            self.dot = dot
            self.dqt = dqt
            self.dk = dk
            self.dv = dv
            self.DK = DK
            self.DV = DV
            self.LSE = LSE
            self.DELTA = DELTA
            self.stride_dkb = _gl_int(stride_dkb)
            self.stride_dkh = _gl_int(stride_dkh)
            self.stride_dks = _gl_int(stride_dks)
            self.stride_dvb = _gl_int(stride_dvb)
            self.stride_dvh = _gl_int(stride_dvh)
            self.stride_dvs = _gl_int(stride_dvs)
            self.stride_lb = _gl_int(stride_lb)
            self.stride_lh = _gl_int(stride_lh)

    @aggregate
    class _BwdShared:
        """The backward's tiles and barriers: q/do, lse, delta a ring of NUM_STAGES query tiles;
        k/v each warpgroup's keys; ds and dq buffer b of warpgroup wg at 2 * b + wg."""
        q: gl.shared_memory_descriptor
        do: gl.shared_memory_descriptor
        k: gl.shared_memory_descriptor
        v: gl.shared_memory_descriptor
        ds: gl.shared_memory_descriptor
        dq: gl.shared_memory_descriptor
        qt: gl.shared_memory_descriptor
        dot: gl.shared_memory_descriptor
        kt: gl.shared_memory_descriptor
        vt: gl.shared_memory_descriptor
        dqt: gl.shared_memory_descriptor
        lse: gl.shared_memory_descriptor
        delta: gl.shared_memory_descriptor
        kv_ready: gl.shared_memory_descriptor
        kv_empty: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        ds_ready: gl.shared_memory_descriptor
        dq_full: gl.shared_memory_descriptor
        dq_empty: gl.shared_memory_descriptor

        @gluon.constexpr_function
        def __init__(self, *, q, do, k, v, ds, dq, qt, dot, kt, vt, dqt, lse, delta, kv_ready, kv_empty,
                     ready, empty, ds_ready, dq_full, dq_empty):
            self.q = q
            self.do = do
            self.k = k
            self.v = v
            self.ds = ds
            self.dq = dq
            self.qt = qt
            self.dot = dot
            self.kt = kt
            self.vt = vt
            self.dqt = dqt
            self.lse = lse
            self.delta = delta
            self.kv_ready = kv_ready
            self.kv_empty = kv_empty
            self.ready = ready
            self.empty = empty
            self.ds_ready = ds_ready
            self.dq_full = dq_full
            self.dq_empty = dq_empty

    @gluon.jit
    def _gl_bwd_put_dq(smem, dq, dq_t, tile, WG: gl.constexpr, TAIL: gl.constexpr):
        """A consumer's dQ share of query tile `tile` (scaled; dq_t: its TAIL columns) to the
        dQ warp's buffers, once the dQ warp is done with them."""
        buf, phase = _gl_ring(tile, 2)
        mbarrier.wait(smem.dq_empty.index(2 * buf + WG), phase ^ 1)
        smem.dq.index(2 * buf + WG).reshape(dq.type.shape).store(dq)
        if TAIL > 0:
            smem.dqt.index(2 * buf + WG).reshape(dq_t.type.shape).store(dq_t)
        fence_async_shared()  # the TMA unit (the async proxy) reads what these threads wrote
        mbarrier.arrive(smem.dq_full.index(2 * buf + WG), count=1)

    @gluon.jit
    def _gl_store_keys(glob, cfg, dk, dv, b, hk, q_start, key_lo, seqlen_k, col0: gl.constexpr,
                       layout: gl.constexpr):
        """A consumer's dK (scaled) and dV tiles, columns col0.. of keys key_lo.., stored from
        registers."""
        k_rows = key_lo + gl.arange(0, dk.shape[0], layout=gl.SliceLayout(1, layout))
        # packed: keys share the queries' offsets
        row_off = (q_start + k_rows[:, None]).to(gl.int64)
        cols = col0 + gl.arange(0, dk.shape[1], layout=gl.SliceLayout(0, layout))
        keep = (k_rows[:, None] < seqlen_k) & (cols[None, :] < cfg.head_dim)
        gl.store(glob.DK + b.to(gl.int64) * glob.stride_dkb + hk * glob.stride_dkh
                 + row_off * glob.stride_dks + cols[None, :],
                 (dk * cfg.sm_scale).to(glob.DK.dtype.element_ty), mask=keep)
        gl.store(glob.DV + b.to(gl.int64) * glob.stride_dvb + hk * glob.stride_dvh
                 + row_off * glob.stride_dvs + cols[None, :],
                 dv.to(glob.DV.dtype.element_ty), mask=keep)

    @gluon.jit
    def _gl_bwd_consumer(WG: gl.constexpr, cfg, glob, smem, sched):
        """One consumer warpgroup: keys [start_n + WG * BLOCK_N, + BLOCK_N) of each work item."""
        HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
        TAIL: gl.constexpr = cfg.TAIL
        BLOCK_M: gl.constexpr = cfg.BLOCK_M
        BLOCK_N: gl.constexpr = cfg.BLOCK_N
        DQ_COLS: gl.constexpr = cfg.DQ_COLS
        SPLIT: gl.constexpr = DQ_COLS < HEAD_DIM  # (never with a tail: the configs say so)
        N_MM: gl.constexpr = 2 if TAIL > 0 else 1  # wgmma groups of one product over D
        st_layout: gl.constexpr = _gl_mma_layout(BLOCK_M)
        acc_layout: gl.constexpr = _gl_mma_layout(HEAD_DIM)
        dq_layout: gl.constexpr = _gl_mma_layout(DQ_COLS)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_st: gl.constexpr = gl.SliceLayout(0, st_layout)
        dtype: gl.constexpr = smem.q.dtype
        offs_q = gl.arange(0, BLOCK_M, layout=col_st)
        k = smem.k.index(WG).reshape([BLOCK_N, HEAD_DIM])
        v = smem.v.index(WG).reshape([BLOCK_N, HEAD_DIM])
        if TAIL > 0:  # the last TAIL columns: tiles, accumulators, dQ shares of their own
            tail_layout: gl.constexpr = _gl_mma_layout(TAIL)
            op_t_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=tail_layout, k_width=2)
            kt = smem.kt.index(WG).reshape([BLOCK_N, TAIL])
            vt = smem.vt.index(WG).reshape([BLOCK_N, TAIL])
        # so far: query tiles (the ring's position, the dQ buffers' count), items done, taken
        t, n_done, n_seen = 0, 0, 0
        item = sched.first()
        while item < cfg.n_items:
            b, hk, q_start, seqlen_q_b, seqlen_k_b, start_n, m_lo, n_iter = cfg.item(item, sched.DYNAMIC)
            if start_n < seqlen_k_b:
                key_lo = start_n + WG * BLOCK_N
                keys = key_lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
                dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
                dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
                if TAIL > 0:
                    dk_t = gl.zeros([BLOCK_N, TAIL], gl.float32, layout=tail_layout)
                    dv_t = gl.zeros([BLOCK_N, TAIL], gl.float32, layout=tail_layout)
                key_ragged = key_lo + BLOCK_N > seqlen_k_b
                # SPLIT: the last dQ share
                dq_prev = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout)
                mbarrier.wait(smem.kv_ready.index(WG), n_done & 1)
                # mainloop: one query tile (of every query head of the group in turn) per step
                for i in range(cfg.group * n_iter):
                    tile = t + i
                    slot, phase = _gl_ring(tile, cfg.NUM_STAGES)
                    buf, buf_phase = _gl_ring(tile, 2)
                    start_m = (m_lo + i % n_iter) * BLOCK_M
                    rows = start_m + offs_q
                    mbarrier.wait(smem.ready.index(slot), phase)
                    # read before the matmuls: its latency hides there
                    lse_row = smem.lse.index(slot).load(col_st)
                    q = smem.q.index(slot).reshape([BLOCK_M, HEAD_DIM])
                    do = smem.do.index(slot).reshape([BLOCK_M, HEAD_DIM])
                    # (not loop-carried)
                    zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
                    # S^T = K Q^T
                    st = warpgroup_mma(k, q.permute((1, 0)), zero_st, use_acc=False, is_async=True)
                    if TAIL > 0:
                        qt = smem.qt.index(slot).reshape([BLOCK_M, TAIL])
                        dot = smem.dot.index(slot).reshape([BLOCK_M, TAIL])
                        st = warpgroup_mma(kt, qt.permute((1, 0)), st, is_async=True)
                    if SPLIT:
                        if i > 0:  # the last tile's dQ share to shared memory while S^T is made
                            _gl_bwd_put_dq(smem, dq_prev, dq_prev, tile - 1, WG, 0)
                    # Delta as dP^T's starting value: the tensor cores subtract it
                    minus_delta = zero_st - smem.delta.index(slot).load(col_st)[None, :]
                    # dP^T - Delta
                    dpt = warpgroup_mma(v, do.permute((1, 0)), minus_delta, is_async=True)
                    if TAIL > 0:
                        dpt = warpgroup_mma(vt, dot.permute((1, 0)), dpt, is_async=True)
                    st = warpgroup_mma_wait(num_outstanding=N_MM, deps=(st,))
                    pt = gl.exp2(st * cfg.qk_scale - lse_row[None, :])
                    masked = key_ragged | (start_m + BLOCK_M > seqlen_q_b)
                    if cfg.CAUSAL:
                        masked = masked | (start_m < key_lo + BLOCK_N)
                    if masked:  # ragged ends and, when causal, tiles across the diagonal
                        keep = (keys[:, None] < seqlen_k_b) & (rows[None, :] < seqlen_q_b)
                        if cfg.CAUSAL:
                            keep = keep & (keys[:, None] <= rows[None, :])
                        pt = gl.where(keep, pt, 0.0)
                    pt_op = gl.convert_layout(pt.to(dtype), op_layout)
                    dv = warpgroup_mma(pt_op, do, dv, is_async=True)  # dV += P^T dO
                    if TAIL > 0:
                        pt_op_t = gl.convert_layout(pt_op, op_t_layout)
                        dv_t = warpgroup_mma(pt_op_t, dot, dv_t, is_async=True)
                    dpt = warpgroup_mma_wait(num_outstanding=N_MM, deps=(dpt,))
                    dst = (pt * dpt).to(dtype)
                    smem.ds.index(2 * buf + WG).store(dst)
                    if SPLIT:  # at once: the other warpgroup's dQ waits for this dS
                        fence_async_shared()
                        mbarrier.arrive(smem.ds_ready.index(buf), count=1)
                    dst_op = gl.convert_layout(dst, op_layout)
                    dk = warpgroup_mma(dst_op, q, dk, is_async=True)  # dK += dS^T Q
                    if TAIL > 0:
                        dst_op_t = gl.convert_layout(dst_op, op_t_layout)
                        dk_t = warpgroup_mma(dst_op_t, qt, dk_t, is_async=True)
                    if not SPLIT:  # only this warpgroup reads its dS: stored under dK's matmul
                        fence_async_shared()
                    dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout)
                    if SPLIT:  # this warpgroup's columns of dQ_i = dS K, over both K tiles
                        mbarrier.wait(smem.ds_ready.index(buf), buf_phase)
                        for w in gl.static_range(2):
                            k_cols = smem.k.index(w).reshape([BLOCK_N, HEAD_DIM]).slice(
                                WG * DQ_COLS, DQ_COLS, dim=1)
                            dq = warpgroup_mma(smem.ds.index(2 * buf + w).permute((1, 0)), k_cols,
                                               dq, use_acc=w > 0, is_async=True)
                    else:
                        dq = warpgroup_mma(smem.ds.index(2 * buf + WG).permute((1, 0)), k, dq,
                                           use_acc=False, is_async=True)
                    if TAIL > 0:
                        dq_t = warpgroup_mma(smem.ds.index(2 * buf + WG).permute((1, 0)), kt,
                                             gl.zeros([BLOCK_M, TAIL], gl.float32, layout=tail_layout),
                                             use_acc=False, is_async=True)
                        dv, dk, dq, pt_op, dst_op, dv_t, dk_t, dq_t, pt_op_t, dst_op_t = (
                            warpgroup_mma_wait(num_outstanding=0, deps=(
                                dv, dk, dq, pt_op, dst_op, dv_t, dk_t, dq_t, pt_op_t, dst_op_t)))
                    else:
                        dv, dk, dq, pt_op, dst_op = warpgroup_mma_wait(num_outstanding=0,
                                                                       deps=(dv, dk, dq, pt_op, dst_op))
                    mbarrier.arrive(smem.empty.index(slot), count=1)
                    # SPLIT: stored under the next tile's S^T, scaled into new registers (from the
                    # accumulators themselves ptxas would wait for the wgmma first)
                    if SPLIT:
                        dq_prev = dq * cfg.sm_scale
                    else:
                        _gl_bwd_put_dq(smem, dq * cfg.sm_scale,
                                       dq_t * cfg.sm_scale if TAIL > 0 else dq, tile, WG, TAIL)
                if SPLIT:
                    if cfg.group * n_iter > 0:  # the item's last dQ share
                        _gl_bwd_put_dq(smem, dq_prev, dq_prev, t + cfg.group * n_iter - 1, WG,
                                       0)

                # epilogue: dK and dV. kv_empty: on the persistent grid the producer loads the
                # next item's K and V once both consumers arrive (after their last matmul, or
                # once the dK/dV stores read the tiles); a CTA per item with the dQ split: the
                # dK store waits on it
                if (sched.DYNAMIC and not cfg.DKV_TMA) or (cfg.DKV_TMA and SPLIT):
                    mbarrier.arrive(smem.kv_empty.index(0), count=1)
                # full tiles (a packed one reaching past its document would write the next
                # one's; dense, TMA drops rows past the tensor: a condition, not True, see O_TMA)
                staged = False
                if cfg.DKV_TMA:
                    staged = key_lo + BLOCK_N <= seqlen_k_b if cfg.VARLEN else cfg.head_dim > 0
                if staged:  # through this warpgroup's K and V tiles and TMA stores
                    if SPLIT:  # (one CTA per item: the phase is 0)
                        # the other warpgroup's dQ products have read this K
                        mbarrier.wait(smem.kv_empty.index(0), 0)
                    dk_out = (dk * cfg.sm_scale).to(glob.DK.dtype.element_ty)
                    smem.k.index(WG).reshape([BLOCK_N, HEAD_DIM]).store(dk_out)
                    dv_out = dv.to(glob.DV.dtype.element_ty)
                    smem.v.index(WG).reshape([BLOCK_N, HEAD_DIM]).store(dv_out)
                    fence_async_shared()
                    _gl_store_tile(glob.dk, smem.k, WG, b, hk, q_start + key_lo)
                    _gl_store_tile(glob.dv, smem.v, WG, b, hk, q_start + key_lo)
                    tma.store_wait(0)  # the stores have read the tiles before shared memory goes
                else:
                    _gl_store_keys(glob, cfg, dk, dv, b, hk, q_start, key_lo, seqlen_k_b, 0,
                                   acc_layout)
                if sched.DYNAMIC and cfg.DKV_TMA:
                    mbarrier.arrive(smem.kv_empty.index(0), count=1)
                if TAIL > 0:
                    _gl_store_keys(glob, cfg, dk_t, dv_t, b, hk, q_start, key_lo, seqlen_k_b,
                                   HEAD_DIM, tail_layout)
                t, n_done = t + cfg.group * n_iter, n_done + 1
            n_seen += 1
            # one CTA per item: one pass, no loop
            item = sched.read(n_seen) if sched.DYNAMIC else cfg.n_items

    @gluon.jit
    def _gl_bwd_loader(cfg, glob, smem, sched):
        """The producer warp: per work item each warpgroup's K and V, then Q_i, dO_i, L_i (base
        2) and Delta_i of the group's query tiles into the ring."""
        row_layout: gl.constexpr = gl.BlockedLayout([cfg.BLOCK_M // 32], [32], [1], [0])
        offs = gl.arange(0, cfg.BLOCK_M, layout=row_layout)
        # so far: query tiles, items done, items taken
        t, n_done, n_seen, item = 0, 0, 0, gl.program_id(0)
        while item < cfg.n_items:
            if sched.DYNAMIC:
                sched.publish(n_seen, item)
            b, hk, q_start, seqlen_q_b, seqlen_k_b, start_n, m_lo, n_iter = cfg.item(item, sched.DYNAMIC)
            if start_n < seqlen_k_b:
                if sched.DYNAMIC:  # (one CTA per item: its K and V slots start free)
                    mbarrier.wait(smem.kv_empty.index(0), (n_done & 1) ^ 1)
                for wg in gl.static_range(2):
                    row = q_start + start_n + wg * cfg.BLOCK_N
                    # one barrier expects both K and V
                    _gl_load_tile(glob.k, glob.kt, smem.kv_ready, smem.k, smem.kt, wg, b, hk,
                                  row, 2)
                    _gl_load_tile(glob.v, glob.vt, smem.kv_ready, smem.v, smem.vt, wg, b, hk,
                                  row, 0)
                for i in range(cfg.group * n_iter):
                    slot, phase = _gl_ring(t + i, cfg.NUM_STAGES)
                    h = hk * cfg.group + i // n_iter
                    start_m = (m_lo + i % n_iter) * cfg.BLOCK_M
                    mbarrier.wait(smem.empty.index(slot), phase ^ 1)
                    rows = start_m + offs
                    l_off = b.to(gl.int64) * glob.stride_lb + h * glob.stride_lh + q_start + rows
                    # the TMA loads first: L's and Delta's latency hides under theirs
                    _gl_load_tile(glob.q, glob.qt, smem.ready, smem.q, smem.qt, slot, b, h,
                                  q_start + start_m, 2)
                    _gl_load_tile(glob.do, glob.dot, smem.ready, smem.do, smem.dot, slot, b, h,
                                  q_start + start_m, 0)
                    smem.lse.index(slot).store(
                        gl.load(glob.LSE + l_off, mask=rows < seqlen_q_b, other=0.0)
                        * 1.4426950408889634)
                    smem.delta.index(slot).store(
                        gl.load(glob.DELTA + l_off, mask=rows < seqlen_q_b, other=0.0))
                    # a second arrival: releases the two stores above
                    mbarrier.arrive(smem.ready.index(slot), count=1)
                t, n_done = t + cfg.group * n_iter, n_done + 1
            n_seen += 1
            item = sched.claim() if sched.DYNAMIC else cfg.n_items
        if sched.DYNAMIC:
            sched.publish(n_seen, item)  # past the last: the others stop

    @gluon.jit
    def _gl_bwd_dq_writer(cfg, glob, smem, sched):
        """The dQ warp: each dQ share added to the fp32 dQ buffer by a TMA reduce-add, its
        buffer freed once read."""
        t, n_seen = 0, 0  # so far: query tiles over all items, items taken
        item = sched.first()
        while item < cfg.n_items:
            b, hk, q_start, seqlen_q_b, seqlen_k_b, start_n, m_lo, n_iter = cfg.item(item, sched.DYNAMIC)
            if start_n < seqlen_k_b:
                for i in range(cfg.group * n_iter):
                    tile = t + i
                    h = hk * cfg.group + i // n_iter
                    start_m = (m_lo + i % n_iter) * cfg.BLOCK_M
                    buf, phase = _gl_ring(tile, 2)
                    for wg in gl.static_range(2):
                        col = wg * cfg.DQ_COLS if cfg.DQ_COLS < cfg.HEAD_DIM else 0
                        mbarrier.wait(smem.dq_full.index(2 * buf + wg), phase)
                        _tma_reduce_add(glob.dq, [q_start + start_m, h, col] if cfg.VARLEN
                                        else [b, h, start_m, col], smem.dq.index(2 * buf + wg))
                        if cfg.TAIL > 0:
                            _tma_reduce_add(glob.dqt, [q_start + start_m, h, cfg.HEAD_DIM]
                                            if cfg.VARLEN else [b, h, start_m, cfg.HEAD_DIM],
                                            smem.dqt.index(2 * buf + wg))
                    if tile > 0:
                        # the previous tile's reduces have read their buffers
                        tma.store_wait(4 if cfg.TAIL > 0 else 2)
                        mbarrier.arrive(smem.dq_empty.index(2 * (1 - buf)), count=1)
                        mbarrier.arrive(smem.dq_empty.index(2 * (1 - buf) + 1), count=1)
                t += cfg.group * n_iter
            n_seen += 1
            item = sched.read(n_seen) if sched.DYNAMIC else cfg.n_items
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=_GL_COUNTS + ["n_tiles"])
    def _gl_attn_bwd(q_desc, k_desc, v_desc, do_desc, dq_desc, qt_desc, kt_desc, vt_desc, dot_desc,
                     dqt_desc, dk_desc, dv_desc,
                     DK, DV, LSE, DELTA, cu_seqlens_q, counter,
                     stride_dkb, stride_dkh, stride_dks,
                     stride_dvb, stride_dvh, stride_dvs,
                     stride_lb, stride_lh,
                     seqlen_q, seqlen_k, num_kv_heads, group, head_dim,
                     n_tiles, n_docs, n_items, qk_scale, sm_scale,
                     NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     DYNAMIC: gl.constexpr, DKV_TMA: gl.constexpr):
        """Work items (_BwdConfig.item) as the forward's. dq_desc: the zeroed fp32 dQ buffer."""
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[-1]
        TAIL: gl.constexpr = _gl_tail(q_desc, qt_desc)
        BLOCK_M: gl.constexpr = _gl_rows(q_desc)
        BLOCK_N: gl.constexpr = _gl_rows(k_desc)
        cfg = _BwdConfig(HEAD_DIM=HEAD_DIM, TAIL=TAIL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                         NUM_STAGES=NUM_STAGES, DQ_COLS=dq_desc.block_type.shape[-1],
                         CAUSAL=CAUSAL, VARLEN=_gl_packed(q_desc), DKV_TMA=DKV_TMA,
                         cu_seqlens_q=cu_seqlens_q, qk_scale=qk_scale, sm_scale=sm_scale,
                         seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_kv_heads=num_kv_heads,
                         group=group, head_dim=head_dim, n_tiles=n_tiles, n_docs=n_docs,
                         n_items=n_items)
        live = True
        # one CTA per item: an empty one (packed, past its document) returns before allocating
        if not DYNAMIC:
            _, _, _, _, seqlen_k_b, start_n, _, _ = cfg.item(gl.program_id(0), DYNAMIC)
            live = start_n < seqlen_k_b
        if live:
            q_smem, do_smem = _gl_tiles(q_desc, NUM_STAGES), _gl_tiles(do_desc, NUM_STAGES)
            k_smem, v_smem = _gl_tiles(k_desc, 2), _gl_tiles(v_desc, 2)
            # dS and dQ tiles: (two buffers) x (two warpgroups)
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M],
                                                                          q_desc.dtype)
            ds_smem = gl.allocate_shared_memory(q_desc.dtype, [4, BLOCK_N, BLOCK_M], ds_layout)
            dq_smem = _gl_tiles(dq_desc, 4)
            if TAIL > 0:  # the last TAIL columns (no tail: its descriptors and tiles go unused)
                qt_smem, dot_smem = _gl_tiles(qt_desc, NUM_STAGES), _gl_tiles(dot_desc, NUM_STAGES)
                kt_smem, vt_smem = _gl_tiles(kt_desc, 2), _gl_tiles(vt_desc, 2)
                dqt_smem = _gl_tiles(dqt_desc, 4)
            else:
                qt_smem, dot_smem, kt_smem, vt_smem = q_smem, do_smem, k_smem, v_smem
                dqt_smem = dq_smem
            row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
            lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], row_layout)
            delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], row_layout)
            kv_ready, kv_empty, ds_ready = _gl_bars(2), _gl_bars(1), _gl_bars(2)
            dq_full, dq_empty = _gl_bars(4), _gl_bars(4)
            ready, empty = _gl_bars(NUM_STAGES), _gl_bars(NUM_STAGES)
            sched = _gl_schedule(counter, DYNAMIC)
            # arrivals: kv_empty, both consumers' last matmul of an item; ds_ready, both dS
            # tiles stored; the schedule's slots, read by both consumers and the dQ warp;
            # ready, the TMA bytes' expect and the L/Delta stores; empty, both consumers
            mbarrier.init(kv_empty.index(0), count=2)
            _gl_init_bars(2, (kv_ready, ds_ready, sched.ready, sched.empty), (1, 2, 1, 3))
            _gl_init_bars(4, (dq_full, dq_empty), (1, 1))
            _gl_init_bars(NUM_STAGES, (ready, empty), (2, 2))
            smem = _BwdShared(q=q_smem, do=do_smem, k=k_smem, v=v_smem, ds=ds_smem, dq=dq_smem,
                              qt=qt_smem, dot=dot_smem, kt=kt_smem, vt=vt_smem, dqt=dqt_smem,
                              lse=lse_smem, delta=delta_smem, kv_ready=kv_ready, kv_empty=kv_empty,
                              ready=ready, empty=empty, ds_ready=ds_ready, dq_full=dq_full,
                              dq_empty=dq_empty)
            glob = _BwdGlobal(q=q_desc, k=k_desc, v=v_desc, do=do_desc, dq=dq_desc, qt=qt_desc,
                              kt=kt_desc, vt=vt_desc, dot=dot_desc, dqt=dqt_desc, dk=dk_desc,
                              dv=dv_desc,
                              DK=DK, DV=DV, LSE=LSE, DELTA=DELTA,
                              stride_dkb=stride_dkb, stride_dkh=stride_dkh, stride_dks=stride_dks,
                              stride_dvb=stride_dvb, stride_dvh=stride_dvh, stride_dvs=stride_dvs,
                              stride_lb=stride_lb, stride_lh=stride_lh)
            gl.warp_specialize(
                [(_gl_bwd_consumer, (0, cfg, glob, smem, sched)),
                 (_gl_bwd_consumer, (gl.constexpr(1), cfg, glob, smem, sched)),
                 (_gl_bwd_loader, (cfg, glob, smem, sched)),
                 (_gl_bwd_dq_writer, (cfg, glob, smem, sched))],
                [4, 1, 1], [240, 24, 24])

    def _gluon_head_tiles(d):
        """(main, tail) columns of the Gluon kernels' tiles at head dim d (80 = 64 + 16: 5/8 of
        a 128-wide tile's work); None where they do not apply."""
        if not 32 < d <= 128:
            return None
        if d <= 64:
            return 64, 0
        if d <= 96:
            return 64, 16 if d <= 80 else 32
        return 128, 0

    def _gluon_bwd_dkv_tma(tail, dynamic, seqlen_k, split):
        """Whether the Gluon backward stores full dK/dV tiles by TMA: not with the dQ split on
        the persistent grid, which does not wait for both warpgroups to finish a K tile."""
        if tail or (dynamic and split > 1):
            return False
        return split == 1 or seqlen_k <= GLUON_BWD_DKV_TMA_MAX_SEQLEN

    @functools.cache
    def _smem_layout(block, dtype, swizzle=None):
        """A TMA tile's shared-memory layout, swizzled `swizzle` bytes (default: the widest its
        rows allow)."""
        gl_dtypes = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                     torch.float32: gl.float32}
        gl_dtype = gl_dtypes[dtype]
        if swizzle is not None:
            return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, rank=len(block),
                                        element_bitwidth=gl_dtype.primitive_bitwidth)
        return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)

    def _descriptor(x, rows, varlen, cols, swizzle=None):
        """A TMA descriptor over x, tiles of rows x cols of one head (past its edges: zeros
        read, stores dropped)."""
        block = (rows, 1, cols) if varlen else (1, 1, rows, cols)
        layout = _smem_layout(block, x.dtype, swizzle)
        return TensorDescriptor(x, list(x.shape), list(x.stride()), list(block), layout)

    def _head_descriptors(x, rows, varlen, main, tail, swizzle=None):
        """The descriptors of x's main tiles and of its tail tiles (no tail: the main one)."""
        desc = _descriptor(x, rows, varlen, main, swizzle)
        return desc, _descriptor(x, rows, varlen, tail) if tail else desc

    def _tma_or_padded(x, width):  # x in place where TMA reads it, else a zero-padded copy
        return x if _tma_ready(x) else _unit_stride(x, width).contiguous()

    def _gluon_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        """(O, L) by the Gluon forward on a persistent grid: one CTA per SM takes work items
        from a counter. Keys share the queries' documents: cu_seqlens_k, max_seqlen_k unread."""
        varlen, d = cu_seqlens_q is not None, q.shape[-1]
        main, tail = _gluon_head_tiles(d)
        block_m, block_n, stages, q_bufs = GLUON_FWD_CONFIGS[main + tail]
        batch, heads, kv_heads, seqlen_q, seqlen_k, (lb, lh) = _layout(
            q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_q)
        o, lse = _fwd_outputs(q, cu_seqlens_q)
        if batch * heads * seqlen_q == 0:
            return o.zero_(), lse.fill_(float("-inf"))
        qp, kp, vp = (_tma_or_padded(x, main + tail) for x in (q, k, v))
        # work items: dense, query tiles x batch x heads; packed, slots (_gl_doc_slot) x heads
        if varlen:
            m_tiles, n_bh = q.shape[0] // (2 * block_m) + batch, heads
        else:
            m_tiles, n_bh = triton.cdiv(seqlen_q, 2 * block_m), batch * heads
        n_items, ctas = m_tiles * n_bh, _sm_count(q.device.index)
        dynamic = ctas < n_items
        o_tma = tail == 0 and _tma_ready(o)
        q_desc, qt_desc = _head_descriptors(qp, block_m, varlen, main, tail)
        k_desc, kt_desc = _head_descriptors(kp, block_n, varlen, main, tail)
        v_desc, vt_desc = _head_descriptors(vp, block_n, varlen, main, tail)
        o_desc = _descriptor(o, block_m, varlen, main) if o_tma else q_desc
        counter = lse  # (not read on a CTA per item)
        if dynamic:
            counter = torch.zeros(1, dtype=torch.int32, device=q.device)
        _gl_attn_fwd[(ctas if dynamic else n_items,)](
            q_desc, k_desc, v_desc, qt_desc, kt_desc, vt_desc, o_desc,
            o, lse, cu_seqlens_q if varlen else lse, counter,
            *_strides(varlen, o), lb, lh,
            d, seqlen_q, seqlen_k, heads, heads // kv_heads,
            m_tiles, n_bh, batch, n_items, LOG2E / math.sqrt(d),
            NUM_STAGES=stages, Q_BUFS=q_bufs, CAUSAL=causal,
            HEAD_MAJOR=not (varlen and dynamic), DYNAMIC=dynamic, O_TMA=o_tma,
            num_warps=4, maxnreg=168)
        return o, lse

    def _gluon_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, causal):
        """(dQ, dK, dV) by the Gluon backward: the Triton Delta pre-pass, then one kernel for
        all three (dQ in fp32); cu_seqlens_k and max_seqlen_k unread, as in _gluon_forward."""
        varlen, d = cu_seqlens_q is not None, q.shape[-1]
        main, tail = _gluon_head_tiles(d)
        block_m, block_n, stages, dq_split, persistent, dq_swizzle = \
            GLUON_BWD_CONFIGS[main + tail]
        batch, heads, kv_heads, seqlen_q, seqlen_k, (lb, lh) = _layout(
            q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_q)
        dq, dk, dv = _empty_out(q), _empty_out(k), _empty_out(v)
        if batch * heads * seqlen_q == 0 or seqlen_k == 0:
            return dq.zero_(), dk.zero_(), dv.zero_()
        dop, qp, kp, vp = (_tma_or_padded(x, main + tail) for x in (do, q, k, v))
        o, delta = _unit_stride(o), torch.empty_like(lse)
        # fp32, main + tail wide (rows 16-byte aligned at any head dim), zeroed by the Delta pass
        dq_shape = q.shape[:-1] + (main + tail,)
        dq_acc = torch.empty(dq_shape, dtype=torch.float32, device=q.device)
        cu = cu_seqlens_q if varlen else lse
        _attn_bwd_delta[(batch * heads, triton.cdiv(seqlen_q, 64))](
            o, dop, delta, dq_acc, cu, *_strides(varlen, o, dop, dq_acc), lb, lh,
            seqlen_q, heads, d, main + tail,
            HEAD_DIM=_pow2(main + tail), VARLEN=varlen, BLOCK_M=64)
        # work items: key tiles x batch x K/V heads (persistent and packed: slots x K/V heads)
        scale = 1.0 / math.sqrt(d)
        n_tiles, n_bh = triton.cdiv(seqlen_k, 2 * block_n), batch * kv_heads
        ctas = _sm_count(q.device.index) if persistent else 0
        dynamic = 0 < ctas < n_tiles * n_bh
        if varlen and dynamic:
            n_tiles, n_bh = k.shape[0] // (2 * block_n) + batch, kv_heads
        n_items = n_tiles * n_bh
        dkv_tma = _gluon_bwd_dkv_tma(tail, dynamic, seqlen_k, dq_split)
        dkv_tma = dkv_tma and _tma_ready(dk) and _tma_ready(dv)
        q_desc, qt_desc = _head_descriptors(qp, block_m, varlen, main, tail)
        do_desc, dot_desc = _head_descriptors(dop, block_m, varlen, main, tail)
        k_desc, kt_desc = _head_descriptors(kp, block_n, varlen, main, tail)
        v_desc, vt_desc = _head_descriptors(vp, block_n, varlen, main, tail)
        dq_desc, dqt_desc = _head_descriptors(dq_acc, block_m, varlen, main // dq_split, tail,
                                              dq_swizzle)
        dk_desc, dv_desc = k_desc, v_desc  # (not read without dkv_tma)
        if dkv_tma:
            dk_desc = _descriptor(dk, block_n, varlen, main)
            dv_desc = _descriptor(dv, block_n, varlen, main)
        counter = lse
        if dynamic:
            counter = torch.zeros(1, dtype=torch.int32, device=q.device)
        _gl_attn_bwd[(ctas if dynamic else n_items,)](
            q_desc, k_desc, v_desc, do_desc, dq_desc, qt_desc, kt_desc, vt_desc, dot_desc,
            dqt_desc, dk_desc, dv_desc,
            dk, dv, lse, delta, cu, counter, *_strides(varlen, dk, dv), lb, lh,
            seqlen_q, seqlen_k, kv_heads, heads // kv_heads, d,
            n_tiles, batch, n_items, LOG2E * scale, scale,
            NUM_STAGES=stages, CAUSAL=causal, DYNAMIC=dynamic, DKV_TMA=dkv_tma,
            num_warps=4, maxnreg=168)
        dq.copy_(dq_acc[..., :d])
        return dq, dk, dv


@functools.cache
def _is_sm90(device_index):
    return torch.cuda.get_device_capability(device_index) == (9, 0)


@functools.cache
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# At D=64 the Triton kernels keep up where there is little work per SM: the Gluon kernels take
# a call from these many query tiles of 128 rows per SM (forward, backward)
GLUON_D64_TILES_PER_SM = (15, 31)


def _gluon_d64(seqlen, query_tiles, packed, backward, sms):
    """Whether the Gluon kernels take a D=64 call of `query_tiles` tiles of 128 rows, sequences
    up to `seqlen` long, on `sms` SMs: dense from 1024 (forward) or 2048 tokens with enough
    tiles, always from 4096; packed from the forward's count or 2048 tokens."""
    if packed:
        return seqlen >= 2048 or query_tiles >= GLUON_D64_TILES_PER_SM[0] * sms
    enough = query_tiles >= GLUON_D64_TILES_PER_SM[backward] * sms
    return seqlen >= 4096 or seqlen >= (2048 if backward else 1024) and enough


def _tma_ready(x):  # whether TMA reads x in place: last stride 1, the rest 16-byte aligned
    if x.stride(-1) != 1 or x.data_ptr() % 16 != 0:
        return False
    return all(st * x.element_size() % 16 == 0 for st in x.stride()[:-1])


def _gluon_supported(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, *more, backward=False):
    """Whether the Gluon kernels take the call: sm90 bf16/fp16 with D from 33 to 128 (at D=64
    as _gluon_d64 says), packed keys in the queries' documents, at D 64 and 128 TMA-ready
    tensors (`more`: dO and O)."""
    if gluon is None or INTERPRET or not q.is_cuda:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False
    tiles = _gluon_head_tiles(q.shape[-1])
    if tiles is None or not _is_sm90(q.device.index):
        return False
    if cu_seqlens_k is not None and cu_seqlens_k is not cu_seqlens_q:
        return False
    packed = cu_seqlens_q is not None
    if BACKEND == "auto" and tiles == (64, 0):
        seqlen = max_seqlen_q if packed else q.shape[2]
        # query tiles of 128 rows (packed: at most one more per document than the tokens fill)
        if packed:
            query_tiles = q.shape[1] * (q.shape[0] // 128 + cu_seqlens_q.shape[0] - 1)
        else:
            query_tiles = q.shape[1] * q.shape[0] * triton.cdiv(seqlen, 128)
        if not _gluon_d64(seqlen, query_tiles, packed, backward, _sm_count(q.device.index)):
            return False
    aligned = _pow2(q.shape[-1]) != q.shape[-1] or all(_tma_ready(x) for x in (q, k, v, *more))
    return aligned and (packed or k.shape[2] > 0)


# ----------------------------------------------------------------------
# 4. Attention entry points. One autograd Function serves dense and packed calls: it calls the
#    launchers, or under torch.compile or a dispatch mode two operators with fake kernels.

def _launcher(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, *more):
    """The one choice between the kernel families: the launcher of a forward call, or with
    `more` (dO, O) a backward one. backend 'auto': Gluon wherever it applies; 'gluon': a
    forward it cannot take raises."""
    backward = len(more) > 0
    if backend != "triton" and _gluon_supported(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                max_seqlen_q, *more, backward=backward):
        return _gluon_backward if backward else _gluon_forward
    if backend == "gluon" and not backward:
        raise RuntimeError("flash: FLASH_BACKEND=gluon but the Gluon kernels need an sm90 GPU, "
                           "bf16/fp16, head dim <= 128 and TMA-aligned strides (got "
                           f"{q.dtype}, {tuple(q.shape)}, {q.stride()})")
    return _triton_backward if backward else _triton_forward


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, backend):
    launch = _launcher(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    return launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)


def _backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              causal, backend):
    launch = _launcher(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, do, o)
    return launch(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  causal)


def _fake_forward(q, k, v, cu_seqlens_q, *_):
    return _fwd_outputs(q, cu_seqlens_q)


def _fake_backward(do, q, k, v, *_):
    return _empty_out(q), _empty_out(k), _empty_out(v)


# torch.library.Library, not custom_op, whose checks add host time to every call
_LIB = torch.library.Library("flash", "FRAGMENT")
_LIB.define("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, "
            "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal, "
            "str backend) -> (Tensor, Tensor)")
_LIB.define("attention_bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
            "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
            "SymInt max_seqlen_k, bool causal, str backend) -> (Tensor, Tensor, Tensor)")
_LIB.impl("attention_fwd", _forward, "CompositeExplicitAutograd")
_LIB.impl("attention_bwd", _backward, "CompositeExplicitAutograd")
_attention_fwd_op = torch.ops.flash.attention_fwd.default
_attention_bwd_op = torch.ops.flash.attention_bwd.default
torch.library.register_fake("flash::attention_fwd", _fake_forward, lib=_LIB)
torch.library.register_fake("flash::attention_bwd", _fake_backward, lib=_LIB)


def _through_ops():
    """Whether to call the kernels through the operators (compiling, or a dispatch mode,
    which sees only operators)."""
    return torch.compiler.is_compiling() or _current_dispatch_mode() is not None


class _FlashAttention(torch.autograd.Function):
    """(O, L) with gradients for q, k, v (L has none); packed when cu_seqlens_q is given."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)
        if _through_ops():
            o, lse = _attention_fwd_op(*args, BACKEND)
        else:
            launch = _launcher(BACKEND, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
            o, lse = launch(*args)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros made for L's gradient (it has none)
        # the backward follows the forward's backend
        ctx.args = (max_seqlen_q, max_seqlen_k, causal, BACKEND)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        if do is None:  # O took no part in what is differentiated
            return (None,) * 8
        q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        max_seqlen_q, max_seqlen_k, causal, backend = ctx.args
        args = (do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                causal)
        if _through_ops():
            grads = _attention_bwd_op(*args, backend)
        else:
            launch = _launcher(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, do, o)
            grads = launch(*args)
        return tuple(grads) + (None,) * 5


def _check_qkv(q, k, v, ndim):
    if q.dim() != ndim or k.dim() != ndim or v.dim() != ndim:
        shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        raise ValueError(f"flash: q, k, v must be {ndim}-D, got {shapes}")
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in dtypes:
        raise ValueError("flash: q, k, v need one dtype among fp16/bf16/fp32, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash: q, k, v on different devices: {q.device}, {k.device}, "
                         f"{v.device}")
    if k.shape != v.shape or k.shape[-1] != q.shape[-1]:
        raise ValueError("flash: k and v must share a shape with q's head dim, got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] > 256:
        raise ValueError(f"flash: head dim {q.shape[-1]} > 256 is not supported")


def _packing(q, k, v, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None, max_seqlen_k=None):
    """One-line errors for a call the kernels cannot take; else _FlashAttention's
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    _check_qkv(q, k, v, 4 if cu_seqlens is None else 3)
    batch_differs = cu_seqlens is None and q.shape[0] != k.shape[0]
    if batch_differs or q.shape[1] % k.shape[1] != 0:  # dim 1: heads either way
        raise ValueError("flash: batch must match and H_kv divide H: "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if cu_seqlens is None:
        return None, None, 0, 0
    if cu_seqlens_k is None:  # passed on as None: the Function may not take a tensor twice
        max_seqlen_k = max_seqlen
    elif max_seqlen_k is None:
        raise ValueError("flash: cu_seqlens_k needs max_seqlen_k")
    wanted = (torch.int32, 1, cu_seqlens.shape, q.device)
    for name, cu in (("cu_seqlens", cu_seqlens), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is not None and (cu.dtype, cu.dim(), cu.shape, cu.device) != wanted:
            raise ValueError(f"flash: {name} must be a 1-D int32 tensor on {q.device}, as long "
                             f"as cu_seqlens, got {cu.dtype} {tuple(cu.shape)} on {cu.device}")
    return cu_seqlens, cu_seqlens_k, int(max_seqlen), int(max_seqlen_k)


def attention_with_lse(q, k, v, causal=True, cu_seqlens=None, max_seqlen=None,
                       cu_seqlens_k=None, max_seqlen_k=None):
    """flash_attention, or with cu_seqlens flash_attn_varlen, also returning the logsumexp L
    ((B, H, S) or (H, total), fp32, not differentiable)."""
    packing = _packing(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k)
    return _FlashAttention.apply(q, k, v, *packing, causal)


def flash_attention(q, k, v, causal=True):
    """q (B, H, S, D), k/v (B, H_kv, S_k, D) with H % H_kv == 0, any strides -> O (B, H, S, D);
    differentiable."""
    return _FlashAttention.apply(q, k, v, *_packing(q, k, v), causal)[0]


def flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen, causal=True, cu_seqlens_k=None,
                      max_seqlen_k=None):
    """Packed documents: q (total_q, H, D), k/v (total_k, H_kv, D), int32 cu_seqlens
    (num_seqs + 1) -> O like q. max_seqlen: a Python int >= the longest document (unchecked:
    no host sync)."""
    packing = _packing(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k)
    return _FlashAttention.apply(q, k, v, *packing, causal)[0]


def _heads_folded(x):  # (..., seq, d) -> (batch x heads, 1, seq, d)
    return x.reshape(-1, 1, *x.shape[-2:])


class FlashAttentionTriton(torch.autograd.Function):
    """The Triton kernels on (..., seq, d), heads folded into the leading dims; saves L."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        _check_qkv(*(x.reshape(-1, *x.shape[-2:]) for x in (q, k, v)), 3)
        qkv = (_heads_folded(x) for x in (q, k, v))
        o, lse = _triton_forward(*qkv, None, None, 0, 0, causal)
        o, lse = o.reshape(q.shape), lse.reshape(q.shape[:-1])
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        tensors = (_heads_folded(x) for x in (do, q, k, v, o))
        lse = lse.reshape(-1, 1, q.shape[-2])
        grads = _triton_backward(*tensors, lse, None, None, 0, 0, ctx.causal)
        return (*(g.reshape(x.shape) for g, x in zip(grads, (q, k, v))), None)


# ----------------------------------------------------------------------
# 5. AdamW's fused step (train.AdamW states the formulas): one launch steps a bucket's
#    parameters chunk by chunk through a table of offsets built once; the gradients' offsets,
#    an array of their own, are re-sent only when they move.

ADAMW_BLOCK = 2048


@triton.jit
def _adamw_chunk(P, G, M, V, p_off, g_off, m_off, v_off, n, neg_step, beta1, beta2, eps, decay,
                 BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n if MASKED else None
    p = tl.load(P + p_off + offs, mask=ok).to(tl.float32)
    g = tl.load(G + g_off + offs, mask=ok).to(tl.float32)
    m = tl.load(M + m_off + offs, mask=ok)
    v = tl.load(V + v_off + offs, mask=ok)
    m = beta1 * m + (1.0 - beta1) * g  # m <- b1 m + (1 - b1) g
    v = beta2 * v + (1.0 - beta2) * g * g  # v <- b2 v + (1 - b2) g^2
    # p <- p - a_t m / (sqrt(v) + eps), then p <- p (1 - a l)
    p = (p + neg_step * m / (tl.sqrt(v) + eps)) * decay
    tl.store(P + p_off + offs, p.to(P.dtype.element_ty), mask=ok)
    tl.store(M + m_off + offs, m, mask=ok)
    tl.store(V + v_off + offs, v, mask=ok)


@triton.jit
def _adamw_kernel(P, G, M, V, table, g_offsets, n_chunks,
                  neg_step, beta1, beta2, eps, decay, SCALARS,
                  BLOCK: tl.constexpr, UNIT: tl.constexpr, G_UNIT: tl.constexpr,
                  DEVICE_SCALARS: tl.constexpr):
    c = tl.program_id(0)
    if DEVICE_SCALARS:  # written by the host before the launch: the launch can be a graph's
        neg_step = tl.load(SCALARS)
        decay = tl.load(SCALARS + 1)
    start = tl.load(table + 4 * n_chunks + c) * BLOCK  # the chunk's first element in its tensor
    p_off = tl.load(table + c) * UNIT + start
    m_off = tl.load(table + n_chunks + c) * UNIT + start
    v_off = tl.load(table + 2 * n_chunks + c) * UNIT + start
    g_off = tl.load(g_offsets + tl.load(table + 3 * n_chunks + c)) * G_UNIT + start
    n = tl.load(table + 5 * n_chunks + c)
    if n == BLOCK:  # a full chunk: no mask, so every load and store moves 16 bytes a thread
        _adamw_chunk(P, G, M, V, p_off, g_off, m_off, v_off, n, neg_step, beta1, beta2, eps,
                     decay, BLOCK, False)
    else:  # a tensor's last chunk
        _adamw_chunk(P, G, M, V, p_off, g_off, m_off, v_off, n, neg_step, beta1, beta2, eps,
                     decay, BLOCK, True)


def _offsets(tensors):
    """(base tensor, every tensor's offset from it in units, unit): base at the lowest address."""
    ptrs = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    base = int(np.argmin(ptrs))
    offsets = (ptrs - ptrs[base]) // tensors[0].element_size()
    unit = 16 if (offsets % 16 == 0).all() else 1
    return tensors[base], offsets // unit, unit


def _chunk_table(columns, block):
    """[params, exp_avgs, exp_avg_sqs] -> (bases, int64 table (6, n_chunks), unit); its rows:
    p/m/v offsets in units, tensor index, chunk index in the tensor, length."""
    numels = np.array([t.numel() for t in columns[0]], dtype=np.int64)
    n_chunks = -(-numels // block)
    chunk = np.concatenate([np.arange(n, dtype=np.int64) for n in n_chunks])
    tensor = np.repeat(np.arange(len(numels), dtype=np.int64), n_chunks)
    bases, offsets, units = zip(*(_offsets(col) for col in columns))
    unit = min(units)
    table = [np.repeat(o * u // unit, n_chunks) for o, u in zip(offsets, units)]
    table += [tensor, chunk, np.minimum(block, numels[tensor] - chunk * block)]
    return list(bases), torch.from_numpy(np.stack(table)), unit


def adamw_step(cache, params, grads, exp_avgs, exp_avg_sqs, neg_step, beta1, beta2, eps, decay,
               scalars=None):
    """p <- (p + neg_step m / (sqrt(v) + eps)) * decay over lists of contiguous tensors (m, v
    fp32). `cache`: a dict kept per bucket; scalars: (neg_step, decay) on the device, or None."""
    live = [i for i, p in enumerate(params) if p.numel()]
    if not live:
        return
    columns = (params, grads, exp_avgs, exp_avg_sqs)
    params, grads, exp_avgs, exp_avg_sqs = ([col[i] for i in live] for col in columns)
    device = params[0].device
    key = tuple(t.data_ptr() for col in (params, exp_avgs, exp_avg_sqs) for t in col)
    key += tuple(t.numel() for t in params)
    if cache.get("key") != key:  # built again only if a parameter or its state moved
        bases, table, unit = _chunk_table([params, exp_avgs, exp_avg_sqs], ADAMW_BLOCK)
        cache.clear()
        cache.update(key=key, bases=bases, table=table.to(device), unit=unit, g_key=None)
    g_key = tuple(g.data_ptr() for g in grads)
    if cache["g_key"] != g_key:  # new gradient addresses: sent without waiting for the GPU
        g_base, g_offsets, g_unit = _offsets(grads)
        # kept: a CUDA graph that captured the copy reads it at every replay
        host = torch.from_numpy(g_offsets)
        host = host.pin_memory() if device.type == "cuda" else host
        g_index = next(i for i, g in enumerate(grads) if g is g_base)
        cache.update(g_key=g_key, g_index=g_index, g_host=host,
                     g_offsets=host.to(device, non_blocking=True), g_unit=g_unit)
    # this step's tensor at the base address (a CUDA graph hands out new ones)
    g_base = grads[cache["g_index"]]
    p, m, v = cache["bases"]
    n_chunks = cache["table"].shape[1]
    if scalars is not None:
        ok = (scalars.device, scalars.dtype, scalars.numel()) == (device, torch.float32, 2)
        if not ok:
            raise ValueError(f"adamw_step: scalars must be 2 fp32 values on {device}, got "
                             f"{scalars.numel()} {scalars.dtype} on {scalars.device}")
    _adamw_kernel[(n_chunks,)](p, g_base, m, v, cache["table"], cache["g_offsets"], n_chunks,
                               neg_step, beta1, beta2, eps, decay,
                               cache["table"] if scalars is None else scalars,
                               BLOCK=ADAMW_BLOCK, UNIT=cache["unit"], G_UNIT=cache["g_unit"],
                               DEVICE_SCALARS=scalars is not None, num_warps=8)


# ----------------------------------------------------------------------
# 6. Cross-entropy over rows of logits, the gradient in place. Row x with target t:
#    loss = logsumexp(x) - x[t] in fp32, then x <- scale * (softmax(x) - onehot(t)), scale
#    read from a one-element tensor (the host never waits for the count of targets).

@triton.jit
def _cross_entropy_rows_kernel(LOGITS, TARGETS, LOSS, SCALE, stride_row, n_cols, ignore_index,
                               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_row
    target = tl.load(TARGETS + row)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):  # per lane running max and sum, merged at the end
        x = tl.load(ptr + start + offs, mask=start + offs < n_cols, other=float("-inf"))
        x = x.to(tl.float32)
        m_new = tl.maximum(m, x)
        # a lane that saw only padding keeps s = 0
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    m_row = tl.max(m, 0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), 0))
    valid = target != ignore_index
    safe = tl.where(valid, target, 0)
    x_t = tl.load(ptr + safe).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
    scale = tl.where(valid, tl.load(SCALE), 0.0)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        x = tl.load(ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) * scale - tl.where(cols == safe, scale, 0.0)
        tl.store(ptr + cols, g.to(LOGITS.dtype.element_ty), mask=cols < n_cols)


def cross_entropy_rows_reference(logits, targets, ignore_index, scale):
    """(loss per row, gradient) in fp32 (fp64 for fp64 logits): the kernel's PyTorch twin."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    lse = torch.logsumexp(x, dim=-1)
    loss = torch.where(valid, lse - x.gather(-1, safe[:, None])[:, 0], 0.0)
    onehot = torch.nn.functional.one_hot(safe, x.shape[-1]).to(x.dtype)
    row_scale = torch.where(valid, scale.to(x.dtype), 0.0)
    grad = (torch.exp(x - lse[:, None]) - onehot) * row_scale[:, None]
    return loss, grad


# what torch.compile sees: opaque, mutating its two outputs
@torch.library.custom_op("flash::cross_entropy_rows", mutates_args=("logits", "loss"))
def _cross_entropy_rows_op(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                           scale: torch.Tensor, loss: torch.Tensor) -> None:
    cross_entropy_rows(logits, targets, ignore_index, scale, loss)


def cross_entropy_rows(logits, targets, ignore_index, scale, loss, kernel=None):
    """Loss per row into `loss` (fp32), the gradient into 2-D `logits` itself; `scale`: one
    fp32 element. The kernel on CUDA (or with kernel=True), else the PyTorch twin."""
    if kernel is None:
        if torch.compiler.is_compiling():
            return _cross_entropy_rows_op(logits, targets, ignore_index, scale, loss)
        kernel = logits.is_cuda
    if not kernel:
        reference = cross_entropy_rows_reference(logits, targets, ignore_index, scale)
        for out, value in zip((loss, logits), reference):
            out.copy_(value)
        return
    assert logits.stride(-1) == 1
    assert targets.is_contiguous()
    assert loss.is_contiguous()
    _cross_entropy_rows_kernel[(logits.shape[0],)](
        logits, targets, loss, scale, logits.stride(0), logits.shape[1], ignore_index,
        BLOCK=64 if INTERPRET else 2048, num_warps=8)


# ----------------------------------------------------------------------
# 7. RMSNorm over the last dim in fp32: r = 1 / sqrt(mean(x^2) + eps), y = (x r) g; with
#    x_hat = x r and gy = g dy, dx = r (gy - x_hat mean(x_hat gy)), dg = sum_rows dy x_hat.
#    Whole rows in registers; the backward's programs stride over row blocks, each adding
#    into its row of a buffer that a torch sum turns into dg. add_rms_norm adds a residual.

RMS_MAX_D = 8192  # the backward spills past it (rows live in registers): wider rows are refused


def _rms_config(d, backward=False):
    """(BLOCK_M, BLOCK_D, num_warps): tiles of 4096 elements forward, 2048 backward, 16 a
    thread; 128 rows in the interpreter."""
    block_d = triton.next_power_of_2(d)
    if INTERPRET:
        return 128, block_d, 4
    block_m = max(1, (2048 if backward else 4096) // block_d)
    return block_m, block_d, max(4, block_m * block_d // 512)


@triton.jit
def _rms_norm_fwd_kernel(X, R, H, W, Y, RSTD, n_rows, d, stride_x, stride_r, eps,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HAS_R: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < d)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_R:  # h = x + r, stored (in H's dtype) and normalized as it was stored
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
        x += r.to(tl.float32)
        x = x.to(H.dtype.element_ty)
        tl.store(H + rows[:, None] * d + cols[None, :], x, mask=ok)
        x = x.to(tl.float32)
    w = tl.load(W + cols, mask=cols < d, other=0.0).to(tl.float32)
    # padding lanes are 0: the sum is over the row's d elements
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / d + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + rows[:, None] * d + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rms_bwd_rows(X, DY, DH, rows, cols, n_rows, d, stride_x, stride_dy, stride_dh,
                  HAS_DH: tl.constexpr):
    """A block's x, dy and (HAS_DH) dh as loaded (0 past the ends); dh 0.0 without HAS_DH."""
    ok = (rows[:, None] < n_rows) & (cols[None, :] < d)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0)
    dh = 0.0
    if HAS_DH:  # the gradient reaching the norm's input from elsewhere (add_rms_norm's h)
        dh = tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=ok, other=0.0)
    return x, dy, dh


@triton.jit
def _rms_norm_bwd_kernel(X, W, DY, RSTD, DH, DX, DW_PARTIAL, n_rows, d,
                         stride_x, stride_dy, stride_dh, n_blocks,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                         HAS_DH: tl.constexpr, PREFETCH: tl.constexpr):
    # Each program strides over the row blocks. PREFETCH: it loads its next block before it
    # works on this one, so a load is always in flight (twice the registers: d <= 4096 only).
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    w = tl.load(W + cols, mask=cols < d, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # summed over its rows once, at the end
    if PREFETCH:
        # int64: rows * stride may pass 2^31
        rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        x_next, dy_next, dh_next = _rms_bwd_rows(X, DY, DH, rows, cols, n_rows, d, stride_x,
                                                 stride_dy, stride_dh, HAS_DH)
    for blk in range(pid, n_blocks, step):
        rows = (blk * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        if PREFETCH:
            x, dy, dh = x_next, dy_next, dh_next
            x_next, dy_next, dh_next = _rms_bwd_rows(X, DY, DH, rows + step * BLOCK_M, cols,
                                                     n_rows, d, stride_x, stride_dy,
                                                     stride_dh, HAS_DH)
        else:  # (dh loads where it is added: not live across the row sums)
            x, dy, _ = _rms_bwd_rows(X, DY, DH, rows, cols, n_rows, d, stride_x, stride_dy,
                                     stride_dh, False)
        x, dy = x.to(tl.float32), dy.to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
        x_hat = x * rstd[:, None]
        gy = dy * w[None, :]
        c = tl.sum(x_hat * gy, axis=1) / d  # mean(x_hat g dy) per row
        dx = (gy - x_hat * c[:, None]) * rstd[:, None]
        ok = (rows[:, None] < n_rows) & (cols[None, :] < d)
        if HAS_DH:
            if not PREFETCH:
                dh = tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=ok, other=0.0)
            dx += dh.to(tl.float32)
        tl.store(DX + rows[:, None] * d + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)
        dw += dy * x_hat  # rows past the end have x_hat = 0
    tl.store(DW_PARTIAL + pid * d + cols, tl.sum(dw, axis=0), mask=cols < d)


def _rms_norm_forward(x, weight, eps, r=None, y_dtype=None):
    """(y in y_dtype (default h's), rstd fp32, h = x + r in their promoted dtype; no r: x)."""
    d = x.shape[-1]
    x2, weight = _unit_stride(x.reshape(-1, d)), weight.contiguous()
    r2 = None if r is None else _unit_stride(r.reshape(-1, d))
    h = x
    if r is not None:
        h_dtype = torch.promote_types(x.dtype, r.dtype)
        h = torch.empty(x.shape, dtype=h_dtype, device=x.device)
    y = torch.empty(x.shape, dtype=y_dtype or h.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    n = x2.shape[0]
    if n:
        block_m, block_d, warps = _rms_config(d)
        _rms_norm_fwd_kernel[(triton.cdiv(n, block_m),)](
            x2, x2 if r2 is None else r2, h, weight, y, rstd, n, d, x2.stride(0),
            0 if r2 is None else r2.stride(0), eps,
            BLOCK_M=block_m, BLOCK_D=block_d, HAS_R=r2 is not None, num_warps=warps)
    return y, rstd, h


def _rms_norm_backward(dy, x, weight, rstd, dh=None):
    """(dx like x, dweight like weight); dh (x's gradient from elsewhere) joins dx."""
    d = x.shape[-1]
    x2, dy2 = _unit_stride(x.reshape(-1, d)), _unit_stride(dy.reshape(-1, d))
    w = weight.contiguous()
    dh2 = None if dh is None else _unit_stride(dh.reshape(-1, d))
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x2.shape[0]
    if not n:
        return dx, torch.zeros_like(weight)
    block_m, block_d, warps = _rms_config(d, backward=True)
    n_blocks = triton.cdiv(n, block_m)
    # programs: 2 or 4 per SM on CUDA; 2 in the interpreter (a program steps over blocks)
    programs = 2
    if x.is_cuda:
        programs = _sm_count(x.device.index) * (2 if block_d >= 2048 else 4)
    programs = max(1, min(n_blocks, programs))
    # every program writes its row
    partial = torch.empty(programs, d, dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](
        x2, w, dy2, rstd, dy2 if dh2 is None else dh2, dx, partial, n, d,
        x2.stride(0), dy2.stride(0), 0 if dh2 is None else dh2.stride(0), n_blocks,
        BLOCK_M=block_m, BLOCK_D=block_d, HAS_DH=dh2 is not None,
        PREFETCH=block_d <= 4096, num_warps=warps)
    return dx, partial.sum(0).to(weight.dtype)


@torch.library.custom_op("flash::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     r: Optional[torch.Tensor] = None, y_dtype: Optional[torch.dtype] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, rstd, h = _rms_norm_forward(x, weight, eps, r, y_dtype)
    # (no residual: h is x, which an output may not alias)
    return y, rstd, x.new_empty(0) if r is None else h


@_rms_norm_fwd_op.register_fake
def _(x, weight, eps, r=None, y_dtype=None):
    h_dtype = x.dtype if r is None else torch.promote_types(x.dtype, r.dtype)
    h = torch.empty_like(x, dtype=h_dtype, memory_format=torch.contiguous_format)
    y = torch.empty_like(h, dtype=y_dtype or h.dtype)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return y, rstd, x.new_empty(0) if r is None else h


@torch.library.custom_op("flash::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     rstd: torch.Tensor, dh: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm_backward(dy, x, weight, rstd, dh)


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd, dh=None):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return dx, torch.empty_like(weight)


class _AddRMSNorm(torch.autograd.Function):
    """(h, y) = (x + r, rms_norm(x + r) * weight); r None: h is x itself, returned so that its
    gradient joins the norm's in one backward kernel. Saves h, weight, rstd."""

    @staticmethod
    def forward(ctx, x, r, weight, eps, y_dtype):
        fwd = _rms_norm_fwd_op if torch.compiler.is_compiling() else _rms_norm_forward
        y, rstd, h = fwd(x, weight, eps, r, y_dtype)
        h = x if r is None else h
        ctx.save_for_backward(h, weight, rstd)
        ctx.r_dtype = None if r is None else r.dtype
        # an unused output's gradient comes as None, not zeros the kernel would read
        ctx.set_materialize_grads(False)
        return h, y

    @staticmethod
    def backward(ctx, dh, dy):
        h, weight, rstd = ctx.saved_tensors
        if dy is None:  # only h was used
            if dh is None:
                return None, None, None, None, None
            dy = torch.zeros(h.shape, dtype=h.dtype, device=h.device)
        bwd = _rms_norm_bwd_op if torch.compiler.is_compiling() else _rms_norm_backward
        dx, dw = bwd(dy, h, weight, rstd, dh)
        dr = None if ctx.r_dtype is None else dx.to(ctx.r_dtype)
        return dx, dr, dw, None, None


RMS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_rms(who, x, weight, r=None, y_dtype=None):
    """One-line errors for what the RMSNorm kernels cannot take."""
    named = [("x", x), ("weight", weight)] + ([("residual", r)] if r is not None else [])
    for name, t in named:
        if not torch.is_tensor(t) or t.dtype not in RMS_DTYPES or t.device != x.device:
            got = f"{t.dtype} on {t.device}" if torch.is_tensor(t) else type(t).__name__
            raise ValueError(f"flash.{who}: {name} must be an fp16, bf16 or fp32 tensor on "
                             f"x's device, got {got}")
    if y_dtype is not None and y_dtype not in RMS_DTYPES:
        raise ValueError(f"flash.{who}: out_dtype must be fp16, bf16 or fp32, got {y_dtype}")
    if x.dim() < 1 or weight.shape != x.shape[-1:]:
        width = x.shape[-1] if x.dim() else "d"
        raise ValueError(f"flash.{who}: weight must have shape ({width},) to match "
                         f"x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if r is not None and r.shape != x.shape:
        raise ValueError(f"flash.{who}: residual {tuple(r.shape)} must have x's shape "
                         f"{tuple(x.shape)}")
    if x.shape[-1] > RMS_MAX_D:
        raise ValueError(f"flash.{who}: last dim {x.shape[-1]} > {RMS_MAX_D} is not supported")
    _require_triton_device(x, f"flash.{who}")


def rms_norm(x, weight, eps=1e-5):
    """x (..., d), weight (d,) -> x / sqrt(mean(x^2, -1) + eps) * weight in x's dtype (fp32
    inside); d <= RMS_MAX_D."""
    _check_rms("rms_norm", x, weight)
    return _AddRMSNorm.apply(x, None, weight, float(eps), None)[1]


def add_rms_norm(x, residual, weight, eps=1e-5, out_dtype=None):
    """(h, y): h = x + residual (promoted dtype; None: h is x), y = rms_norm(h, weight, eps) in
    out_dtype (default h's). One kernel each way, both outputs differentiable."""
    _check_rms("add_rms_norm", x, weight, residual, out_dtype)
    return _AddRMSNorm.apply(x, residual, weight, float(eps), out_dtype)
