"""A Llama-style Transformer language model (pre-norm, RMSNorm, SwiGLU,
RoPE, no biases) from plain tensor ops.

  1. basic modules  Linear, Embedding, RMSNorm, SwiGLU, RoPE
  2. attention      the reference, packed documents, KVCache
  3. the model      CausalSelfAttention, TransformerBlock, TransformerLM
  4. loss           cross_entropy, linear_cross_entropy (the fused head)
  5. accounting     count_params, flops_per_token, PRESETS
  6. checkpoints    read_checkpoint, unwrap

Parameters carry the course's reference names (token_embeddings,
layers.{i}.attn.q_proj, ..., lm_head), so checkpoints move both ways.
attn_impl: "naive" (our reference), "sdpa" (torch's), "flash" (flash.py's
kernels) or "flash_ref" (their tiled PyTorch twin).
"""
import contextlib
import math
import numbers
import os
import pickle
import zipfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

import flash

ATTN_IMPLS = ("naive", "sdpa", "flash", "flash_ref")


def auto_attn_impl(device_type, packed):
    """train.py's attn_impl="auto": on CUDA, flash for packed documents
    (sdpa would pad each to the longest), else sdpa; off CUDA naive."""
    if device_type != "cuda":
        return "naive"
    if packed:
        return "flash"
    return "sdpa"


def upcast(x):
    """x in at least fp32 (fp64 stays fp64, for the float64 tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def autocast_dtype(x):
    """The dtype autocast gives matmuls on x's device; None when off."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


# ---- 1. basic modules

def weight_grad(g, x, dtype):
    """g^T x in dtype (the weight's): on CUDA one GEMM writes it, with no
    half-precision rounding and no cast pass."""
    if g.dtype != dtype and g.is_cuda:
        return torch.mm(g.t(), x, out_dtype=dtype)
    return g.t().mm(x).to(dtype)


