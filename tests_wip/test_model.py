import os, sys, torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path

_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent if _HERE.name == "tests_wip" else _HERE
sys.path.insert(0, str(ROOT))

import math
import subprocess
import unittest

import torch.nn.functional as F

import model
import sample
from model import (PRESETS, CausalSelfAttention, Embedding, Linear, RMSNorm, RotaryEmbedding, SwiGLU,
                   TransformerBlock, TransformerLM, count_params, cross_entropy, flops_per_token,
                   scaled_dot_product_attention, silu, softmax)


# --- model.py ---

def _tiny_lm(attn_impl="naive", dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(vocab_size=61, context_length=40, d_model=32, num_layers=2, num_heads=4, d_ff=72)
    args.update(kw)
    return TransformerLM(**args, attn_impl=attn_impl, dtype=dtype)


def test_linear_and_embedding_init_forward_and_weight_read_at_call_time():
    torch.manual_seed(0)
    lin = Linear(300, 200)
    std = math.sqrt(2 / 500)
    assert lin.weight.shape == (200, 300) and list(lin.state_dict()) == ["weight"]  # no bias
    assert lin.weight.abs().max() <= 3 * std + 1e-7 and abs(lin.weight.std().item() - std) < 0.1 * std
    x = torch.randn(2, 3, 300)
    assert torch.allclose(lin(x), torch.einsum("...i,oi->...o", x, lin.weight), atol=1e-5)
    lin.weight.data = torch.zeros_like(lin.weight)  # a swapped/cast weight must take effect
    assert lin(x).abs().max() == 0
    emb = Embedding(1000, 64)
    assert emb.weight.abs().max() <= 3 and abs(emb.weight.std().item() - 1) < 0.1
    ids = torch.randint(0, 1000, (4, 7))
    assert torch.equal(emb(ids), emb.weight[ids])


def test_rmsnorm_matches_formula_in_fp32_and_keeps_dtype():
    torch.manual_seed(0)
    norm = RMSNorm(37)
    norm.weight.data = torch.randn(37)
    x = torch.randn(3, 5, 37, dtype=torch.float64)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    assert torch.allclose(norm(x), ref, atol=1e-6)
    xb = (x * 300).bfloat16()  # squares of 300 overflow nothing in fp32, but the sum would lose bits in bf16
    out = norm(xb)
    assert out.dtype == torch.bfloat16
    ref_b = xb.double() / torch.sqrt(xb.double().pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    assert torch.allclose(out.double(), ref_b, rtol=1e-2, atol=1e-2)
    xh = torch.full((1, 37), 300.0, dtype=torch.float16)  # 300^2 = 90000 overflows fp16
    assert torch.isfinite(RMSNorm(37)(xh)).all()


def test_silu_and_swiglu_match_formula_and_default_d_ff():
    torch.manual_seed(0)
    x = torch.randn(4, 9, 24, dtype=torch.float64)
    assert torch.allclose(silu(x), F.silu(x))
    ffn = SwiGLU(24, 40, dtype=torch.float64)
    ref = (F.silu(x @ ffn.w1.weight.T) * (x @ ffn.w3.weight.T)) @ ffn.w2.weight.T
    assert torch.allclose(ffn(x), ref)
    assert SwiGLU(512).w1.weight.shape == (1344, 512)  # SPEC §2.3: 64 * round(8d / 192)


def test_rope_matches_complex_rotation_with_explicit_positions():
    torch.manual_seed(0)
    d_k, theta = 16, 10000.0
    rope = RotaryEmbedding(theta, d_k, max_seq_len=50)
    x = torch.randn(2, 3, 7, d_k, dtype=torch.float64)
    pos = torch.randint(0, 50, (2, 1, 7))  # broadcast over the middle (heads) dim
    j = torch.arange(d_k // 2, dtype=torch.float64)
    angle = pos[..., None].double() * theta ** (-2 * j / d_k)  # pair j rotates at theta^(-2j/d_k)
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(angle), angle)
    ref = torch.stack((z.real, z.imag), dim=-1).flatten(-2)  # pairs stay in place (interleaved layout)
    assert torch.allclose(rope(x, pos), ref, atol=1e-5)
    assert torch.allclose(rope(x), rope(x, torch.arange(7)))  # default positions 0..T-1
    assert not dict(rope.named_buffers(recurse=False)).keys() - {"cos", "sin"}
    assert rope.state_dict() == {}  # tables are non-persistent


def test_softmax_and_attention_match_reference_with_mask():
    torch.manual_seed(0)
    x = torch.randn(3, 11, dtype=torch.float64) * 1000  # huge logits: only a max-shift keeps this finite
    assert torch.allclose(softmax(x, -1), torch.softmax(x, -1))
    assert torch.allclose(softmax(x, 0), torch.softmax(x, 0))
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    k = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    v = torch.randn(2, 3, 9, 6, dtype=torch.float64)
    mask = torch.rand(5, 9) > 0.4
    mask[:, 0] = True
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    assert torch.allclose(scaled_dot_product_attention(q, k, v, mask), p @ v)
    assert torch.allclose(scaled_dot_product_attention(q, k, v), torch.softmax(s, -1) @ v)
    v_spike = v.clone()
    v_spike[..., ~mask.any(0), :] = 1e9  # keys nobody may see get exactly zero weight
    assert torch.allclose(scaled_dot_product_attention(q, k, v_spike, mask), p @ v)


def test_cross_entropy_matches_log_softmax_and_ignores_targets():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17, dtype=torch.float64) * 50
    targets = torch.randint(0, 17, (3, 5))
    ref = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).mean()
    assert torch.allclose(cross_entropy(logits, targets), ref)
    assert torch.allclose(cross_entropy(logits.view(15, 17), targets.view(15)), ref)
    targets[0, :3] = -100
    keep = targets != -100
    ref = -torch.log_softmax(logits, -1)[keep].gather(-1, targets[keep][:, None]).mean()
    assert torch.allclose(cross_entropy(logits, targets), ref)
    assert cross_entropy(logits, torch.full_like(targets, -100)).item() == 0  # all padding: 0, not NaN
    big = torch.tensor([[1e4, 0.0, -1e4]])
    assert torch.isfinite(cross_entropy(big.bfloat16(), torch.tensor([2]))).all()


