"""FlashAttention-2 (SPEC §5): a tiled pure-PyTorch twin, Triton forward and backward kernels, packed
variable-length attention, and plain PyTorch references the kernels are held to.

    flash_attention(q, k, v, causal=True)          q (B, H, S, D), k/v (B, H_kv, S_k, D), any strides -> (B, H, S, D)
    flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen, causal=True)   packed (total_tokens, H, D) -> same
    FlashAttentionPyTorch.apply(q, k, v, is_causal)                   (batch, seq, d): the readable twin
    FlashAttentionTriton.apply(q, k, v, is_causal)                    (batch, seq, d): the kernels

Under torch.compile both public functions call torch.library custom ops with a registered autograd formula and fake
(meta) kernel, so a model that calls them compiles without graph breaks; eager calls take a lighter
autograd.Function. Causal masking is top-left aligned
(query i sees keys j <= i, SPEC §5.2), the same convention as SDPA's is_causal.
On a machine without CUDA the Triton kernels run only under the interpreter, so importing this file there sets
TRITON_INTERPRET=1 (unless it is already set) before importing triton; it is slow, so keep shapes tiny there.
"""
import functools
import inspect
import math
import os

import torch

if not torch.cuda.is_available():  # no GPU: run the kernels in Triton's interpreter (slow; must be set
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
AUTOTUNE = os.environ.get("FLASH_AUTOTUNE", "1") != "0"  # 0: take each class's first (measured best) config, no
# benchmarking: a faster cold start, e.g. for the GPU test run, where every new shape class would be tuned
TMA = os.environ.get("FLASH_TMA", "0") == "1"  # 1: tile loads and stores through TMA descriptors built on the device
# (Hopper and later GPUs, and the interpreter). Off by default: on the H200 with Triton 3.6 the forward ran 0-31%
# slower than with pointer loads, forward+backward up to 15% slower (2% faster at S=16384; BENCHMARKS.md, call 16)
LOG2E = 1.4426950408889634  # scores are kept in base 2 so the kernels use exp2 (SPEC §5.6, "later"); the
# kernels spell log2(e) and ln(2) as literals because Triton reads only constexpr globals


# ---------------------------------------------------------------------------------------------------------------
# PyTorch references
# ---------------------------------------------------------------------------------------------------------------

def attention_reference(q, k, v, causal=False):
    """Naive attention on (..., H, S, D) with k/v (..., H_kv, S_k, D): returns (O, L), L = logsumexp of the scores
    (SPEC §5.2). Materializes the (S, S_k) scores: for tests and as the naive baseline only."""
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
    """Packed (total_tokens, H, D) attention, one document at a time (SPEC §5.7 block-diagonal rule): returns
    (O, L) with L of shape (H, total_tokens), the flash-attn varlen layout."""
    cu_q = cu_seqlens.tolist()
    cu_k = cu_q if cu_seqlens_k is None else cu_seqlens_k.tolist()
    o = q.new_zeros(q.shape)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"))
    for i in range(len(cu_q) - 1):
        (a, b), (c, d) = cu_q[i:i + 2], cu_k[i:i + 2]
        if b == a or d == c:
            continue
        o_i, lse_i = attention_reference(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1), causal)
        o[a:b] = o_i.transpose(0, 1)
        lse[:, a:b] = lse_i
    return o, lse


# ---------------------------------------------------------------------------------------------------------------
# The readable twin: tiled online softmax in plain PyTorch (SPEC §5.3, §5.4)
# ---------------------------------------------------------------------------------------------------------------

TWIN_TILE = 64


def _twin_forward(q, k, v, is_causal, tile=TWIN_TILE):
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    n_q, n_k, scale = q.shape[-2], k.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
    for i0 in range(0, n_q, tile):
        q_i = q[..., i0:i0 + tile, :].to(acc_dtype)
        rows = torch.arange(i0, i0 + q_i.shape[-2], device=q.device)
        m_i = torch.full(q_i.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(q_i.shape[:-1] + (v.shape[-1],), dtype=acc_dtype, device=q.device)
        n_end = min(n_k, i0 + q_i.shape[-2]) if is_causal else n_k  # fully masked key tiles never visited (§5.5)
        for j0 in range(0, n_end, tile):
            k_j, v_j = k[..., j0:j0 + tile, :].to(acc_dtype), v[..., j0:j0 + tile, :].to(acc_dtype)
            s = (q_i @ k_j.transpose(-1, -2)) * scale
            if is_causal and j0 + k_j.shape[-2] - 1 > i0:  # diagonal tile: the one place with a compare
                cols = torch.arange(j0, j0 + k_j.shape[-2], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], -1e6)  # finite, SPEC §5.3 Δ
            m_new = torch.maximum(m_i, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m_i - m_new)
            l_i = alpha * l_i + p.sum(-1)
            acc = alpha[..., None] * acc + p @ v_j
            m_i = m_new
        o[..., i0:i0 + tile, :] = (acc / l_i[..., None]).to(q.dtype)
        lse[..., i0:i0 + tile] = m_i + torch.log(l_i)
    return o, lse