class _AutocastLinear(torch.autograd.Function):
    """Linear under autocast with fp32 master weights: the weight gradient
    comes in the weight's dtype from weight_grad."""

    @staticmethod
    def forward(ctx, x, weight, dtype):
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            w = weight.to(dtype)
            y = x2.mm(w.t())
        ctx.save_for_backward(x2, w)
        ctx.x_shape, ctx.w_dtype = x.shape, weight.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x2, w = ctx.saved_tensors
        g2 = grad_y.reshape(-1, grad_y.shape[-1]).to(x2.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = g2.mm(w).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(g2, x2, ctx.w_dtype)
        return grad_x, grad_w, None


class Linear(nn.Module):
    """y = x W^T, no bias; W (out, in) ~ truncated normal with
    sigma^2 = 2 / (in + out), cut at +-3 sigma."""

    def __init__(self, in_features, out_features, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        weight = torch.empty(out_features, in_features, device=device,
                             dtype=dtype)
        self.weight = nn.Parameter(weight)
        std = math.sqrt(2.0 / (in_features + out_features))
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x):
        dtype = autocast_dtype(x)
        recast = dtype is not None and dtype != self.weight.dtype
        grad = torch.is_grad_enabled() and self.weight.requires_grad
        if recast and grad:
            return _AutocastLinear.apply(x, self.weight, dtype)
        return x @ self.weight.T

    def cross_entropy(self, x, targets, ignore_index=-100):
        """cross_entropy(self(x), targets), fused (a method, so ddp.FSDP's
        wrapper can supply W)."""
        return linear_cross_entropy(x, self.weight, targets, ignore_index)


class Embedding(nn.Module):
    """Lookup table (num_embeddings, embedding_dim) ~ truncated normal,
    sigma 1, cut at +-3."""

    def __init__(self, num_embeddings, embedding_dim, device=None,
                 dtype=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        weight = torch.empty(num_embeddings, embedding_dim, device=device,
                             dtype=dtype)
        self.weight = nn.Parameter(weight)
        nn.init.trunc_normal_(self.weight, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids):
        return self.weight[token_ids]


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g in fp32 (squares overflow in half
    precision). impl: "torch" (these ops) or "triton" (flash.rms_norm)."""

    def __init__(self, d_model, eps=1e-5, device=None, dtype=None,
                 impl="torch"):
        super().__init__()
        self.eps, self.impl = eps, impl
        weight = torch.ones(d_model, device=device, dtype=dtype)
        self.weight = nn.Parameter(weight)

    def forward(self, x):
        if self.impl == "triton":
            return flash.rms_norm(x, self.weight, self.eps)
        if self.impl != "torch":
            raise ValueError(f"RMSNorm.impl={self.impl!r}: expected "
                             f"'torch' or 'triton'")
        xf = upcast(x)
        mean_square = xf.pow(2).mean(-1, keepdim=True)
        scale = torch.rsqrt(mean_square + self.eps)
        return (xf * scale * self.weight.to(xf.dtype)).to(x.dtype)


def set_norm_impl(module, impl):
    """Every RMSNorm in module on impl ("torch" or "triton"); -> module."""
    if impl not in ("torch", "triton"):
        raise ValueError(f"set_norm_impl: impl={impl!r}, expected "
                         f"'torch' or 'triton'")
    for m in module.modules():
        if isinstance(m, RMSNorm):
            m.impl = impl
    return module


def silu(x):
    """SiLU(x) = x * sigmoid(x)."""
    return x * torch.sigmoid(x)


class SwiGLU(nn.Module):
    """FFN(x) = W2 (SiLU(W1 x) * W3 x); d_ff defaults to (8/3) d rounded
    to a multiple of 64."""

    def __init__(self, d_model, d_ff=None, device=None, dtype=None):
        super().__init__()
        if d_ff is None:
            d_ff = 64 * round(8 * d_model / 192)
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x):
        return self.w2(silu(self.w1(x)) * self.w3(x))


def apply_rope(x, cos, sin):
    """Turn pairs (x[2j], x[2j+1]) by angles with cos, sin like x[..., ::2],
    in at least fp32: x * C + swap(x) * S, C = (c0, c0, c1, c1, ...),
    S = (-s0, s0, -s1, s1, ...); elementwise, so one compiled kernel."""
    xf = upcast(x)
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    c = cos.repeat_interleave(2, dim=-1)
    s = torch.stack((-sin, sin), dim=-1).flatten(-2)
    return (xf * c + swapped * s).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE: pair j of a head vector at position i turns by the angle
    i * theta^(-2j / d_k); tables (context_length, d_k / 2), not saved.
    forward(x (..., T, d_k), position_ids (..., T), default 0..T-1)."""

    def __init__(self, theta, d_k, context_length, device=None):
        super().__init__()
        if d_k % 2:
            raise ValueError(f"RoPE needs an even head dimension, got "
                             f"d_k={d_k}")
        pair = torch.arange(0, d_k, 2, device=device, dtype=torch.float64)
        position = torch.arange(context_length, device=device,
                                dtype=torch.float64)
        angles = torch.outer(position, theta ** (-pair / d_k))
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(x.shape[-2], device=x.device)
        return apply_rope(x, self.cos[position_ids], self.sin[position_ids])


# ---- 2. attention

def softmax(x, dim):
    """softmax along dim, less the max first (no inf / inf)."""
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


def scaled_dot_product_attention(q, k, v, mask=None):
    """softmax(Q K^T / sqrt(d_k)) V, q (..., n, d_k), k and v (..., m, d);
    mask (n, m) boolean, True where query i may attend key j. Scores and
    softmax in at least fp32."""
    scores = upcast(q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores, dim=-1).to(v.dtype) @ v


def causal_mask(n, device):
    """(n, n) boolean, True where key j <= query i (made per call)."""
    i = torch.arange(n, device=device)
    return i[:, None] >= i[None, :]


def document_ids(cu_seqlens, n):
    """doc(t) of n packed rows: k where cu_seqlens[k] <= t < cu_seqlens[k+1]."""
    t = torch.arange(n, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), t, right=True)


def packed_positions(cu_seqlens, n):
    """Positions restarting in each document: pos(t) = t - cu_seqlens[doc(t)]."""
    start = cu_seqlens[document_ids(cu_seqlens, n)].long()
    return torch.arange(n, device=cu_seqlens.device) - start


def block_diagonal_causal_mask(cu_seqlens, n):
    """(n, n) boolean, packed attention's dense reference: row t may
    attend row s iff doc(t) == doc(s) and s <= t."""
    doc = document_ids(cu_seqlens, n)
    same_document = doc[:, None] == doc[None, :]
    return same_document & causal_mask(n, cu_seqlens.device)


class PaddedDocuments:
    """n packed rows as a right-padded (documents, length, ...) batch and
    back (pad, unpad): row t sits at (doc(t), pos(t))."""

    def __init__(self, cu_seqlens, n, length):
        self.shape = (len(cu_seqlens) - 1, length)
        doc = document_ids(cu_seqlens, n)
        self.where = doc, packed_positions(cu_seqlens, n)

    def pad(self, t):
        padded = t.new_zeros(*self.shape, *t.shape[1:])
        return padded.index_put(self.where, t)

    def unpad(self, t):
        return t[self.where]


class KVCache:
    """Keys and values of earlier tokens for decoding, a buffer per layer.
    Slot s of row b holds that row's position s, so prompts of different
    lengths share one cache. `length` (TransformerLM.forward advances it)
    counts the slots any row may have written."""

    def __init__(self, num_layers, batch_size, max_len, num_heads, d_head,
                 device=None, dtype=torch.float32):
        shape = (num_layers, batch_size, max_len, num_heads, d_head)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len, self.length = max_len, 0

    def update(self, layer_idx, k, v, position_ids):
        """Write k, v (B, T, H, D) at slots position_ids (B, T); -> the
        keys and values of the slots in use."""
        end = self.length + k.shape[1]
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.k[layer_idx][rows, position_ids] = k.to(self.k.dtype)
        self.v[layer_idx][rows, position_ids] = v.to(self.v.dtype)
        return self.k[layer_idx, :, :end], self.v[layer_idx, :, :end]


# ---- 3. the model

class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, RoPE on q and k. Each projection
    is a Linear of its own, so ddp.FSDP's per-Linear wrapper sees it.
    Heads stay (B, T, H, d_k) in memory."""

    def __init__(self, d_model, num_heads, context_length, theta=10000.0,
                 attn_impl="naive", rope=None, layer_idx=0, device=None,
                 dtype=None):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by "
                             f"num_heads={num_heads}")
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={attn_impl!r}: expected one of "
                             f"{ATTN_IMPLS}")
        self.num_heads = num_heads
        self.d_head = d_model // num_heads
        self.attn_impl = attn_impl
        self.layer_idx = layer_idx  # which KVCache buffer this layer uses
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (
            Linear(d_model, d_model, device=device, dtype=dtype)
            for _ in range(4))
        if rope is None and theta is not None:
            rope = RotaryEmbedding(theta, self.d_head, context_length,
                                   device=device)
        # shared by all layers of a model; None: no positional encoding
        self.rope = rope

    def forward(self, x, position_ids=None, cu_seqlens=None,
                max_seqlen=None, kv_cache=None):
        """x (B, T, d); position_ids (..., T), default 0..T-1. Packed:
        B == 1, cu_seqlens and max_seqlen mark the documents."""
        B, T, d = x.shape
        shape = (B, T, self.num_heads, self.d_head)
        q = self.q_proj(x).view(shape)
        k = self.k_proj(x).view(shape)
        v = self.v_proj(x).view(shape)
        if self.rope is not None:
            if position_ids is None:
                position_ids = torch.arange(T, device=x.device)
            positions = position_ids[..., None]  # broadcast over the heads
            q, k = self.rope(q, positions), self.rope(k, positions)
        if kv_cache is not None:
            out = self._cached(q, k, v, position_ids, kv_cache)
        elif self.attn_impl in ("naive", "sdpa") and cu_seqlens is not None:
            out = self._per_document(q, k, v, cu_seqlens, max_seqlen)
        elif self.attn_impl in ("naive", "sdpa"):
            out = self._masked(q, k, v)
        elif self.attn_impl == "flash_ref":
            out = self._flash_ref(q, k, v, cu_seqlens)
        elif cu_seqlens is not None:
            out = flash.flash_attn_varlen(q[0], k[0], v[0], cu_seqlens,
                                          max_seqlen, causal=True)[None]
        else:  # the kernel takes (B, H, T, D) views
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = flash.flash_attention(q, k, v, causal=True)
            out = out.transpose(1, 2)
        return self.output_proj(out.reshape(B, T, d))

    def _masked(self, q, k, v, mask=None):
        """q (B, T, H, D), k and v (B, S, H, D), a boolean mask broadcasting
        to (B, H, T, S) (None: causal) -> (B, T, H, D), a strided view."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.attn_impl == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, mask,
                                                 is_causal=mask is None)
            return out.transpose(1, 2)
        if mask is None:
            mask = causal_mask(q.shape[2], q.device)
        return scaled_dot_product_attention(q, k, v, mask).transpose(1, 2)

    def _cached(self, q, k, v, position_ids, kv_cache):
        """Decoding (queries and keys differ in length; every attn_impl):
        a query at position p attends slots 0..p."""
        position_ids = position_ids.expand(q.shape[:2])
        k, v = kv_cache.update(self.layer_idx, k, v, position_ids)
        slots = torch.arange(k.shape[1], device=q.device)
        mask = slots <= position_ids[:, None, :, None]
        return self._masked(q, k.to(q.dtype), v.to(q.dtype), mask)

    def _per_document(self, q, k, v, cu_seqlens, max_seqlen):
        """One causal call on the documents padded to the longest: each
        costs its length squared, not the row's."""
        documents = PaddedDocuments(cu_seqlens, q.shape[1], max_seqlen)
        q, k, v = (documents.pad(t[0]) for t in (q, k, v))
        return documents.unpad(self._masked(q, k, v))[None]

    def _flash_ref(self, q, k, v, cu_seqlens):
        """The tiled PyTorch twin, a document at a time (a host read)."""
        n = q.shape[1]
        cu = [0, n] if cu_seqlens is None else cu_seqlens.tolist()
        falls = any(a > b for a, b in zip(cu, cu[1:]))
        if cu[0] != 0 or cu[-1] != n or falls:
            raise ValueError(f"cu_seqlens must rise from 0 to the {n} "
                             f"packed tokens, got {cu}")
        outs = []
        for a, b in zip(cu, cu[1:]):
            if b > a:  # (B, len, H, D) -> (B, H, len, D) views
                doc = (t[:, a:b].transpose(1, 2) for t in (q, k, v))
                outs.append(flash.FlashAttentionPyTorch.apply(*doc, True))
        return torch.cat(outs, dim=2).transpose(1, 2)