def test_state_dict_has_reference_names_and_reference_weights_load_strictly():
    m = _tiny_lm()
    names = ["token_embeddings.weight"]
    for i in range(2):
        names += [f"layers.{i}.ln1.weight"] + [f"layers.{i}.attn.{p}.weight" for p in
                                              ("q_proj", "k_proj", "v_proj", "output_proj")]
        names += [f"layers.{i}.ln2.weight"] + [f"layers.{i}.ffn.{w}.weight" for w in ("w1", "w2", "w3")]
    names += ["ln_final.weight", "lm_head.weight"]
    assert list(m.state_dict()) == names
    block = TransformerBlock(32, 4, 72, 40, 10000.0)  # standalone, as the reference tests build it
    assert list(block.state_dict()) == [n[len("layers.0."):] for n in names if n.startswith("layers.0.")]
    shapes = {n: t.shape for n, t in m.state_dict().items()}
    assert shapes["layers.0.ffn.w1.weight"] == (72, 32) and shapes["layers.0.ffn.w2.weight"] == (32, 72)
    torch.manual_seed(1)
    reference = {n: torch.randn(s) for n, s in shapes.items()}  # e.g. a checkpoint of the course's reference model
    m.load_state_dict(reference, strict=True)
    assert all(torch.equal(t, reference[n]) for n, t in m.state_dict().items())
    tied = _tiny_lm(tie_embeddings=True)
    assert tied.lm_head.weight is tied.token_embeddings.weight
    assert count_params(tied) == count_params(m) - 61 * 32
    tied.load_state_dict(tied.state_dict(), strict=True)