def _twin_backward(q, k, v, o, lse, do, is_causal, tile=TWIN_TILE):
    acc_dtype = lse.dtype
    n_q, n_k, scale = q.shape[-2], k.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    delta = (do.to(acc_dtype) * o.to(acc_dtype)).sum(-1)  # D = rowsum(dO ∘ O), SPEC §5.2
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
    for j0 in range(0, n_k, tile):
        k_j, v_j = k[..., j0:j0 + tile, :].to(acc_dtype), v[..., j0:j0 + tile, :].to(acc_dtype)
        cols = torch.arange(j0, j0 + k_j.shape[-2], device=q.device)
        for i0 in range(j0 if is_causal else 0, n_q, tile):  # causal: start at the diagonal
            sl = slice(i0, i0 + tile)
            q_i, do_i = q[..., sl, :].to(acc_dtype), do[..., sl, :].to(acc_dtype)
            rows = torch.arange(i0, i0 + q_i.shape[-2], device=q.device)
            p = torch.exp((q_i @ k_j.transpose(-1, -2)) * scale - lse[..., sl, None])
            if is_causal:
                p = p.masked_fill(cols[None, :] > rows[:, None], 0.0)
            dv[..., j0:j0 + tile, :] += p.transpose(-1, -2) @ do_i
            ds = p * (do_i @ v_j.transpose(-1, -2) - delta[..., sl, None])
            dq[..., sl, :] += (ds @ k_j) * scale
            dk[..., j0:j0 + tile, :] += (ds.transpose(-1, -2) @ q_i) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttentionPyTorch(torch.autograd.Function):
    """Tiled FlashAttention-2 in plain PyTorch on (..., seq, d); saves L of shape (..., seq_q)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        o, lse = _twin_forward(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*_twin_backward(q, k, v, o, lse, do, ctx.is_causal), None)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels. One layout serves dense and packed inputs: a tensor is addressed as
#   base + batch * stride_b + head * stride_h + (seq_start + row) * stride_s + dim
# dense (B, H, S, D): seq_start 0; packed (total, H, D): stride_b 0, seq_start = cu_seqlens[batch] (SPEC §5.7).
# L and Delta are fp32, (B, H, S) dense and (H, total) packed.
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _rows(base, seqlen, stride, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, TMA: tl.constexpr):
    """The rows [0, seqlen) of one head of one sequence, read and written BLOCK rows at a time: a TMA descriptor
    (Hopper's tensor memory accelerator; rows past seqlen load as zeros and are never stored) or, without TMA, a
    BLOCK x HEAD_DIM tile of pointers at row 0 that _load_rows and _store_rows mask the same way."""
    if TMA:
        src = tl.make_tensor_descriptor(base, shape=[tl.maximum(seqlen, 1), HEAD_DIM], strides=[stride, 1],
                                        block_shape=[BLOCK, HEAD_DIM])
    else:
        src = base + tl.arange(0, BLOCK)[:, None] * stride + tl.arange(0, HEAD_DIM)[None, :]
    return src


@triton.jit
def _load_rows(src, start, stride, seqlen, offs, MASKED: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        x = src.load([start, 0])
    elif MASKED:  # rows past the end load as zeros
        x = tl.load(src + start * stride, mask=(start + offs)[:, None] < seqlen, other=0.0)
    else:
        x = tl.load(src + start * stride)
    return x


@triton.jit
def _store_rows(dst, start, stride, seqlen, offs, x, TMA: tl.constexpr):
    if TMA:
        dst.store([start, 0], x.to(dst.dtype))
    else:
        tl.store(dst + start * stride, x.to(dst.dtype.element_ty), mask=(start + offs)[:, None] < seqlen)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, lo, hi, offs_m, offs_n, seqlen_k, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
               TMA: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        k = _load_rows(k_src, start_n, stride_ks, seqlen_k, offs_n, MASKED, TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        if MASKED:  # ragged end and, when causal, the diagonal: the only tiles that compare indices (§5.5)
            cols = start_n + offs_n
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            qk = tl.where(keep, qk, -1.0e6)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_src, start_n, stride_vs, seqlen_k, offs_n, MASKED, TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """First row and length of sequence b's queries and keys: b's slice of the packed rows when VARLEN."""
    q_start = tl.full([], 0, tl.int64)  # 64-bit: start * stride can pass 2^31 in a long packed batch
    k_start = tl.full([], 0, tl.int64)
    if VARLEN:
        q0 = tl.load(cu_seqlens_q + b)
        k0 = tl.load(cu_seqlens_k + b)
        seqlen_q = tl.load(cu_seqlens_q + b + 1) - q0
        seqlen_k = tl.load(cu_seqlens_k + b + 1) - k0
        q_start = q0.to(tl.int64)
        k_start = k0.to(tl.int64)
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "SEQ_BUCKET", "stride_lb", "stride_lh"])
def _attn_fwd(Q, K, V, O, LSE, cu_seqlens_q, cu_seqlens_k,
              stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
              stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
              seqlen_q, seqlen_k, num_heads, group, qk_scale, SEQ_BUCKET,
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
              TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # the diagonal starts on a key-tile boundary
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)  # longest causal tiles launch first
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    q_start, seqlen_q, k_start, seqlen_k = _seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:  # a tile past its sequence's end exits at once
        return
    b64 = b.to(tl.int64)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_m0
    offs_n = tl.arange(0, BLOCK_N)
    kv_h = h // group
    q_src = _rows(Q + b64 * stride_qb + h * stride_qh + q_start * stride_qs, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M,
                  TMA)
    k_src = _rows(K + b64 * stride_kb + kv_h * stride_kh + k_start * stride_ks, seqlen_k, stride_ks, HEAD_DIM,
                  BLOCK_N, TMA)
    v_src = _rows(V + b64 * stride_vb + kv_h * stride_vh + k_start * stride_vs, seqlen_k, stride_vs, HEAD_DIM,
                  BLOCK_N, TMA)
    q = _load_rows(q_src, start_m, stride_qs, seqlen_q, offs_m0, True, TMA)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(seqlen_k, start_m + BLOCK_M)
        full_hi = tl.minimum(start_m, (seqlen_k // BLOCK_N) * BLOCK_N)
    else:
        hi = seqlen_k
        full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, 0, full_hi, offs_m, offs_n,
                               seqlen_k, qk_scale, False, CAUSAL, BLOCK_N, PREC, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, full_hi, hi, offs_m, offs_n,
                               seqlen_k, qk_scale, True, CAUSAL, BLOCK_N, PREC, TMA)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row with no keys (empty key sequence) writes O = 0
    o_dst = _rows(O + b64 * stride_ob + h * stride_oh + q_start * stride_os, seqlen_q, stride_os, HEAD_DIM, BLOCK_M,
                  TMA)
    _store_rows(o_dst, start_m, stride_os, seqlen_q, offs_m0, acc / l_safe[:, None], TMA)
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453  # back to natural log: L = m + log(l)
    tl.store(LSE + b64 * stride_lb + h * stride_lh + q_start + offs_m, lse, mask=offs_m < seqlen_q)


@triton.jit(do_not_specialize=["seqlen_q", "stride_lb", "stride_lh"])
def _attn_bwd_delta(O, DO, DELTA, cu_seqlens_q, stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos,
                    stride_lb, stride_lh, seqlen_q, num_heads,
                    HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_bh = tl.program_id(0)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    q_start, seqlen_q, _, _ = _seq_bounds(cu_seqlens_q, cu_seqlens_q, b, seqlen_q, seqlen_q, VARLEN)
    start_m = tl.program_id(1) * BLOCK_M
    if start_m >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    offs_m0 = tl.arange(0, BLOCK_M)
    o = _load_rows(_rows(O + b64 * stride_ob + h * stride_oh + q_start * stride_os, seqlen_q, stride_os, HEAD_DIM,
                         BLOCK_M, False), start_m, stride_os, seqlen_q, offs_m0, True, False)
    do = _load_rows(_rows(DO + b64 * stride_dob + h * stride_doh + q_start * stride_dos, seqlen_q, stride_dos,
                          HEAD_DIM, BLOCK_M, False), start_m, stride_dos, seqlen_q, offs_m0, True, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # D = rowsum(dO ∘ O), SPEC §5.4 pre-pass
    offs_m = start_m + offs_m0
    tl.store(DELTA + b64 * stride_lb + h * stride_lh + q_start + offs_m, delta, mask=offs_m < seqlen_q)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, lo, hi, offs_m, offs_n, seqlen_k,
              qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
              TMA: tl.constexpr, HEAD_DIM: tl.constexpr):
    # Where V is loaded matters on the H200 (gpu/bwd_probe.py, calls 18-19): beside K is 13% faster at D=128, after
    # P is 15% faster at D=64 (with the 128 x 64 tiles D=64 now takes).
    for start_n in range(lo, hi, BLOCK_N):
        k = _load_rows(k_src, start_n, stride_ks, seqlen_k, offs_n, MASKED, TMA)
        if HEAD_DIM > 64:
            v = _load_rows(v_src, start_n, stride_vs, seqlen_k, offs_n, MASKED, TMA)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse2[:, None])
        if MASKED:
            cols = start_n + offs_n
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            p = tl.where(keep, p, 0.0)
        if HEAD_DIM <= 64:
            v = _load_rows(v_src, start_n, stride_vs, seqlen_k, offs_n, MASKED, TMA)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])  # dS = P ∘ (dP − D), SPEC §5.2
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


# The backward kernels specialize the lengths (divisible by 16 or not, so a few binaries at most): the dQ pass at
# D=64 went from 0.92 to 0.77 ms for it (gpu/bwd_probe.py, calls 21 and 24), the dK/dV pass did not move but follows
# the same rule. The forward compiles one binary for every length.
@triton.jit(do_not_specialize=["SEQ_BUCKET", "stride_lb", "stride_lh"])
def _attn_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, cu_seqlens_q, cu_seqlens_k,
                 stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                 stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs, stride_lb, stride_lh,
                 seqlen_q, seqlen_k, num_heads, group, qk_scale, sm_scale, SEQ_BUCKET,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
                 TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 1 (SPEC §5.4): one program per query tile, a loop over key tiles up to the diagonal; dQ stored once."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    q_start, seqlen_q, k_start, seqlen_k = _seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_m0
    offs_n = tl.arange(0, BLOCK_N)
    kv_h = h // group
    q = _load_rows(_rows(Q + b64 * stride_qb + h * stride_qh + q_start * stride_qs, seqlen_q, stride_qs, HEAD_DIM,
                         BLOCK_M, TMA), start_m, stride_qs, seqlen_q, offs_m0, True, TMA)
    do = _load_rows(_rows(DO + b64 * stride_dob + h * stride_doh + q_start * stride_dos, seqlen_q, stride_dos,
                          HEAD_DIM, BLOCK_M, TMA), start_m, stride_dos, seqlen_q, offs_m0, True, TMA)
    row_ok = offs_m < seqlen_q
    l_off = b64 * stride_lb + h * stride_lh + q_start + offs_m
    lse2 = tl.load(LSE + l_off, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + l_off, mask=row_ok, other=0.0)
    k_src = _rows(K + b64 * stride_kb + kv_h * stride_kh + k_start * stride_ks, seqlen_k, stride_ks, HEAD_DIM,
                  BLOCK_N, TMA)
    v_src = _rows(V + b64 * stride_vb + kv_h * stride_vh + k_start * stride_vs, seqlen_k, stride_vs, HEAD_DIM,
                  BLOCK_N, TMA)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(seqlen_k, start_m + BLOCK_M)
        full_hi = tl.minimum(start_m, (seqlen_k // BLOCK_N) * BLOCK_N)
    else:
        hi = seqlen_k
        full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, 0, full_hi, offs_m, offs_n,
                   seqlen_k, qk_scale, False, CAUSAL, BLOCK_N, PREC, TMA, HEAD_DIM)
    dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, full_hi, hi, offs_m, offs_n,
                   seqlen_k, qk_scale, True, CAUSAL, BLOCK_N, PREC, TMA, HEAD_DIM)
    dq_dst = _rows(DQ + b64 * stride_dqb + h * stride_dqh + q_start * stride_dqs, seqlen_q, stride_dqs, HEAD_DIM,
                   BLOCK_M, TMA)
    _store_rows(dq_dst, start_m, stride_dqs, seqlen_q, offs_m0, dq * sm_scale, TMA)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_src, do_src, LSE_h, DELTA_h, stride_qs, stride_dos, lo, hi, offs_n, seqlen_q,
                qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr,
                TMA: tl.constexpr):
    # MASKED: rows may pass seqlen_q (bounds masks on every load); CAUSAL: the tiles cross the diagonal
    # Works on the transposed scores (keys x queries) so P^T, dP^T and dS^T need no transposes. Each operand is
    # loaded just before the matmul that needs it (L first, dO after P^T, Delta after dV): FlexAttention's order.
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        if MASKED:  # rows past the end load as zeros (L = 0 too), so they add nothing to dK and dV
            lse2 = tl.load(LSE_h + offs_m, mask=offs_m < seqlen_q, other=0.0) * 1.4426950408889634
        else:
            lse2 = tl.load(LSE_h + offs_m) * 1.4426950408889634
        q = _load_rows(q_src, start_m, stride_qs, seqlen_q, offs_m0, MASKED, TMA)
        s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
        if CAUSAL:
            s_t = tl.where(offs_m[None, :] >= offs_n[:, None], s_t, -1.0e6)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        do = _load_rows(do_src, start_m, stride_dos, seqlen_q, offs_m0, MASKED, TMA)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PREC)
        if MASKED:
            delta = tl.load(DELTA_h + offs_m, mask=offs_m < seqlen_q, other=0.0)
        else:
            delta = tl.load(DELTA_h + offs_m)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _store_dkdv(dk_dst, dv_dst, dk, dv, start_n, stride_dks, stride_dvs, seqlen_k, offs_n0, HEAD_DIM: tl.constexpr,
                BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    # the row tiles are built here, not held across the loops (a BLOCK_N x HEAD_DIM tile of pointers costs registers)
    _store_rows(_rows(dk_dst, seqlen_k, stride_dks, HEAD_DIM, BLOCK_N, TMA), start_n, stride_dks, seqlen_k, offs_n0, dk,
                TMA)
    _store_rows(_rows(dv_dst, seqlen_k, stride_dvs, HEAD_DIM, BLOCK_N, TMA), start_n, stride_dvs, seqlen_k, offs_n0, dv,
                TMA)


@triton.jit(do_not_specialize=["SEQ_BUCKET", "stride_lb", "stride_lh"])
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, cu_seqlens_q, cu_seqlens_k,
                   stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                   stride_dob, stride_doh, stride_dos, stride_dkb, stride_dkh, stride_dks,
                   stride_dvb, stride_dvh, stride_dvs, stride_lb, stride_lh,
                   seqlen_q, seqlen_k, num_kv_heads, qk_scale, sm_scale, SEQ_BUCKET,
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
                   TMA: tl.constexpr, GROUP: tl.constexpr, EVEN_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Pass 2 (SPEC §5.4): one program per key tile and K/V head, K_j and V_j held in registers, a loop over the
    query heads of its group and their query tiles from the diagonal on; dK and dV stored once (no atomics)."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0)
    tl.static_assert(128 % BLOCK_N == 0)  # EVEN_Q (no ragged query tile) is decided on the host for 128 rows
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)  # causal: the first key tiles have the most query rows, so they launch first
    b = pid_bh // num_kv_heads
    hk = pid_bh % num_kv_heads
    q_start, seqlen_q, k_start, seqlen_k = _seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= seqlen_k:
        return
    b64 = b.to(tl.int64)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_n0
    k = _load_rows(_rows(K + b64 * stride_kb + hk * stride_kh + k_start * stride_ks, seqlen_k, stride_ks, HEAD_DIM,
                         BLOCK_N, TMA), start_n, stride_ks, seqlen_k, offs_n0, True, TMA)
    v = _load_rows(_rows(V + b64 * stride_vb + hk * stride_vh + k_start * stride_vs, seqlen_k, stride_vs, HEAD_DIM,
                         BLOCK_N, TMA), start_n, stride_vs, seqlen_k, offs_n0, True, TMA)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dk_dst = DK + b64 * stride_dkb + hk * stride_dkh + k_start * stride_dks
    dv_dst = DV + b64 * stride_dvb + hk * stride_dvh + k_start * stride_dvs
    if CAUSAL:  # query rows before start_n see none of these keys; rows past start_n + BLOCK_N see all of them
        if start_n >= seqlen_q:  # keys that no query reaches (seqlen_k > seqlen_q): zero gradients
            _store_dkdv(dk_dst, dv_dst, dk, dv, start_n, stride_dks, stride_dvs, seqlen_k, offs_n0, HEAD_DIM, BLOCK_N,
                        TMA)
            return
        lo = start_n + BLOCK_N
    else:
        lo = 0
    # Loop bounds matter to the compiler here. The diagonal loop has a fixed trip count (BLOCK_N / BLOCK_M; rows past
    # a ragged end are masked), and the remaining rows, ragged end included, are one loop, masked only when there is
    # a ragged end (EVEN_Q). With a diagonal loop of variable length, or a separate loop for the ragged tile, ptxas
    # serializes the wgmma instructions of the whole kernel (its C7515 note; gpu/sass_stats.py): 16% slower at D=128.
    # The loop starts at a multiple of BLOCK_N and, with no ragged tile, the L offsets are visibly multiples of 128,
    # so the L and Delta rows load with wide copies although the L strides are not specialized (do_not_specialize).
    # GROUP (query heads per K/V head) is a constexpr: with one head per group the compiler drops the outer loop.
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_src = _rows(Q + b64 * stride_qb + h * stride_qh + q_start * stride_qs, seqlen_q, stride_qs, HEAD_DIM,
                      BLOCK_M, TMA)
        do_src = _rows(DO + b64 * stride_dob + h * stride_doh + q_start * stride_dos, seqlen_q, stride_dos, HEAD_DIM,
                       BLOCK_M, TMA)
        if EVEN_Q:  # dense with seqlen_q % 128 == 0, so the L strides are multiples of 128: written so to the compiler
            l_off = (b64 * (stride_lb // 128) + h * (stride_lh // 128)) * 128
        else:
            l_off = b64 * stride_lb + h * stride_lh + q_start
        LSE_h = LSE + l_off
        DELTA_h = DELTA + l_off
        if CAUSAL:  # with EVEN_Q, a diagonal tile that starts before seqlen_q ends before it (BLOCK_N divides 128)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, LSE_h, DELTA_h, stride_qs, stride_dos, start_n,
                                 start_n + BLOCK_N, offs_n, seqlen_q, qk_scale, not EVEN_Q, True, BLOCK_M, PREC, TMA)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, LSE_h, DELTA_h, stride_qs, stride_dos, lo, seqlen_q,
                             offs_n, seqlen_q, qk_scale, not EVEN_Q, False, BLOCK_M, PREC, TMA)
    _store_dkdv(dk_dst, dv_dst, dk * sm_scale, dv, start_n, stride_dks, stride_dvs, seqlen_k, offs_n0, HEAD_DIM,
                BLOCK_N, TMA)


# ---------------------------------------------------------------------------------------------------------------
# Tuning (SPEC §5.6). Short lists per head-dim class and element size, (BLOCK_M, BLOCK_N, num_warps, num_stages);
# autotune keys on the bucketed sequence length, D, dtype, causal and the packed flag, and caches results on disk.
# Compiling is the cold-start cost (measured on the H200: several seconds per config), hence two configs per class
# and little integer specialization (do_not_specialize): the forward reuses one binary for every length, the backward
# kernels one per length class (1, a multiple of 16, other).
# The interpreter runs one small fixed config (tiles smaller than the test lengths so every code path runs).
# ---------------------------------------------------------------------------------------------------------------

FWD_CONFIGS = {  # (64, 2) and (128, 2) from a sweep of 6-8 candidates per kernel on the H200 (gpu/flash_tune.py)
    (64, 2): [(128, 64, 8, 3), (128, 64, 4, 3)],
    (128, 2): [(128, 64, 8, 3), (128, 128, 8, 2)],
    (256, 2): [(64, 32, 4, 2), (64, 64, 8, 2)],
    (64, 4): [(64, 32, 4, 2), (64, 64, 4, 2)],
    (128, 4): [(64, 32, 4, 2), (32, 32, 4, 2)],
    (256, 4): [(32, 32, 4, 2), (32, 16, 4, 1)],
}
DQ_CONFIGS = {  # (64, 2): 128 x 64 tiles with V loaded after P (gpu/bwd_probe.py, calls 17-19)
    (64, 2): [(128, 64, 8, 3), (128, 32, 4, 3)],
    (128, 2): [(128, 64, 8, 3), (64, 64, 4, 3)],
    (256, 2): [(64, 32, 4, 2), (32, 32, 4, 2)],
    (64, 4): [(64, 32, 4, 2), (64, 64, 4, 2)],
    (128, 4): [(64, 32, 4, 2), (32, 32, 4, 2)],
    (256, 4): [(32, 32, 4, 2), (32, 16, 4, 1)],
}
DKDV_CONFIGS = {  # (BLOCK_M, BLOCK_N, ...) with BLOCK_N the key tile held in registers; (64, 2), (128, 2): the
    # fastest of 5 candidates in FlexAttention's loop order (gpu/bwd_probe.py, call 17)
    (64, 2): [(32, 128, 4, 3), (64, 64, 4, 3)],
    (128, 2): [(64, 128, 8, 3), (64, 64, 4, 3)],
    (256, 2): [(32, 64, 4, 2), (32, 32, 4, 2)],
    (64, 4): [(32, 64, 4, 2), (64, 64, 4, 2)],
    (128, 4): [(32, 64, 4, 2), (32, 32, 4, 2)],
    (256, 4): [(32, 32, 4, 2), (16, 32, 4, 1)],
}
INTERPRET_BLOCKS = {"fwd": (32, 16), "dq": (32, 16), "dkdv": (16, 32)}
TUNE_KEY = ["SEQ_BUCKET", "HEAD_DIM", "CAUSAL", "VARLEN", "PREC", "TMA"]


def _tune_class(head_dim, dtype):
    return (64 if head_dim <= 64 else head_dim, 4 if dtype == torch.float32 else 2)


def _autotuned(kernel, table):
    if INTERPRET:
        return kernel
    every = sorted({cfg for cfgs in table.values() for cfg in cfgs})
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in every]

    def prune(configs, named_args, **kwargs):
        wanted = table[_tune_class(kwargs["HEAD_DIM"], named_args["Q"].dtype)][:None if AUTOTUNE else 1]
        return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]

    # results cached on disk where this Triton has the option, so a second cold start skips the benchmarking
    cache = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    return triton.autotune(configs, key=TUNE_KEY, prune_configs_by={"early_config_prune": prune}, **cache)(kernel)


_fwd_kernel = _autotuned(_attn_fwd, FWD_CONFIGS)
_dq_kernel = _autotuned(_attn_bwd_dq, DQ_CONFIGS)
_dkdv_kernel = _autotuned(_attn_bwd_dkdv, DKDV_CONFIGS)


# ---------------------------------------------------------------------------------------------------------------
# Launchers: dense (B, H, S, D) when cu_seqlens_q is None, packed (total, H, D) otherwise
# ---------------------------------------------------------------------------------------------------------------

def _blocks(name):
    if not INTERPRET:
        return {}
    m, n = INTERPRET_BLOCKS[name]
    return {"BLOCK_M": m, "BLOCK_N": n}


def _unit_last(x):  # the kernels read rows with unit stride along the head dim
    return x if x.stride(-1) == 1 else x.contiguous()


def _empty_out(x):
    """The output buffer for x (O, dQ, dK, dV): x's own layout when it is dense, so the (B, S, H, D) memory of a
    transposed view is kept and the caller's transpose back is free. The fake kernels use the same rule."""
    if x.stride(-1) == 1:
        return torch.empty_like(x)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _kernel_head_dim(d):
    """tl.dot needs at least 16 and tiles need powers of two: other head dims are zero-padded (which changes no
    score), e.g. 80 -> 128."""
    return max(16, triton.next_power_of_2(d))


def _pad(x, d_pad):
    return x if x.shape[-1] == d_pad else torch.nn.functional.pad(x, (0, d_pad - x.shape[-1]))


def _strides(x, varlen):
    return (0, x.stride(1), x.stride(0)) if varlen else (x.stride(0), x.stride(1), x.stride(2))


def _precision(dtype):
    # fp32 inputs follow PyTorch's own matmul setting: true fp32 unless TF32 is allowed
    return "tf32" if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _require_triton_device(q):
    if q.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"flash: Triton kernels need a CUDA tensor (got {q.device}); on CPU set "
                           "TRITON_INTERPRET=1 before triton is imported, or use FlashAttentionPyTorch")