class TransformerBlock(nn.Module):
    """Pre-norm block: z = x + MHSA(RMSNorm1(x)); y = z + FFN(RMSNorm2(z)).
    With both norms on "triton", each fuses its residual add
    (flash.add_rms_norm)."""

    def __init__(self, d_model, num_heads, d_ff, context_length,
                 theta=10000.0, attn_impl="naive", rope=None, layer_idx=0,
                 device=None, dtype=None):
        super().__init__()
        self.ln1 = RMSNorm(d_model, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(
            d_model, num_heads, context_length, theta, attn_impl=attn_impl,
            rope=rope, layer_idx=layer_idx, device=device, dtype=dtype)
        self.ln2 = RMSNorm(d_model, device=device, dtype=dtype)
        self.ffn = SwiGLU(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x, position_ids=None, cu_seqlens=None,
                max_seqlen=None, kv_cache=None, selective=False):
        """selective=True (while training): keep only the matmul and
        attention outputs for the backward."""
        args = (x, position_ids, cu_seqlens, max_seqlen, kv_cache)
        if selective and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, *args, use_reentrant=False,
                              context_fn=_selective_recompute_context)
        return self._forward(*args)

    def _forward(self, x, position_ids, cu_seqlens, max_seqlen, kv_cache):
        attn_args = (position_ids, cu_seqlens, max_seqlen, kv_cache)
        if self.ln1.impl == "triton" and self.ln2.impl == "triton":
            # the norms write what the matmuls read (autocast would cast it)
            dtype = autocast_dtype(x)
            ln1, ln2 = self.ln1, self.ln2
            x, y = flash.add_rms_norm(x, None, ln1.weight, ln1.eps, dtype)
            attn = self.attn(y, *attn_args)
            x, y = flash.add_rms_norm(x, attn, ln2.weight, ln2.eps, dtype)
            return x + self.ffn(y)
        x = x + self.attn(self.ln1(x), *attn_args)
        return x + self.ffn(self.ln2(x))


