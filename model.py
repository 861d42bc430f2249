"""A Llama-style Transformer language model (pre-norm, RMSNorm, SwiGLU, RoPE, no biases) from plain tensor ops.

  1. basic modules   Linear (with _AutocastLinear), Embedding, RMSNorm, SwiGLU, apply_rope / RotaryEmbedding
  2. attention       softmax, scaled_dot_product_attention, masks and positions of packed documents, KVCache
  3. the model       CausalSelfAttention, TransformerBlock (recomputation policy), TransformerLM
  4. loss            cross_entropy, linear_cross_entropy (the fused LM head, never the whole logits)
  5. accounting      count_params, flops_per_token, PRESETS
  6. checkpoints     read_checkpoint: a train.py checkpoint, checked, for every script

The state dict uses the course's reference layout, so checkpoints move both ways:
token_embeddings.weight, layers.{i}.ln1.weight, layers.{i}.attn.{q_proj,k_proj,v_proj,output_proj}.weight,
layers.{i}.ln2.weight, layers.{i}.ffn.{w1,w2,w3}.weight, ln_final.weight, lm_head.weight.

attn_impl picks the attention kernel (an attribute read at call time, so it can change after construction):
    "naive"      our scaled_dot_product_attention (the reference; O(T^2) memory)
    "sdpa"       torch's F.scaled_dot_product_attention (a baseline)
    "flash"      flash.py's FlashAttention (flash_attention / flash_attn_varlen; Triton, Gluon on Hopper)
    "flash_ref"  flash.py's tiled PyTorch twin of that kernel
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
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import flash

ATTN_IMPLS = ("naive", "sdpa", "flash", "flash_ref")


def auto_attn_impl(device_type, packed):
    """train.py's attn_impl="auto": on CUDA, flash for packed documents (sdpa would pad
    each to the longest) and sdpa for dense batches (where the two are level, LOG.md);
    naive elsewhere (the CPU reference)."""
    return "naive" if device_type != "cuda" else "flash" if packed else "sdpa"


def upcast(x):
    """At least fp32 (bf16/fp16 -> fp32; fp64 stays fp64, so float64 tests keep their precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def autocast_dtype(x):
    """The dtype autocast gives matmuls on x's device, or None when autocast is off there."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None


# ---------------------------------------------------------------------------------------------------------------
# 1. basic modules

def weight_grad(g, x, dtype):
    """g^T x (g (N, out), x (N, in), one dtype) returned in dtype (the weight's: fp32 master weights): on CUDA one
    GEMM that writes dtype itself, with no half-precision rounding and no second pass to cast; else the product cast."""
    if g.dtype != dtype and g.is_cuda:
        return torch.mm(g.t(), x, out_dtype=dtype)
    return g.t().mm(x).to(dtype)


class _AutocastLinear(torch.autograd.Function):
    """Linear's x W^T under autocast with a weight of another dtype (fp32 master weights): autocast's product (x, W
    cast to its dtype and saved), but the weight gradient written in the weight's dtype by its GEMM (weight_grad),
    not rounded to half precision and cast back by a pass of its own. The input gradient is g W, as autocast's."""

    @staticmethod
    def forward(ctx, x, weight, dtype):
        with torch.autocast(x.device.type, enabled=False):
            x2, w = x.reshape(-1, x.shape[-1]).to(dtype), weight.to(dtype)
            y = x2.mm(w.t())
        ctx.save_for_backward(x2, w)
        ctx.x_shape, ctx.w_dtype = x.shape, weight.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x2, w = ctx.saved_tensors
        g2 = grad_y.reshape(-1, grad_y.shape[-1]).to(x2.dtype)
        grad_x = g2.mm(w).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grad_w = weight_grad(g2, x2, ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


class Linear(nn.Module):
    """y = x W^T, no bias; W (out, in) ~ truncated normal, sigma^2 = 2 / (in + out), cut at +-3 sigma."""

    def __init__(self, in_features, out_features, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        std = math.sqrt(2.0 / (in_features + out_features))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x):
        dtype = autocast_dtype(x)
        if dtype is not None and dtype != self.weight.dtype and torch.is_grad_enabled() and self.weight.requires_grad:
            return _AutocastLinear.apply(x, self.weight, dtype)
        return x @ self.weight.T

    def cross_entropy(self, x, targets, ignore_index=-100):
        """cross_entropy(self(x), targets) by linear_cross_entropy (a method, so ddp.FSDP's wrapper can supply W)."""
        return linear_cross_entropy(x, self.weight, targets, ignore_index)


class Embedding(nn.Module):
    """Lookup table weight (num_embeddings, embedding_dim) ~ truncated normal, sigma 1, cut at +-3."""

    def __init__(self, num_embeddings, embedding_dim, device=None, dtype=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids):
        return self.weight[token_ids]


class RMSNorm(nn.Module):
    """out = x / sqrt(mean(x^2) + eps) * g, computed in fp32 (squares overflow in half precision), returned in the
    input's dtype. impl (an attribute read at call time): "torch", these PyTorch ops (the default), or "triton",
    flash.rms_norm's kernels (CUDA, or the interpreter on CPU; fp16/bf16/fp32)."""

    def __init__(self, d_model, eps=1e-5, device=None, dtype=None, impl="torch"):
        super().__init__()
        self.eps, self.impl = eps, impl
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x):
        if self.impl == "triton":
            return flash.rms_norm(x, self.weight, self.eps)
        if self.impl != "torch":
            raise ValueError(f"RMSNorm.impl={self.impl!r}: expected 'torch' or 'triton'")
        xf = upcast(x)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(xf.dtype)).to(x.dtype)


def set_norm_impl(module, impl):
    """Every RMSNorm inside module on impl ("torch" or "triton"; a TransformerBlock whose two norms are on "triton"
    also fuses their residual adds). Returns module."""
    if impl not in ("torch", "triton"):
        raise ValueError(f"set_norm_impl: impl={impl!r}, expected 'torch' or 'triton'")
    for m in module.modules():
        if isinstance(m, RMSNorm):
            m.impl = impl
    return module


def silu(x):
    """SiLU(x) = x * sigmoid(x)."""
    return x * torch.sigmoid(x)


class SwiGLU(nn.Module):
    """FFN(x) = W2 (SiLU(W1 x) * W3 x); d_ff defaults to (8/3) d rounded to a multiple of 64."""

    def __init__(self, d_model, d_ff=None, device=None, dtype=None):
        super().__init__()
        d_ff = 64 * round(8 * d_model / 192) if d_ff is None else d_ff
        self.w1, self.w2, self.w3 = (Linear(a, b, device=device, dtype=dtype)
                                     for a, b in ((d_model, d_ff), (d_ff, d_model), (d_model, d_ff)))

    def forward(self, x):
        return self.w2(silu(self.w1(x)) * self.w3(x))


def apply_rope(x, cos, sin):
    """Rotate interleaved pairs (x[2j], x[2j+1]) of the last dim by angles whose cos/sin broadcast against
    x[..., ::2], in at least fp32. Written as x * C + swap(x) * S with C = (c0, c0, c1, c1, ...), S = (-s0, s0, -s1,
    s1, ...): elementwise terms and a fixed reindexing only, so torch.compile makes one kernel of it each way."""
    xf = upcast(x)
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    c = cos.repeat_interleave(2, dim=-1)
    s = torch.stack((-sin, sin), dim=-1).flatten(-2)
    return (xf * c + swapped * s).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE: pair j of the head vector at position i turns by angle i * theta^(-2j / d_k): x'[2j] = x[2j] cos -
    x[2j+1] sin, x'[2j+1] = x[2j] sin + x[2j+1] cos; cos/sin tables (context_length, d_k/2), non-persistent buffers.
    forward(x (..., T, d_k), position_ids (..., T) broadcasting over x's leading dims; default 0..T-1)."""

    def __init__(self, theta, d_k, context_length, device=None):
        super().__init__()
        if d_k % 2:
            raise ValueError(f"RoPE needs an even head dimension, got d_k={d_k}")
        inv_freq = theta ** (-torch.arange(0, d_k, 2, device=device, dtype=torch.float64) / d_k)
        angles = torch.outer(torch.arange(context_length, device=device, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x, position_ids=None):
        pos = torch.arange(x.shape[-2], device=x.device) if position_ids is None else position_ids
        return apply_rope(x, self.cos[pos], self.sin[pos])


# ---------------------------------------------------------------------------------------------------------------
# 2. attention: softmax, the reference attention, packed documents, the KV cache

def softmax(x, dim):
    """Subtract the max along dim before exponentiating (softmax is shift invariant; avoids inf / inf)."""
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


def scaled_dot_product_attention(q, k, v, mask=None):
    """softmax(Q K^T / sqrt(d_k)) V with q (..., n, d_k), k (..., m, d_k), v (..., m, d_v); mask (n, m) boolean,
    broadcastable, True = query i may attend key j. Scores and softmax run in at least fp32."""
    scores = upcast(q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores, dim=-1).to(v.dtype) @ v


def causal_mask(n, device):
    """(n, n) boolean, True where key j <= query i; built per call, so no O(context_length^2) buffer is kept."""
    i = torch.arange(n, device=device)
    return i[:, None] >= i[None, :]


def document_ids(cu_seqlens, n):
    """Document of each of n packed rows, on the device: doc(t) = k such that cu_seqlens[k] <= t < cu_seqlens[k+1]."""
    t = torch.arange(n, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), t, right=True)


def packed_positions(cu_seqlens, n):
    """RoPE positions that restart in every packed document: pos(t) = t - cu_seqlens[doc(t)]."""
    return torch.arange(n, device=cu_seqlens.device) - cu_seqlens[document_ids(cu_seqlens, n)].long()


def block_diagonal_causal_mask(cu_seqlens, n):
    """(n, n) boolean, the dense reference for packed attention: row t may attend row s iff doc(t) == doc(s), s <= t."""
    doc = document_ids(cu_seqlens, n)
    return (doc[:, None] == doc[None, :]) & causal_mask(n, cu_seqlens.device)


class KVCache:
    """Keys and values of earlier tokens for decoding (sample.py), one buffer per layer. Slot s of row b holds that
    row's token at position s, so rows of different lengths (right-padded prompts) share one cache: a query at
    position p attends slots 0..p of its row. `length`, a Python int that TransformerLM.forward advances, counts the
    slots any row may have written."""

    def __init__(self, num_layers, batch_size, max_len, num_heads, d_head, device=None, dtype=torch.float32):
        shape = (num_layers, batch_size, max_len, num_heads, d_head)
        self.k, self.v = torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)
        self.max_len, self.length = max_len, 0

    def update(self, layer_idx, k, v, position_ids):
        """Write k, v (B, T, H, D) at slots position_ids (B, T); return the keys and values of the slots in use."""
        end = self.length + k.shape[1]
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.k[layer_idx][rows, position_ids] = k.to(self.k.dtype)
        self.v[layer_idx][rows, position_ids] = v.to(self.v.dtype)
        return self.k[layer_idx, :, :end], self.v[layer_idx, :, :end]


# ---------------------------------------------------------------------------------------------------------------
# 3. the model: attention layer, block, language model

class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE on q and k. q_proj, k_proj, v_proj are three modules (the
    reference names), each called as a module, so a wrapper acting per Linear (ddp.FSDP) sees every projection; one
    fused qkv matmul lost (LOG.md). Heads stay (B, T, H, d_k) in memory; flash and sdpa get (B, H, T, d_k) views."""

    def __init__(self, d_model, num_heads, context_length, theta=10000.0, attn_impl="naive", rope=None,
                 layer_idx=0, device=None, dtype=None):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={attn_impl!r}: expected one of {ATTN_IMPLS}")
        self.num_heads, self.d_head = num_heads, d_model // num_heads
        self.attn_impl, self.layer_idx = attn_impl, layer_idx  # layer_idx: which KVCache buffer this layer uses
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (
            Linear(d_model, d_model, device=device, dtype=dtype) for _ in range(4))
        if rope is None and theta is not None:
            rope = RotaryEmbedding(theta, self.d_head, context_length, device=device)
        self.rope = rope  # shared by all layers of a TransformerLM; None = no positional encoding (NoPE)

    def forward(self, x, position_ids=None, cu_seqlens=None, max_seqlen=None, kv_cache=None):
        """x (B, T, d). position_ids (..., T) broadcast over the batch (default 0..T-1). Packed mode: B == 1,
        cu_seqlens/max_seqlen mark the documents (attention stays inside each). kv_cache: decoding, see KVCache."""
        B, T, d = x.shape
        q, k, v = (proj(x).view(B, T, self.num_heads, self.d_head) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.rope is not None:  # positions (..., T, 1) broadcast over the heads of q, k (B, T, H, d_k)
            position_ids = torch.arange(T, device=x.device) if position_ids is None else position_ids
            q, k = self.rope(q, position_ids[..., None]), self.rope(k, position_ids[..., None])
        if kv_cache is not None:  # queries and keys differ in length: the masked path for every attn_impl
            position_ids = position_ids.expand(B, T)
            k, v = (t.to(q.dtype) for t in kv_cache.update(self.layer_idx, k, v, position_ids))
            out = self._masked(q, k, v, torch.arange(k.shape[1], device=x.device) <= position_ids[:, None, :, None])
        elif self.attn_impl in ("naive", "sdpa") and cu_seqlens is not None:
            out = self._per_document(q, k, v, cu_seqlens, max_seqlen)
        elif self.attn_impl in ("naive", "sdpa"):
            out = self._masked(q, k, v)
        elif self.attn_impl == "flash_ref":
            out = self._flash_ref(q, k, v, cu_seqlens)
        elif cu_seqlens is not None:
            out = flash.flash_attn_varlen(q[0], k[0], v[0], cu_seqlens, max_seqlen, causal=True)[None]
        else:
            heads = lambda t: t.transpose(1, 2)  # (B, T, H, D) <-> (B, H, T, D), a view
            out = heads(flash.flash_attention(heads(q), heads(k), heads(v), causal=True))
        return self.output_proj(out.reshape(B, T, d))

    def _masked(self, q, k, v, mask=None):
        """q (B, T, H, D), k and v (B, S, H, D), a boolean mask broadcasting to (B, H, T, S) (None: causal): sdpa
        when selected, else ours. (B, T, H, D) out, a strided view."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.attn_impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, mask, is_causal=mask is None).transpose(1, 2)
        mask = causal_mask(q.shape[2], q.device) if mask is None else mask
        return scaled_dot_product_attention(q, k, v, mask).transpose(1, 2)

    def _per_document(self, q, k, v, cu_seqlens, max_seqlen):
        """Packed documents as a right-padded (num_docs, max_seqlen) batch, one causal call,
        gathered back: a document's attention costs its length squared, not the row's."""
        n = q.shape[1]
        where = document_ids(cu_seqlens, n), packed_positions(cu_seqlens, n)
        shape = (len(cu_seqlens) - 1, max_seqlen, *q.shape[2:])

        def padded(t):
            return t.new_zeros(shape).index_put(where, t[0])
        return self._masked(padded(q), padded(k), padded(v))[where][None]

    def _flash_ref(self, q, k, v, cu_seqlens):
        """The tiled PyTorch twin, one document at a time (packed: reads cu_seqlens on the host; a reference path)."""
        cu = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != q.shape[1] or any(a > b for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to the {q.shape[1]} packed tokens, got {cu}")
        doc = lambda t, a, b: t[:, a:b].transpose(1, 2)  # (B, len, H, D) -> (B, H, len, D), a view
        outs = [flash.FlashAttentionPyTorch.apply(doc(q, a, b), doc(k, a, b), doc(v, a, b), True)
                for a, b in zip(cu, cu[1:]) if b > a]
        return torch.cat(outs, dim=2).transpose(1, 2)


class TransformerBlock(nn.Module):
    """Pre-norm block: z = x + MHSA(RMSNorm1(x)); y = z + FFN(RMSNorm2(z)). With both norms on impl="triton", each
    norm runs with its residual add as flash.add_rms_norm: one kernel for z and RMSNorm2(z), one for their gradients."""

    def __init__(self, d_model, num_heads, d_ff, context_length, theta=10000.0, attn_impl="naive", rope=None,
                 layer_idx=0, device=None, dtype=None):
        super().__init__()
        self.ln1 = RMSNorm(d_model, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, num_heads, context_length, theta, attn_impl=attn_impl, rope=rope,
                                        layer_idx=layer_idx, device=device, dtype=dtype)
        self.ln2 = RMSNorm(d_model, device=device, dtype=dtype)
        self.ffn = SwiGLU(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x, position_ids=None, cu_seqlens=None, max_seqlen=None, kv_cache=None, selective=False):
        """selective=True (while training): keep only the matmul and attention outputs for the backward."""
        if selective and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, position_ids, cu_seqlens, max_seqlen, kv_cache, use_reentrant=False,
                              context_fn=_selective_recompute_context)
        return self._forward(x, position_ids, cu_seqlens, max_seqlen, kv_cache)

    def _forward(self, x, position_ids, cu_seqlens, max_seqlen, kv_cache):
        if self.ln1.impl == "triton" and self.ln2.impl == "triton":  # each norm with its residual add, one kernel
            dtype = autocast_dtype(x)  # the norms write what the matmuls read (autocast would cast it)
            x, y = flash.add_rms_norm(x, None, self.ln1.weight, self.ln1.eps, dtype)
            x, y = flash.add_rms_norm(x, self.attn(y, position_ids, cu_seqlens, max_seqlen, kv_cache),
                                      self.ln2.weight, self.ln2.eps, dtype)
            return x + self.ffn(y)
        x = x + self.attn(self.ln1(x), position_ids, cu_seqlens, max_seqlen, kv_cache)
        return x + self.ffn(self.ln2(x))


def _selective_recompute_context():
    """torch.utils.checkpoint's context_fn for selective recomputation: a block keeps the outputs of its matmuls and
    of attention and recomputes the rest in the backward (RMSNorm, RoPE, SiLU(a) * b, the weights' autocast casts):
    elementwise work, cheap to redo, whose outputs are as large as the matmuls'."""
    aten = torch.ops.aten
    sdpa = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
    saved = {aten.mm.default, aten.addmm.default, aten.bmm.default, torch.ops.flash.attention_fwd.default}
    saved |= {getattr(aten, name).default for name in sdpa if hasattr(aten, name)}
    keep = CheckpointPolicy.MUST_SAVE
    return create_selective_checkpoint_contexts(
        lambda ctx, op, *args, **kwargs: keep if op in saved else CheckpointPolicy.PREFER_RECOMPUTE)


class TransformerLM(nn.Module):
    """token_embeddings -> num_layers pre-norm blocks -> ln_final -> lm_head. rope_theta=None disables RoPE.
    tie_embeddings shares one (vocab_size, d_model) matrix between the embedding and lm_head, initialised like a
    Linear (std sqrt(2 / (V + d))) since std 1 would blow up the logits. Recomputation while training:
    act_ckpt_every=k > 0 checkpoints segments of k consecutive blocks (only the segment's input is kept), over the
    first act_ckpt_layers blocks (None: all of them); selective_recompute=True makes every other block keep only
    its matmul and attention outputs (_selective_recompute_context)."""

    def __init__(self, vocab_size, context_length, d_model, num_layers, num_heads, d_ff, rope_theta=10000.0,
                 attn_impl="naive", tie_embeddings=False, act_ckpt_every=0, act_ckpt_layers=None,
                 selective_recompute=False, device=None, dtype=None):
        super().__init__()
        if act_ckpt_every < 0:
            raise ValueError(f"act_ckpt_every={act_ckpt_every} must be >= 0 (0 = no activation checkpointing)")
        if act_ckpt_layers is not None and not 0 <= act_ckpt_layers <= num_layers:
            raise ValueError(f"act_ckpt_layers={act_ckpt_layers} must lie in [0, num_layers={num_layers}] (None: all)")
        self.vocab_size, self.context_length = vocab_size, context_length
        self.d_model, self.num_layers, self.num_heads = d_model, num_layers, num_heads
        self.act_ckpt_every, self.act_ckpt_layers = act_ckpt_every, act_ckpt_layers  # read at call time
        self.selective_recompute = selective_recompute
        self.token_embeddings = Embedding(vocab_size, d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList()
        for i in range(num_layers):  # the first layer builds the RoPE table (not in the state dict), the rest share it
            self.layers.append(TransformerBlock(d_model, num_heads, d_ff, context_length, rope_theta, attn_impl,
                                                rope=self.layers[0].attn.rope if i else None, layer_idx=i,
                                                device=device, dtype=dtype))
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
            raise ValueError(f"attn_impl={value!r}: expected one of {ATTN_IMPLS}")
        self._attn_impl = value
        for layer in self.layers:
            layer.attn.attn_impl = value

    def make_kv_cache(self, batch_size, max_len=None, device=None, dtype=torch.float32):
        """An empty KVCache for this model (max_len defaults to context_length, the RoPE table size)."""
        return KVCache(self.num_layers, batch_size, self.context_length if max_len is None else max_len,
                       self.num_heads, self.d_model // self.num_heads, dtype=dtype,
                       device=self.lm_head.weight.device if device is None else device)

    def forward(self, idx, cu_seqlens=None, max_seqlen=None, position_ids=None, kv_cache=None, targets=None):
        """idx (B, T) int64 -> logits (B, T, vocab_size); with targets (B, T): the mean cross-entropy instead, by
        the fused head (linear_cross_entropy, targets == -100 ignored), so the logits never exist whole.
        Packed mode: idx (1, N) holds documents back to back, cu_seqlens (int32, num_docs + 1) their boundaries and
        max_seqlen (Python int) the longest; attention stays inside each document and RoPE positions restart at 0
        in each. position_ids (B, T) or (T,): explicit RoPE positions (default 0..T-1).
        kv_cache (KVCache): decoding; position_ids are then required and also name the cache slot of every token."""
        B, T = idx.shape
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"packed mode takes idx of shape (1, N), got {tuple(idx.shape)}")
            if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
                raise ValueError("cu_seqlens must be a 1-D int32 tensor (num_docs + 1 offsets)")
            if not isinstance(max_seqlen, numbers.Integral):
                raise ValueError("packed mode needs max_seqlen as a Python int (the longest document)")
            max_seqlen = int(max_seqlen)  # a NumPy integer becomes the plain int the kernel grid wants
            if max_seqlen > self.context_length:
                raise ValueError(f"max_seqlen={max_seqlen} exceeds context_length {self.context_length}")
            if position_ids is None:
                position_ids = packed_positions(cu_seqlens, T)
        elif kv_cache is not None:
            if position_ids is None:
                raise ValueError("decoding with a kv_cache needs position_ids (the slot of every token)")
            if kv_cache.length + T > kv_cache.max_len:
                raise ValueError(f"KV cache full: {kv_cache.length} + {T} tokens > {kv_cache.max_len} slots")
        elif position_ids is None and T > self.context_length:
            raise ValueError(f"sequence of {T} tokens exceeds context_length {self.context_length}")

        x, args = self.token_embeddings(idx), (position_ids, cu_seqlens, max_seqlen, kv_cache)
        seg, n_full = self.act_ckpt_every, 0  # the first n_full blocks are checkpointed in segments of seg
        if seg and self.training and torch.is_grad_enabled():
            n_full = min(self.num_layers if self.act_ckpt_layers is None else self.act_ckpt_layers, self.num_layers)
        for start in range(0, n_full, max(seg, 1)):  # each segment keeps only its input
            x = checkpoint(self._run_layers, x, start, min(start + seg, n_full), *args, use_reentrant=False)
        x = self._run_layers(x, n_full, self.num_layers, *args, selective=self.selective_recompute)
        if kv_cache is not None:
            kv_cache.length += T
        h = self.ln_final(x)
        return self.lm_head(h) if targets is None else self.lm_head.cross_entropy(h, targets)

    def _run_layers(self, x, start, end, position_ids, cu_seqlens, max_seqlen, kv_cache=None, selective=False):
        for layer in self.layers[start:end]:
            x = layer(x, position_ids, cu_seqlens, max_seqlen, kv_cache, selective=selective)
        return x


# ---------------------------------------------------------------------------------------------------------------
# 4. loss: cross_entropy and the fused head

class _CrossEntropy(torch.autograd.Function):
    """Forward: loss_i = logsumexp(o_i) - o_i[target_i] in fp32; backward written out: d loss / d o = (softmax(o) -
    onehot(target)) / count, one elementwise pass over the logits (autograd's own backward of the gather would build
    a dense fp32 zero tensor of the logits' size and scatter into it)."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        o = upcast(logits)
        m = o.amax(dim=-1, keepdim=True)
        lse = (m + torch.log(torch.exp(o - m).sum(dim=-1, keepdim=True))).squeeze(-1)
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
        onehot = torch.arange(o.shape[-1], device=o.device) == safe.unsqueeze(-1)
        scale = torch.where(keep, grad / count, 0.0).unsqueeze(-1)
        return ((torch.exp(o - lse.unsqueeze(-1)) - onehot.to(o.dtype)) * scale).to(logits.dtype), None, None


def cross_entropy(logits, targets, ignore_index=-100):
    """Mean over non-ignored targets of logsumexp(o) - o[target]; logits (..., V) upcast to fp32, targets (...).
    Targets equal to ignore_index (padding, document ends) contribute nothing; if every target is ignored the
    result is 0 rather than 0/0, so an all-padding micro-batch cannot poison gradient accumulation."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} need targets of shape "
                         f"{tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
    return _CrossEntropy.apply(logits, targets, ignore_index)


def _add_matmul(acc, a, b):
    """acc + a @ b with acc fp32 and a, b possibly half precision: on CUDA one GEMM with a 32-bit output."""
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    if a.is_cuda:
        with contextlib.suppress(RuntimeError):  # a build without the mixed-precision GEMM
            return torch.addmm(acc, a, b, out_dtype=acc.dtype)
    return acc.add_(a @ b)


def fused_head(x, weight, targets, ignore_index, chunk, need_grad):
    """(mean loss, dL/dx, dL/dweight) of cross_entropy(x @ weight^T, targets) for x (N, d) and weight (V, d) of
    one dtype, chunk tokens at a time: each chunk's logits are turned into their gradient in place
    (flash.cross_entropy_rows: dO_i = (softmax(o_i) - onehot(t_i)) / count) and consumed at once by the two backward
    matmuls, dx_chunk = dO W and dW += dO^T x_chunk (fp32). need_grad=False (evaluation) skips those two (dx and dW
    come back empty). Under torch.compile a custom op, so the compiler sees the chunk loop as one opaque step."""
    if torch.compiler.is_compiling():
        return _fused_head_op(x, weight, targets, ignore_index, chunk, need_grad)
    count = (targets != ignore_index).sum().clamp(min=1)
    acc_dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 stays fp64, for tests)
    scale = (1.0 / count.to(acc_dtype)).reshape(1)
    loss_rows = torch.empty(x.shape[0], dtype=acc_dtype, device=x.device)
    dx = torch.empty_like(x) if need_grad else x.new_empty(0)
    dw = torch.zeros(weight.shape if need_grad else 0, dtype=acc_dtype, device=x.device)
    for start in range(0, x.shape[0], chunk):
        rows = slice(start, start + chunk)
        logits = x[rows] @ weight.T
        flash.cross_entropy_rows(logits, targets[rows], ignore_index, scale, loss_rows[rows])
        if need_grad:
            torch.mm(logits, weight, out=dx[rows])
            dw = _add_matmul(dw, logits.T, x[rows])
    return loss_rows.sum() * scale[0], dx, dw