def _functional_reference_lm(sd, idx, num_layers, num_heads, theta=10000.0):
    """The whole LM written again from torch's own ops, float64, complex-number RoPE."""
    x = sd["token_embeddings.weight"][idx]
    B, T, d = x.shape
    D = d // num_heads
    j = torch.arange(D // 2, dtype=torch.float64)
    rot = torch.polar(torch.ones(T, D // 2, dtype=torch.float64),
                      torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-2 * j / D))

    def rope(t):  # (B, H, T, D)
        z = torch.view_as_complex(t.reshape(*t.shape[:-1], D // 2, 2).contiguous()) * rot
        return torch.view_as_real(z).flatten(-2)

    for i in range(num_layers):
        p = lambda n: sd[f"layers.{i}.{n}.weight"]
        h = F.rms_norm(x, (d,), p("ln1"), eps=1e-5)
        q, k, v = (F.linear(h, p(f"attn.{n}")).view(B, T, num_heads, D).transpose(1, 2)
                   for n in ("q_proj", "k_proj", "v_proj"))
        a = torch.softmax((rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(D)).masked_fill(
            torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")), -1) @ v
        x = x + F.linear(a.transpose(1, 2).reshape(B, T, d), p("attn.output_proj"))
        h = F.rms_norm(x, (d,), p("ln2"), eps=1e-5)
        x = x + F.linear(F.silu(F.linear(h, p("ffn.w1"))) * F.linear(h, p("ffn.w3")), p("ffn.w2"))
    return F.linear(F.rms_norm(x, (d,), sd["ln_final.weight"], eps=1e-5), sd["lm_head.weight"])


def test_transformer_lm_matches_functional_reference():
    m = _tiny_lm(dtype=torch.float64)
    for n, prm in m.named_parameters():
        if "ln" in n:
            prm.data = 1 + 0.1 * torch.randn_like(prm)  # norms away from 1 so their weights are exercised
    idx = torch.randint(0, 61, (3, 13))
    ref = _functional_reference_lm(m.state_dict(), idx, num_layers=2, num_heads=4)
    assert torch.allclose(m(idx), ref, atol=1e-5)
    assert m(idx).shape == (3, 13, 61)


def test_no_rope_when_theta_is_none():
    torch.manual_seed(0)
    attn = CausalSelfAttention(16, 2, 20, theta=None, dtype=torch.float64)
    assert attn.rope is None
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    q, k, v = (x @ w.weight.T for w in (attn.q_proj, attn.k_proj, attn.v_proj))
    split = lambda t: t.view(1, 6, 2, 8).transpose(1, 2)
    o = torch.softmax((split(q) @ split(k).transpose(-1, -2) / math.sqrt(8)).masked_fill(
        torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf")), -1) @ split(v)
    assert torch.allclose(attn(x), o.transpose(1, 2).reshape(1, 6, 16) @ attn.output_proj.weight.T)
    assert TransformerLM(50, 16, 16, 1, 2, 32, rope_theta=None)(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 50)


def _check_impls_agree(m, idx, impls, atol):
    """Logits and every parameter's gradient of each impl against naive."""
    results = {}
    for impl in ("naive",) + impls:
        m.attn_impl = impl
        m.zero_grad()
        logits = m(idx)
        cross_entropy(logits, torch.roll(idx, -1, 1)).backward()
        results[impl] = (logits.detach(), [p.grad.clone() for p in m.parameters()])
    ref_logits, ref_grads = results["naive"]
    for impl in impls:
        logits, grads = results[impl]
        assert torch.allclose(logits, ref_logits, atol=atol), impl
        for g, r in zip(grads, ref_grads):
            assert torch.allclose(g, r, atol=atol), impl


def test_attention_impls_agree_forward_and_backward():
    m = _tiny_lm(num_layers=1, context_length=80)
    idx = torch.randint(0, 61, (2, 67))  # longer than the twin's 64-row tile, not a multiple of it
    _check_impls_agree(m, idx, ("sdpa", "flash_ref"), atol=2e-5)
    m.attn_impl = "naive"
    assert all(layer.attn.attn_impl == "naive" for layer in m.layers)
    try:
        m.attn_impl = "fast"
        raise AssertionError("bad attn_impl accepted")
    except ValueError as e:
        assert "attn_impl" in str(e)


def test_flash_attention_impl_matches_naive_in_model():
    m = _tiny_lm(num_layers=1, d_model=32, num_heads=2)  # d_head 16, the kernel's smallest tile dim
    _check_impls_agree(m, torch.randint(0, 61, (1, 19)), ("flash",), atol=1e-4)


def _packed_matches_separate(impl, doc_lens, atol, device="cpu", **model_args):
    m = _tiny_lm(attn_impl=impl, **model_args).to(device)
    torch.manual_seed(3)
    docs = [torch.randint(0, 61, (n,), device=device) for n in doc_lens]
    idx = torch.cat(docs)[None]
    cu = torch.tensor([0] + doc_lens, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    # targets: next token inside each document, -100 on each document's last token (never cross a document)
    end = torch.tensor([-100], device=device)
    targets = torch.cat([torch.cat((d[1:], end)) for d in docs])[None]
    n_real = (targets != -100).sum()
    m.zero_grad()
    logits = m(idx, cu_seqlens=cu, max_seqlen=max(doc_lens))
    (cross_entropy(logits, targets) * n_real).backward()
    packed_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    alone, loss = [], 0.0
    for d in docs:
        lg = m(d[None])
        alone.append(lg)
        t = torch.cat((d[1:], end))[None]
        loss = loss + cross_entropy(lg, t) * (t != -100).sum()
    loss.backward()
    assert torch.allclose(logits, torch.cat(alone, 1), atol=atol), impl
    for (name, p), g in zip(m.named_parameters(), packed_grads):
        assert torch.allclose(g, p.grad, atol=atol), (impl, name)


def test_packed_forward_and_backward_equal_each_document_alone():
    for impl in ("naive", "sdpa", "flash_ref"):
        _packed_matches_separate(impl, [7, 1, 23, 2, 11], atol=2e-5)


def test_packed_flash_varlen_equals_each_document_alone():
    _packed_matches_separate("flash", [5, 1, 13], atol=1e-4)


def test_gpu_flash_model_matches_naive_fp32_bf16_packed_and_compiled():
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA GPU (the CPU tests cover flash through the interpreter)")
    shape = dict(d_model=128, num_heads=2, context_length=300)  # d_head 64; 257 tokens: ragged against every tile
    m = _tiny_lm(**shape).cuda()
    idx = torch.randint(0, 61, (2, 257), device="cuda")
    _check_impls_agree(m, idx, ("sdpa", "flash", "flash_ref"), atol=1e-4)  # fp32 (flash uses IEEE fp32 dots)
    _packed_matches_separate("flash", [100, 1, 257, 33], atol=1e-4, device="cuda", **shape)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        m.attn_impl = "naive"
        ref = m(idx).float()
        m.attn_impl = "flash"
        out = m(idx).float()
        compiled = torch.compile(m)(idx).float()
    scale = ref.abs().max()
    assert (out - ref).abs().max() / scale < 2e-2 and (compiled - out).abs().max() / scale < 2e-2


def test_packed_positions_restart_per_document_and_explicit_positions_override():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    assert model.packed_positions(cu, 9).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]
    mask = model.block_diagonal_causal_mask(cu, 9)
    assert mask[5].tolist() == [False] * 4 + [True, True] + [False] * 3
    m = _tiny_lm()
    idx = torch.randint(0, 61, (2, 9))
    assert torch.allclose(m(idx), m(idx, position_ids=torch.arange(9)))
    shifted = m(idx, position_ids=torch.arange(9) + 5)  # RoPE is relative: a common shift changes nothing
    assert torch.allclose(m(idx), shifted, atol=1e-5)


def test_right_padding_needs_no_mask():
    m = _tiny_lm()
    idx = torch.randint(0, 61, (1, 9))
    padded = torch.cat((idx, torch.zeros(1, 5, dtype=torch.long)), 1)
    assert torch.allclose(m(padded)[:, :9], m(idx), atol=1e-6)


def test_kv_cache_decoding_matches_full_forward():
    m = _tiny_lm().eval()
    idx = torch.randint(0, 61, (3, 12))
    full = m(idx)
    cache = m.make_kv_cache(3)
    pre = m(idx[:, :7], position_ids=torch.arange(7), kv_cache=cache)
    assert cache.length == 7 and torch.allclose(pre, full[:, :7], atol=1e-5)
    for t in range(7, 12):
        step = m(idx[:, t:t + 1], position_ids=torch.full((3, 1), t), kv_cache=cache)
        assert torch.allclose(step[:, 0], full[:, t], atol=1e-5)
    try:
        m(idx, position_ids=torch.arange(12)[None].expand(3, 12), kv_cache=m.make_kv_cache(3, max_len=8))
        raise AssertionError("cache overflow accepted")
    except ValueError as e:
        assert "KV cache full" in str(e)


def test_activation_checkpointing_gives_same_loss_and_grads():
    idx = torch.randint(0, 61, (2, 15))
    results = []
    for ckpt_every in (0, 1, 2):
        m = _tiny_lm(num_layers=3, ckpt_every=ckpt_every)
        loss = cross_entropy(m(idx), torch.roll(idx, -1, 1))
        loss.backward()
        results.append((loss.detach(), [p.grad for p in m.parameters()]))
    for loss, grads in results[1:]:
        assert torch.allclose(loss, results[0][0])
        assert all(torch.allclose(g, r, atol=1e-6) for g, r in zip(grads, results[0][1]))


def test_forward_traces_without_graph_breaks():
    m = _tiny_lm(num_heads=2)
    idx = torch.randint(0, 61, (2, 11))
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    for impl in ("naive", "sdpa", "flash"):
        m.attn_impl = impl
        torch._dynamo.reset()
        compiled = torch.compile(m, backend="eager", fullgraph=True)  # fullgraph: any graph break raises
        assert torch.allclose(compiled(idx), m(idx))
        assert torch.allclose(compiled(idx[:1], cu_seqlens=cu, max_seqlen=7), m(idx[:1], cu_seqlens=cu, max_seqlen=7))
    torch._dynamo.reset()


def test_bad_inputs_are_clear_errors():
    m = _tiny_lm()
    cases = [
        (lambda: m(torch.zeros(1, 41, dtype=torch.long)), "context_length"),
        (lambda: m(torch.zeros(2, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32),
                   max_seqlen=5), "(1, N)"),
        (lambda: m(torch.zeros(1, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5]), max_seqlen=5), "int32"),
        (lambda: m(torch.zeros(1, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32),
                   max_seqlen=torch.tensor(5)), "Python int"),
        (lambda: TransformerLM(10, 8, 30, 1, 4, 64), "divisible"),
        (lambda: TransformerLM(10, 8, 32, 1, 4, 64, attn_impl="flash2"), "attn_impl"),
    ]
    for fn, words in cases:
        try:
            fn()
            raise AssertionError(f"no error for {words}")
        except ValueError as e:
            assert words in str(e), (words, str(e))


def test_param_count_and_flops_match_spec():
    V = 10_000
    expected = {"small": 128.6e6, "medium": 423.2e6, "large": 969.4e6, "xl": 3.407e9, "gpt2-xl": 1.998e9,
                "10B": 12.83e9}
    for name, want in expected.items():
        p = PRESETS[name]
        d, L, d_ff = p["d_model"], p["num_layers"], p["d_ff"]
        psi = 2 * V * d + L * (4 * d * d + 3 * d * d_ff + 2 * d) + d  # SPEC §2.9
        assert abs(psi - want) / want < 1e-3, name
        assert d % p["num_heads"] == 0
    m = TransformerLM(V, 16, 64, 3, 4, 96)
    assert count_params(m) == 2 * V * 64 + 3 * (4 * 64 * 64 + 3 * 64 * 96 + 2 * 64) + 64
    # GPT-2 XL shape check values (SPEC §2.9): one 1,024-token forward = 4.51 TFLOP counting all T^2 terms
    fwd = flops_per_token(50257, 1024, 1600, 48, 6400, causal=False) / 3 * 1024
    assert abs(fwd / 4.51e12 - 1) < 0.005
    d, T = 1600, 1024
    causal = flops_per_token(50257, T, d, 48, 6400, causal=True)
    assert math.isclose(causal, flops_per_token(50257, T, d, 48, 6400, causal=False) - 3 * 48 * 2 * T * d)


# --- sample.py ---

def test_sample_next_greedy_top_k_and_top_p_follow_spec():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.85, 0.05, 0.05, 0.05]]))
    assert sample.sample_next(logits, temperature=0).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample.sample_next(logits, 1.0, top_k=1, generator=g) for _ in range(20)])
    assert (draws == torch.tensor([1, 0])).all()
    # top_p 0.7 on row 0: sorted 0.5, 0.25 | 0.15, 0.1 -> V(p) = {1, 3} (the smallest prefix with mass >= 0.7)
    draws = torch.stack([sample.sample_next(logits, 1.0, top_p=0.7, generator=g) for _ in range(400)])
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {0}
    share = (draws[:, 0] == 1).float().mean().item()
    assert abs(share - 0.5 / 0.75) < 0.08  # renormalised inside V(p)
    tiny_p = torch.stack([sample.sample_next(logits, 1.0, top_p=1e-6, generator=g) for _ in range(20)])
    assert (tiny_p == torch.tensor([1, 0])).all()  # V(p) always holds the top id
    cold = torch.stack([sample.sample_next(logits, 1e-3, generator=g) for _ in range(20)])
    assert (cold == torch.tensor([1, 0])).all()  # temperature -> 0 tends to argmax
    a = sample.sample_next(logits.repeat(50, 1), 1.0, generator=torch.Generator().manual_seed(5))
    b = sample.sample_next(logits.repeat(50, 1), 1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def _greedy_without_model_helpers(m, prompt, n):
    """The plainest decoder: rerun the whole (cropped) sequence, take the argmax of the last position."""
    seq = list(prompt)
    for _ in range(n):
        logits = m(torch.tensor([seq[-m.context_length:]]))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_generate_greedy_same_with_and_without_kv_cache_and_past_the_context():
    m = _tiny_lm(context_length=24)
    prompt = torch.randint(0, 61, (9,)).tolist()
    ref = _greedy_without_model_helpers(m, prompt, 30)  # 9 + 30 > 24: the window slides past the context
    assert sample.generate(m, prompt, 30, temperature=0, use_cache=False) == ref
    calls = []
    hook = m.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(args[0].shape[1]), with_kwargs=True)
    assert sample.generate(m, prompt, 30, temperature=0, use_cache=True) == ref
    hook.remove()
    # prefill of 9, one position per step while the sequence fits (up to 24 tokens), then whole 24-token windows
    assert calls == [9] + [1] * 15 + [24] * 14, calls
    assert m.training  # restored after generate's eval mode