def _selective_recompute_context():
    """checkpoint's context_fn: keep the outputs of the matmuls and
    attention, recompute the elementwise rest (RMSNorm, RoPE, SiLU(a) * b,
    weight casts), cheap to redo."""
    aten = torch.ops.aten
    sdpa = ("_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention_for_cpu")
    saved = {aten.mm.default, aten.addmm.default, aten.bmm.default,
             torch.ops.flash.attention_fwd.default}
    saved |= {getattr(aten, op).default for op in sdpa if hasattr(aten, op)}

    def policy(ctx, op, *args, **kwargs):
        if op in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


class TransformerLM(nn.Module):
    """token_embeddings -> pre-norm blocks -> ln_final -> lm_head;
    rope_theta=None: no RoPE. tie_embeddings: one matrix for embedding and
    lm_head, initialised as a Linear's. While training, act_ckpt_every=k
    checkpoints segments of k blocks over the first act_ckpt_layers (None:
    all); selective_recompute=True: the other blocks keep only their
    matmul and attention outputs."""

    def __init__(self, vocab_size, context_length, d_model, num_layers,
                 num_heads, d_ff, rope_theta=10000.0, attn_impl="naive",
                 tie_embeddings=False, act_ckpt_every=0, act_ckpt_layers=None,
                 selective_recompute=False, device=None, dtype=None):
        super().__init__()
        if act_ckpt_every < 0:
            raise ValueError(f"act_ckpt_every={act_ckpt_every} must be >= 0 "
                             f"(0 = no activation checkpointing)")
        if act_ckpt_layers is not None and not 0 <= act_ckpt_layers <= num_layers:
            raise ValueError(f"act_ckpt_layers={act_ckpt_layers} must lie in "
                             f"[0, num_layers={num_layers}] (None: all)")
        self.vocab_size, self.context_length = vocab_size, context_length
        self.d_model, self.num_layers = d_model, num_layers
        self.num_heads = num_heads
        # read at call time
        self.act_ckpt_every = act_ckpt_every
        self.act_ckpt_layers = act_ckpt_layers
        self.selective_recompute = selective_recompute
        self.token_embeddings = Embedding(vocab_size, d_model, device=device,
                                          dtype=dtype)
        self.layers = nn.ModuleList()
        for i in range(num_layers):
            # the first layer builds the RoPE table, the rest share it
            rope = self.layers[0].attn.rope if i else None
            self.layers.append(TransformerBlock(
                d_model, num_heads, d_ff, context_length, rope_theta,
                attn_impl, rope=rope, layer_idx=i, device=device, dtype=dtype))
        self.ln_final = RMSNorm(d_model, device=device, dtype=dtype)
        self.lm_head = Linear(d_model, vocab_size, device=device, dtype=dtype)
        if tie_embeddings:
            self.token_embeddings.weight = self.lm_head.weight
        self.attn_impl = attn_impl

    @property
    def attn_impl(self):
        return self._attn_impl

    @attn_impl.setter
    def attn_impl(self, value):
        if value not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={value!r}: expected one of "
                             f"{ATTN_IMPLS}")
        self._attn_impl = value
        for layer in self.layers:
            layer.attn.attn_impl = value

    def make_kv_cache(self, batch_size, max_len=None, device=None,
                      dtype=torch.float32):
        """An empty KVCache (max_len: context_length by default)."""
        if max_len is None:
            max_len = self.context_length
        if device is None:
            device = self.lm_head.weight.device
        d_head = self.d_model // self.num_heads
        return KVCache(self.num_layers, batch_size, max_len, self.num_heads,
                       d_head, device=device, dtype=dtype)

    def forward(self, idx, cu_seqlens=None, max_seqlen=None,
                position_ids=None, kv_cache=None, targets=None):
        """idx (B, T) int64 -> logits (B, T, vocab_size); with targets, the
        mean cross-entropy by the fused head instead (-100 ignored).
        Packed: idx (1, N) holds documents back to back, cu_seqlens (int32)
        their boundaries, max_seqlen (an int) the longest; attention and
        RoPE positions restart in each. position_ids (B, T) or (T,): RoPE
        positions; decoding with kv_cache needs them, as cache slots."""
        B, T = idx.shape
        if cu_seqlens is not None:
            max_seqlen = self._check_packed(idx, cu_seqlens, max_seqlen)
            if position_ids is None:
                position_ids = packed_positions(cu_seqlens, T)
        elif kv_cache is not None:
            if position_ids is None:
                raise ValueError("decoding with a kv_cache needs "
                                 "position_ids (the slot of every token)")
            if kv_cache.length + T > kv_cache.max_len:
                raise ValueError(f"KV cache full: {kv_cache.length} + {T} "
                                 f"tokens > {kv_cache.max_len} slots")
        elif position_ids is None and T > self.context_length:
            raise ValueError(f"sequence of {T} tokens exceeds "
                             f"context_length {self.context_length}")

        x = self.token_embeddings(idx)
        args = (position_ids, cu_seqlens, max_seqlen, kv_cache)
        # the first n_ckpt blocks run in checkpointed segments of seg
        seg, n_ckpt = self.act_ckpt_every, 0
        if seg and self.training and torch.is_grad_enabled():
            n_ckpt = self.num_layers
            if self.act_ckpt_layers is not None:
                n_ckpt = min(self.act_ckpt_layers, n_ckpt)
        for start in range(0, n_ckpt, max(seg, 1)):
            end = min(start + seg, n_ckpt)
            x = checkpoint(self._run_layers, x, start, end, *args,
                           use_reentrant=False)
        x = self._run_layers(x, n_ckpt, self.num_layers, *args,
                             selective=self.selective_recompute)
        if kv_cache is not None:
            kv_cache.length += T
        h = self.ln_final(x)
        if targets is None:
            return self.lm_head(h)
        return self.lm_head.cross_entropy(h, targets)

    def _check_packed(self, idx, cu_seqlens, max_seqlen):
        """-> max_seqlen as the plain int the kernel grid wants, checked."""
        if idx.shape[0] != 1:
            raise ValueError(f"packed mode takes idx of shape (1, N), got "
                             f"{tuple(idx.shape)}")
        if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
            raise ValueError("cu_seqlens must be a 1-D int32 tensor "
                             "(num_docs + 1 offsets)")
        if not isinstance(max_seqlen, numbers.Integral):
            raise ValueError("packed mode needs max_seqlen as a Python int "
                             "(the longest document)")
        if max_seqlen > self.context_length:
            raise ValueError(f"max_seqlen={max_seqlen} exceeds "
                             f"context_length {self.context_length}")
        return int(max_seqlen)

    def _run_layers(self, x, start, end, position_ids, cu_seqlens,
                    max_seqlen, kv_cache=None, selective=False):
        for layer in self.layers[start:end]:
            x = layer(x, position_ids, cu_seqlens, max_seqlen, kv_cache,
                      selective=selective)
        return x