@torch.library.custom_op("model::fused_head", mutates_args=())
def _fused_head_op(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, chunk: int,
                   need_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fused_head(x, weight, targets, ignore_index, chunk, need_grad)


@_fused_head_op.register_fake
def _(x, weight, targets, ignore_index, chunk, need_grad):
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    return (x.new_empty((), dtype=acc_dtype), torch.empty_like(x) if need_grad else x.new_empty(0),
            weight.new_empty(weight.shape if need_grad else 0, dtype=acc_dtype))


def head_dtype(x, weight):
    """The dtype of the head's matmul: autocast's when it is on (as the unfused head's would be), else theirs."""
    return autocast_dtype(x) or torch.promote_types(x.dtype, weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """The fused head with autograd: the forward computes both gradients too, the backward only scales them. x and
    weight are cast to the autocast dtype first, as the unfused head's matmul would be."""

    @staticmethod
    def forward(ctx, x, weight, targets, ignore_index, chunk, need_grad):
        dtype = head_dtype(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            loss, dx, dw = fused_head(x.to(dtype), weight.to(dtype), targets, ignore_index, chunk, need_grad)
        ctx.save_for_backward(dx, dw)
        ctx.dtypes = (x.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad):
        (dx, dw), (x_dtype, w_dtype) = ctx.saved_tensors, ctx.dtypes
        return (dx * grad).to(x_dtype), (dw * grad).to(w_dtype), None, None, None, None


def head_chunk(vocab_size):
    """Tokens per chunk of the fused head: as many as make 2^28 logits (half a GiB in bf16)."""
    return max(1, 2 ** 28 // vocab_size)


def linear_cross_entropy(x, weight, targets, ignore_index=-100, chunk=None):
    """cross_entropy(x @ weight.T, targets) with x (..., d) and weight (V, d), without materializing the
    (tokens x V) logits: chunk tokens at a time (default head_chunk). Same value and gradients up to rounding."""
    if x.shape[:-1] != targets.shape:
        raise ValueError(f"linear_cross_entropy: x {tuple(x.shape)} needs targets of shape {tuple(x.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    chunk = head_chunk(weight.shape[0]) if chunk is None else chunk
    need_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)  # evaluation: no dx, dW
    x2, t = x.reshape(-1, x.shape[-1]), targets.reshape(-1).contiguous()
    return _LinearCrossEntropy.apply(x2, weight, t, ignore_index, chunk, need_grad)


# ---------------------------------------------------------------------------------------------------------------
# 5. parameter and FLOP accounting, size presets

def count_params(model):
    """Number of parameters, shared (tied) tensors counted once."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(vocab_size, context_length, d_model, num_layers, d_ff, causal=True):
    """Training FLOPs per token = 3 x forward (backward = 2 x forward; a matmul (m x n)(n x p) is 2mnp). Forward per
    sequence of T tokens: L (8 T d^2 + 4 T^2 d + 6 T d d_ff) + 2 T d V; causal halves the T^2 terms, as kernels do."""
    T, d = context_length, d_model
    attn_t2 = (2 if causal else 4) * T * T * d
    forward = num_layers * (8 * T * d * d + attn_t2 + 6 * T * d * d_ff) + 2 * T * d * vocab_size
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


# ---------------------------------------------------------------------------------------------------------------
# 6. checkpoints: one reader for train.py and sample.py

def crc_failure(path):
    """The first part of a zip (torch.save's format) whose bytes do not match their
    CRC-32, or None. torch.load never checks these."""
    with zipfile.ZipFile(path) as z:
        return z.testzip()


def _checked_archive(path):
    """A one-line RuntimeError unless `path` is a whole, undamaged zip archive."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"PK\x03\x04":
        raise RuntimeError(f"{path} is not a checkpoint: torch.save writes a zip archive, "
                           f"this file starts with {head!r}")
    if not zipfile.is_zipfile(path):
        raise RuntimeError(f"checkpoint {path} is truncated or corrupt: its zip directory "
                           f"is missing")
    bad = crc_failure(path)
    if bad:
        raise RuntimeError(f"checkpoint {path} is damaged: its part {bad} does not match "
                           f"the CRC-32 saved with it (a disk or copy error)")


def read_checkpoint(src, needs=("model", "iteration")):
    """torch.load (weights only) of a path or file object onto the CPU, checked first: a
    missing, truncated or damaged file, or one that is not a train.py checkpoint holding
    the keys `needs`, is an error of one line (FileNotFoundError or RuntimeError)."""
    path = isinstance(src, (str, os.PathLike))
    if path and not os.path.isfile(src):
        raise FileNotFoundError(f"checkpoint {src} not found (train with `python train.py` "
                                f"first)")
    if path:
        _checked_archive(src)
    try:
        ckpt = torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's message suggests the unsafe full unpickler
        raise RuntimeError(f"checkpoint {src} holds Python objects other than tensors, "
                           f"numbers, strings and containers: not a train.py checkpoint, "
                           f"and it is not loaded") from None
    except Exception as e:
        detail = (str(e).strip().splitlines() or [""])[0]
        if not detail or "weights_only" in detail:
            detail = type(e).__name__
        raise RuntimeError(f"checkpoint {src} is truncated or corrupt and cannot be loaded "
                           f"({detail})") from None
    missing = [key for key in needs if not isinstance(ckpt, dict) or key not in ckpt]
    if missing:
        raise RuntimeError(f"checkpoint {src} is not a train.py checkpoint (it has no "
                           f"{', '.join(missing)})")
    return ckpt