def test_generate_batched_prompts_of_different_lengths_match_each_alone():
    m = _tiny_lm(context_length=30)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 61, (n,)).tolist() for n in (1, 8, 3, 13)]
    alone = [sample.generate(m, p, 12, temperature=0, use_cache=False) for p in prompts]
    assert sample.generate(m, prompts, 12, temperature=0) == alone
    assert sample.generate(m, prompts, 12, temperature=0, use_cache=False) == alone
    # sampling: same seed, same ids with and without the cache
    g = lambda: torch.Generator().manual_seed(7)
    cached = sample.generate(m, prompts, 12, temperature=0.9, top_p=0.95, top_k=20, generator=g())
    plain = sample.generate(m, prompts, 12, temperature=0.9, top_p=0.95, top_k=20, generator=g(), use_cache=False)
    assert cached == plain


def test_generate_stops_at_eot_and_rejects_long_prompts():
    m = _tiny_lm(context_length=16)
    prompts = [[3, 4, 5], [9]]
    greedy = sample.generate(m, prompts, 10, temperature=0)
    eot = greedy[0][2]  # pretend the third generated id of row 0 is <|endoftext|>
    out = sample.generate(m, prompts, 10, temperature=0, eot_id=eot)
    assert out[0] == greedy[0][:2]  # stopped, eot left out
    cut = greedy[1].index(eot) if eot in greedy[1] else len(greedy[1])
    assert out[1] == greedy[1][:cut]
    long_prompt = list(range(20))
    try:
        sample.generate(m, long_prompt, 3)
        raise AssertionError("a prompt longer than the context was accepted")
    except ValueError as e:
        assert "context_length" in str(e) and "crop_prompt" in str(e)
    assert sample.generate(m, long_prompt, 3, temperature=0, crop_prompt=True) == \
        sample.generate(m, long_prompt[-16:], 3, temperature=0)