# ---- 4. loss

class _CrossEntropy(torch.autograd.Function):
    """loss = logsumexp(o) - o[target] in fp32; the backward written out,
    d loss / d o = (softmax(o) - onehot(target)) / count, is one pass
    (autograd's would scatter into a dense fp32 zero tensor)."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        o = upcast(logits)
        m = o.amax(dim=-1, keepdim=True)
        sum_exp = torch.exp(o - m).sum(dim=-1, keepdim=True)
        lse = (m + torch.log(sum_exp)).squeeze(-1)
        keep = targets != ignore_index
        safe = torch.where(keep, targets, 0)
        picked = o.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        count = keep.sum().clamp(min=1)
        ctx.save_for_backward(logits, safe, keep, lse, count)
        return torch.where(keep, lse - picked, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad):
        logits, safe, keep, lse, count = ctx.saved_tensors
        o = upcast(logits)
        vocab = torch.arange(o.shape[-1], device=o.device)
        onehot = vocab == safe.unsqueeze(-1)
        scale = torch.where(keep, grad / count, 0.0).unsqueeze(-1)
        probs = torch.exp(o - lse.unsqueeze(-1))
        grad_logits = (probs - onehot.to(o.dtype)) * scale
        return grad_logits.to(logits.dtype), None, None


def cross_entropy(logits, targets, ignore_index=-100):
    """Mean of logsumexp(o) - o[target] over targets not ignore_index,
    logits (..., V) in fp32. All ignored: 0, not 0/0 (an all-padding
    micro-batch cannot poison gradient accumulation)."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} need "
                         f"targets of shape {tuple(logits.shape[:-1])}, got "
                         f"{tuple(targets.shape)}")
    return _CrossEntropy.apply(logits, targets, ignore_index)