@functools.cache
def _has_tma(device_index):
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _tma_allocator(size, alignment, stream):  # scratch for the descriptors the kernels build on the device
    return torch.empty(size, dtype=torch.int8, device="cpu" if INTERPRET else "cuda")


def _use_tma(*xs):
    """TMA when FLASH_TMA=1, the GPU has it, and every tensor is 16-byte aligned in its base and its row, head and
    batch strides (a requirement of the descriptors); otherwise the kernels use pointer loads, which take any layout."""
    if not TMA or not (INTERPRET or _has_tma(xs[0].device.index)):
        return False
    if not all(x.data_ptr() % 16 == 0 and all(st * x.element_size() % 16 == 0
                                              for st, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1) for x in xs):
        return False
    triton.set_allocator(_tma_allocator)
    return True


def _forward(q, k, v, causal, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    _require_triton_device(q)
    varlen = cu_seqlens_q is not None
    o = _empty_out(q)
    d, d_pad = q.shape[-1], _kernel_head_dim(q.shape[-1])
    qp, kp, vp = (_unit_last(_pad(x, d_pad)) for x in (q, k, v))
    op = o if d_pad == d else _empty_out(qp)
    heads, kv_heads = q.shape[-2 if varlen else 1], k.shape[-2 if varlen else 1]
    if varlen:
        batch, total = cu_seqlens_q.shape[0] - 1, q.shape[0]
        lse = torch.empty((heads, total), dtype=torch.float32, device=q.device)
        lse_strides = (0, total)
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
        cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[2], k.shape[2]
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        lse_strides = (heads * seqlen_q, seqlen_q)
        cu_q = cu_k = lse  # unused when VARLEN is False
    if batch * heads * seqlen_q == 0:
        return o.zero_(), lse.fill_(float("-inf"))
    grid = lambda meta: (batch * heads, triton.cdiv(seqlen_q, meta["BLOCK_M"]))
    _fwd_kernel[grid](qp, kp, vp, op, lse, cu_q, cu_k, *_strides(qp, varlen), *_strides(kp, varlen),
                      *_strides(vp, varlen), *_strides(op, varlen), *lse_strides,
                      seqlen_q, seqlen_k, heads, heads // kv_heads, LOG2E / math.sqrt(d),
                      max(16, triton.next_power_of_2(seqlen_q)),
                      HEAD_DIM=d_pad, CAUSAL=causal, VARLEN=varlen, PREC=_precision(q.dtype),
                      TMA=_use_tma(qp, kp, vp, op), **_blocks("fwd"))
    if op is not o:
        o.copy_(op[..., :d])
    return o, lse


def _backward(do, q, k, v, o, lse, causal, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    _require_triton_device(q)
    varlen = cu_seqlens_q is not None
    dq, dk, dv = _empty_out(q), _empty_out(k), _empty_out(v)
    d, d_pad = q.shape[-1], _kernel_head_dim(q.shape[-1])
    dop, qp, kp, vp, op = (_unit_last(_pad(x, d_pad)) for x in (do, q, k, v, o))
    dqp, dkp, dvp = (g if d_pad == d else _empty_out(x) for g, x in ((dq, qp), (dk, kp), (dv, vp)))
    heads, kv_heads = q.shape[-2 if varlen else 1], k.shape[-2 if varlen else 1]
    if varlen:
        batch, seqlen_q, seqlen_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        lse_strides = (0, q.shape[0])
        cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[2], k.shape[2]
        lse_strides = (heads * seqlen_q, seqlen_q)
        cu_q = cu_k = lse
    if batch * heads * seqlen_q == 0 or seqlen_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty_like(lse)
    _attn_bwd_delta[(batch * heads, triton.cdiv(seqlen_q, 64))](
        op, dop, delta, cu_q, *_strides(op, varlen), *_strides(dop, varlen), *lse_strides, seqlen_q, heads,
        HEAD_DIM=d_pad, VARLEN=varlen, BLOCK_M=64)
    scale = 1.0 / math.sqrt(d)
    common = dict(HEAD_DIM=d_pad, CAUSAL=causal, VARLEN=varlen, PREC=_precision(q.dtype),
                  TMA=_use_tma(qp, kp, vp, dop, dqp, dkp, dvp))
    bucket = max(16, triton.next_power_of_2(max(seqlen_q, seqlen_k)))
    grid_q = lambda meta: (batch * heads, triton.cdiv(seqlen_q, meta["BLOCK_M"]))
    _dq_kernel[grid_q](qp, kp, vp, dop, dqp, lse, delta, cu_q, cu_k, *_strides(qp, varlen), *_strides(kp, varlen),
                       *_strides(vp, varlen), *_strides(dop, varlen), *_strides(dqp, varlen), *lse_strides,
                       seqlen_q, seqlen_k, heads, heads // kv_heads, LOG2E * scale, scale, bucket,
                       **common, **_blocks("dq"))
    grid_k = lambda meta: (batch * kv_heads, triton.cdiv(seqlen_k, meta["BLOCK_N"]))
    _dkdv_kernel[grid_k](qp, kp, vp, dop, dkp, dvp, lse, delta, cu_q, cu_k, *_strides(qp, varlen),
                         *_strides(kp, varlen), *_strides(vp, varlen), *_strides(dop, varlen), *_strides(dkp, varlen),
                         *_strides(dvp, varlen), *lse_strides, seqlen_q, seqlen_k, kv_heads, LOG2E * scale, scale,
                         bucket, GROUP=heads // kv_heads, EVEN_Q=not varlen and seqlen_q % 128 == 0, **common,
                         **_blocks("dkdv"))
    for g, gp in ((dq, dqp), (dk, dkp), (dv, dvp)):
        if gp is not g:
            g.copy_(gp[..., :d])
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------------------
# torch.library custom ops: opaque to torch.compile (no graph breaks), with autograd and fake kernels
# ---------------------------------------------------------------------------------------------------------------

@torch.library.custom_op("flash::attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, causal)


@_attention_fwd.register_fake
def _(q, k, v, causal):
    return _empty_out(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flash::attention_bwd", mutates_args=())
def _attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, causal)


@_attention_bwd.register_fake
def _(do, q, k, v, o, lse, causal):
    return _empty_out(q), _empty_out(k), _empty_out(v)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.mark_non_differentiable(lse)
    ctx.causal = causal


def _attention_grad(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    return (*_attention_bwd(do, q, k, v, o, lse, ctx.causal), None)


_attention_fwd.register_autograd(_attention_grad, setup_context=_attention_setup)


@torch.library.custom_op("flash::varlen_fwd", mutates_args=())
def _varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
    return _empty_out(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("flash::varlen_bwd", mutates_args=())
def _varlen_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                max_seqlen_k: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


@_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
    return _empty_out(q), _empty_out(k), _empty_out(v)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.mark_non_differentiable(lse)
    ctx.args = (max_seqlen_q, max_seqlen_k, causal)


def _varlen_grad(ctx, do, dlse):
    q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, causal = ctx.args
    dq, dk, dv = _varlen_bwd(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)
    return dq, dk, dv, None, None, None, None, None


_varlen_fwd.register_autograd(_varlen_grad, setup_context=_varlen_setup)


# Eager calls skip the custom-op layer: its Python dispatch and autograd wrapping cost about 0.6 ms per
# forward+backward on the H200 (gpu/overhead.py), several times the kernels' own launch cost. Under torch.compile
# the custom ops above are used, so the graph stays whole.
class _Eager(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        o, lse = _forward(q, k, v, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*_backward(do, q, k, v, o, lse, *ctx.args), None, None, None, None, None)


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------

def _check_qkv(q, k, v, ndim):
    if q.dim() != ndim or k.dim() != ndim or v.dim() != ndim:
        raise ValueError(f"flash: q, k, v must be {ndim}-D, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"flash: q, k, v need one dtype among fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash: q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"flash: k and v must share a shape with q's head dim, got {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] > 256:
        raise ValueError(f"flash: head dim {q.shape[-1]} > 256 is not supported")


def flash_attention(q, k, v, causal=True):
    """q (B, H, S, D), k/v (B, H_kv, S_k, D) with H % H_kv == 0, any strides -> O (B, H, S, D); differentiable."""
    _check_qkv(q, k, v, 4)
    if q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"flash: batch must match and H_kv divide H: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if torch.compiler.is_compiling():
        return _attention_fwd(q, k, v, causal)[0]
    return _Eager.apply(q, k, v, causal, None, None, 0, 0)


def flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen, causal=True, cu_seqlens_k=None, max_seqlen_k=None):
    """Packed documents: q (total_q, H, D), k/v (total_k, H_kv, D), int32 cu_seqlens (num_seqs + 1) -> O like q.
    Each query attends only inside its own document (SPEC §5.7); max_seqlen is a Python int (sizes the grid)."""
    _check_qkv(q, k, v, 3)
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"flash: H_kv must divide H: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if cu_seqlens_k is None:
        cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
    elif max_seqlen_k is None:
        raise ValueError("flash: cu_seqlens_k needs max_seqlen_k")
    for name, cu in (("cu_seqlens", cu_seqlens), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device:
            raise ValueError(f"flash: {name} must be a 1-D int32 tensor on {q.device}, got {cu.dtype} "
                             f"{tuple(cu.shape)} on {cu.device}")
    if cu_seqlens.shape != cu_seqlens_k.shape:
        raise ValueError("flash: cu_seqlens and cu_seqlens_k must have the same number of sequences")
    if torch.compiler.is_compiling():
        return _varlen_fwd(q, k, v, cu_seqlens, cu_seqlens_k, int(max_seqlen), int(max_seqlen_k), causal)[0]
    return _Eager.apply(q, k, v, causal, cu_seqlens, cu_seqlens_k, int(max_seqlen), int(max_seqlen_k))


class FlashAttentionTriton(torch.autograd.Function):
    """The Triton kernels on (..., seq, d); saves one L of shape (..., seq_q) (SPEC §5.1)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        _check_qkv(q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:]), 3)
        o, lse = _forward(*(x.reshape(-1, 1, *x.shape[-2:]) for x in (q, k, v)), is_causal)
        o, lse = o.reshape(q.shape), lse.reshape(q.shape[:-1])
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        as4 = lambda x: x.reshape(-1, 1, *x.shape[-2:])
        dq, dk, dv = _backward(as4(do), as4(q), as4(k), as4(v), as4(o), lse.reshape(-1, 1, q.shape[-2]), ctx.is_causal)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), None