def _tiny_checkpoint(tmp_path, compiled_names=False):
    """A checkpoint dict shaped like train.py's, with a small BPE tokenizer trained on the spot."""
    import bpe
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. the dog sat on the log.<|endoftext|>a cat and a dog.<|endoftext|>" * 20)
    vocab, merges = bpe.train_bpe(str(corpus), 280, ["<|endoftext|>"], num_workers=1, verbose=False)
    tok_dir = tmp_path / "tok"
    bpe.Tokenizer(vocab, merges, ["<|endoftext|>"]).save(str(tok_dir))
    model_args = dict(vocab_size=len(vocab), context_length=32, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                      rope_theta=10000.0, tie_embeddings=False, ckpt_every=0)
    torch.manual_seed(0)
    m = TransformerLM(**model_args)
    prefix = "_orig_mod." if compiled_names else ""
    ckpt = {"model": {prefix + k: v for k, v in m.state_dict().items()}, "model_args": model_args,
            "config": {"out_dir": str(tmp_path)}, "iteration": 0,
            "tokenizer": {"vocab": str(tok_dir / "vocab.json"), "merges": str(tok_dir / "merges.txt"),
                          "special_tokens": ["<|endoftext|>"]}}
    return ckpt, m


def test_load_model_strips_prefixes_and_matches_the_saved_model(tmp_path):
    ckpt, m = _tiny_checkpoint(tmp_path, compiled_names=True)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    loaded, tokenizer, eot_id, _ = sample.load_model(str(tmp_path / "ckpt.pt"))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), m.state_dict().values()))
    assert tokenizer.decode(tokenizer.encode("the cat")) == "the cat" and tokenizer.encode("<|endoftext|>") == [eot_id]
    assert not loaded.training