def _add_matmul(acc, a, b):
    """acc + a @ b, acc fp32: on CUDA one GEMM with a 32-bit output."""
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    if a.is_cuda:
        # a build without the mixed-precision GEMM raises
        with contextlib.suppress(RuntimeError):
            return torch.addmm(acc, a, b, out_dtype=acc.dtype)
    return acc.add_(a @ b)


def _head_grads(x, weight, need_grad):
    """The fused head's dx and zeroed fp32 dW (empty without need_grad)."""
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    if not need_grad:
        return x.new_empty(0), x.new_zeros(0, dtype=acc_dtype)
    return torch.empty_like(x), x.new_zeros(weight.shape, dtype=acc_dtype)


def fused_head(x, weight, targets, ignore_index, chunk, need_grad):
    """(mean loss, dL/dx, dL/dweight) of cross_entropy(x @ weight^T,
    targets), x (N, d), weight (V, d), chunk tokens at a time: a chunk's
    logits turn into their gradient dO in place (flash.cross_entropy_rows),
    then dx = dO W, dW += dO^T x (fp32); need_grad=False skips both. A
    custom op under torch.compile."""
    if torch.compiler.is_compiling():
        return _fused_head_op(x, weight, targets, ignore_index, chunk,
                              need_grad)
    dx, dw = _head_grads(x, weight, need_grad)
    count = (targets != ignore_index).sum().clamp(min=1)
    scale = (1.0 / count.to(dw.dtype)).reshape(1)
    loss_rows = x.new_empty(x.shape[0], dtype=dw.dtype)
    for start in range(0, x.shape[0], chunk):
        rows = slice(start, start + chunk)
        logits = x[rows] @ weight.T
        flash.cross_entropy_rows(logits, targets[rows], ignore_index, scale,
                                 loss_rows[rows])
        if need_grad:
            torch.mm(logits, weight, out=dx[rows])
            dw = _add_matmul(dw, logits.T, x[rows])
    return loss_rows.sum() * scale[0], dx, dw


@torch.library.custom_op("model::fused_head", mutates_args=())
def _fused_head_op(x: torch.Tensor, weight: torch.Tensor,
                   targets: torch.Tensor, ignore_index: int, chunk: int,
                   need_grad: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fused_head(x, weight, targets, ignore_index, chunk, need_grad)


@_fused_head_op.register_fake
def _(x, weight, targets, ignore_index, chunk, need_grad):
    dx, dw = _head_grads(x, weight, need_grad)
    return x.new_empty((), dtype=dw.dtype), dx, dw


def head_dtype(x, weight):
    """The head matmul's dtype: autocast's when on, else x's and weight's."""
    return autocast_dtype(x) or torch.promote_types(x.dtype, weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """The fused head with autograd: the forward makes both gradients,
    the backward only scales them."""

    @staticmethod
    def forward(ctx, x, weight, targets, ignore_index, chunk, need_grad):
        dtype = head_dtype(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            loss, dx, dw = fused_head(x.to(dtype), weight.to(dtype), targets,
                                      ignore_index, chunk, need_grad)
        ctx.save_for_backward(dx, dw)
        ctx.dtypes = (x.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad):
        dx, dw = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        grad_x, grad_w = (dx * grad).to(x_dtype), (dw * grad).to(w_dtype)
        return grad_x, grad_w, None, None, None, None


def head_chunk(vocab_size):
    """Tokens per chunk of the fused head: 2^28 logits (0.5 GiB in bf16)."""
    return max(1, 2 ** 28 // vocab_size)


def linear_cross_entropy(x, weight, targets, ignore_index=-100, chunk=None):
    """cross_entropy(x @ weight.T, targets), x (..., d), weight (V, d),
    chunk tokens at a time (default head_chunk): the (tokens x V) logits
    never exist whole."""
    if x.shape[:-1] != targets.shape:
        raise ValueError(f"linear_cross_entropy: x {tuple(x.shape)} needs "
                         f"targets of shape {tuple(x.shape[:-1])}, got "
                         f"{tuple(targets.shape)}")
    if chunk is None:
        chunk = head_chunk(weight.shape[0])
    wants_grad = x.requires_grad or weight.requires_grad
    need_grad = torch.is_grad_enabled() and wants_grad
    x2 = x.reshape(-1, x.shape[-1])
    t = targets.reshape(-1).contiguous()
    return _LinearCrossEntropy.apply(x2, weight, t, ignore_index, chunk,
                                     need_grad)


# ---- 5. accounting

def count_params(model):
    """Number of parameters, shared (tied) tensors counted once."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(vocab_size, context_length, d_model, num_layers, d_ff,
                    causal=True):
    """Training FLOPs per token, 3 x forward; forward per T tokens is
    L (8 T d^2 + 4 T^2 d + 6 T d d_ff) + 2 T d V (a matmul (m x n)(n x p)
    is 2mnp); causal halves the T^2 term, as the kernels do."""
    T, d = context_length, d_model
    attn_t2 = (2 if causal else 4) * T * T * d
    per_layer = 8 * T * d * d + attn_t2 + 6 * T * d * d_ff
    forward = num_layers * per_layer + 2 * T * d * vocab_size
    return 3 * forward / T


PRESETS = {
    "small": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": dict(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
    "2.7B": dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
    "gpt2-xl": dict(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "10B": dict(d_model=4608, d_ff=12288, num_layers=50, num_heads=36),
}


# ---- 6. checkpoints

def unwrap(model):
    """The model under torch.compile's and data-parallel wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return model


def crc_failure(path):
    """The first part of a zip (torch.save's format) failing its CRC-32,
    or None (torch.load never checks them)."""
    with zipfile.ZipFile(path) as z:
        return z.testzip()


def _checked_archive(path):
    """A one-line RuntimeError unless `path` is a whole, undamaged zip."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"PK\x03\x04":
        raise RuntimeError(f"{path} is not a checkpoint: torch.save writes "
                           f"a zip archive, this file starts with {head!r}")
    if not zipfile.is_zipfile(path):
        raise RuntimeError(f"checkpoint {path} is truncated or corrupt: its "
                           f"zip directory is missing")
    bad = crc_failure(path)
    if bad:
        raise RuntimeError(f"checkpoint {path} is damaged: its part {bad} "
                           f"does not match the CRC-32 saved with it (a disk "
                           f"or copy error)")


def read_checkpoint(src, needs=("model", "iteration")):
    """torch.load (weights only) of a path or file onto the CPU, checked:
    a missing or damaged file, or one without the keys `needs`, is a
    one-line FileNotFoundError or RuntimeError."""
    if isinstance(src, (str, os.PathLike)):
        if not os.path.isfile(src):
            raise FileNotFoundError(f"checkpoint {src} not found (train "
                                    f"with `python train.py` first)")
        _checked_archive(src)
    try:
        ckpt = torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's message would suggest the unsafe full unpickler
        raise RuntimeError(f"checkpoint {src} holds Python objects other "
                           f"than tensors, numbers, strings and containers: "
                           f"not a train.py checkpoint, and it is not "
                           f"loaded") from None
    except Exception as e:
        detail = (str(e).strip().splitlines() or [""])[0]
        if not detail or "weights_only" in detail:
            detail = type(e).__name__
        raise RuntimeError(f"checkpoint {src} is truncated or corrupt and "
                           f"cannot be loaded ({detail})") from None
    missing = [key for key in needs
               if not isinstance(ckpt, dict) or key not in ckpt]
    if missing:
        raise RuntimeError(f"checkpoint {src} is not a train.py checkpoint "
                           f"(it has no {', '.join(missing)})")
    return ckpt