def test_load_model_errors_name_the_problem(tmp_path):
    ckpt, _ = _tiny_checkpoint(tmp_path)
    try:
        sample.load_model(str(tmp_path / "nope.pt"))
        raise AssertionError("missing checkpoint accepted")
    except FileNotFoundError as e:
        assert "train.py" in str(e)
    torch.save(ckpt, tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    try:
        sample.load_model(str(tmp_path / "cut.pt"))
        raise AssertionError("truncated checkpoint accepted")
    except RuntimeError as e:
        assert "corrupt or truncated" in str(e)
    bad = dict(ckpt, model_args=dict(ckpt["model_args"], vocab_size=ckpt["model_args"]["vocab_size"] + 5))
    bad["model"] = TransformerLM(**bad["model_args"]).state_dict()
    torch.save(bad, tmp_path / "vocab.pt")
    try:
        sample.load_model(str(tmp_path / "vocab.pt"))
        raise AssertionError("vocabulary mismatch accepted")
    except ValueError as e:
        assert "vocabulary mismatch" in str(e)


def test_sample_cli_prints_batched_samples(tmp_path):
    ckpt, _ = _tiny_checkpoint(tmp_path)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    cmd = [sys.executable, str(ROOT / "sample.py"), f"--out_dir={tmp_path}", "--prompt", "the cat", "--prompt",
           "a dog sat on", "--num_samples=2", "--max_new_tokens=8", "--device=cpu"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    blocks = run.stdout.split("-" * 40 + "\n")
    assert len(blocks) == 5 and blocks[0].startswith("the cat") and blocks[3].startswith("a dog sat on")
    for argv, words in (([f"--out_dir={tmp_path / 'empty'}"], "python train.py"),
                        ([f"--out_dir={tmp_path}", "--prompt", "the cat " * 40, "--device=cpu"], "context_length")):
        try:
            sample.main(argv)
            raise AssertionError(f"sample.py accepted {argv}")
        except SystemExit as e:
            assert words in str(e.code), e.code
