import os, sys, torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path
_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent if _HERE.name == "tests_wip" else _HERE))

import contextlib
import math
import unittest

import flash

# On CPU the kernels run in the Triton interpreter (slow): tiny fp32 shapes, chosen so that every code path runs
# (tiles there are 32 x 16 and 16 x 32: several diagonal sub-tiles, ragged last tiles, lengths 1 and 17).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    """||a - b|| / ||b||, absolute when the reference is ~0 (e.g. dQ with a single key); NaN never passes."""
    a, b = a.double(), b.double()
    err = (a - b).norm().item()
    return err / max(b.norm().item(), 1.0) if not math.isnan(err) else float("inf")


@contextlib.contextmanager
def _poisoned_empty():
    """torch.empty / empty_like hand out NaN-filled memory while inside, so any output element a kernel fails to
    write shows up as NaN in the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    torch.empty = lambda *a, **kw: poison(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def _check_dense(b, h, h_kv, s, s_k, d, causal, dtype=torch.float32, tol=1e-5, layout="bhsd", gen=None):
    shape = lambda heads, n: (b, heads, n, d) if layout == "bhsd" else (b, n, heads, d)
    q, k, v = (torch.randn(shape(hh, n), generator=gen, dtype=torch.float32).to(DEVICE, dtype)
               for hh, n in ((h, s), (h_kv, s_k), (h_kv, s_k)))
    if layout == "bshd":  # the (B, S, H, D) projection output seen as (B, H, S, D), no copy
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    do = torch.randn(q.shape, generator=gen).to(DEVICE, dtype)
    with _poisoned_empty():
        o, lse = flash._attention_fwd(q, k, v, causal)
        o.backward(do)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ro, rlse = flash.attention_reference(*ref, causal)
    ro.backward(do.double())
    errs = dict(o=_rel(o, ro), lse=_rel(lse, rlse), dq=_rel(q.grad, ref[0].grad), dk=_rel(k.grad, ref[1].grad),
                dv=_rel(v.grad, ref[2].grad))
    assert all(e < tol for e in errs.values()), (b, h, h_kv, s, s_k, d, causal, layout, errs)
    return o


def test_flash_reference_twin_matches_naive_attention():
    gen = torch.Generator().manual_seed(0)
    for causal in (False, True):
        for batch, s, d in ((2, 1, 16), (1, 17, 32), (2, 100, 16), (1, 130, 64)):
            q, k, v = (torch.randn(batch, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
                       for _ in range(3))
            o = flash.FlashAttentionPyTorch.apply(q, k, v, causal)
            assert o.grad_fn.saved_tensors[-1].shape == (batch, s)  # L saved, (batch, seq_q)
            lse = o.grad_fn.saved_tensors[-1]
            do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
            ro, rlse = flash.attention_reference(q, k, v, causal)
            rdq, rdk, rdv = torch.autograd.grad(ro, (q, k, v), do)
            for a, r in ((o, ro), (lse, rlse), (dq, rdq), (dk, rdk), (dv, rdv)):
                assert _rel(a, r) < 1e-10, (causal, batch, s, d)


def test_flash_triton_dense_ragged_lengths_and_head_dims():
    gen = torch.Generator().manual_seed(1)
    for causal in (False, True):
        for b, h, s, d in ((2, 2, 1, 16), (1, 2, 17, 32), (1, 1, 100, 64), (1, 1, 257, 16)):
            _check_dense(b, h, h, s, s, d, causal, gen=gen)


def test_flash_triton_gqa_strided_views_and_odd_head_dim():
    gen = torch.Generator().manual_seed(2)
    for causal in (False, True):
        o = _check_dense(2, 4, 2, 45, 45, 32, causal, layout="bshd", gen=gen)
        assert o.transpose(1, 2).is_contiguous()  # output keeps the (B, S, H, D) memory: the merge is free
        _check_dense(1, 3, 1, 33, 33, 24, causal, gen=gen)  # head dim 24 runs zero-padded to 32
    _check_dense(1, 2, 2, 20, 50, 16, False, gen=gen)  # more keys than queries
    _check_dense(1, 2, 1, 50, 20, 16, True, gen=gen)  # causal, fewer keys than queries (top-left aligned)


def test_flash_triton_apply_interface_saves_one_lse():
    gen = torch.Generator().manual_seed(3)
    for causal in (False, True):
        q, k, v = (torch.randn(3, 40, 32, generator=gen).to(DEVICE).requires_grad_() for _ in range(3))
        o = flash.FlashAttentionTriton.apply(q, k, v, causal)
        lse = o.grad_fn.saved_tensors[-1]
        assert lse.shape == (3, 40) and lse.dtype == torch.float32
        do = torch.randn(o.shape, generator=gen).to(DEVICE)
        grads = torch.autograd.grad(o, (q, k, v), do)
        ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ro, rlse = flash.attention_reference(*ref, causal)
        rgrads = torch.autograd.grad(ro, ref, do.double())
        assert _rel(o, ro) < 1e-5 and _rel(lse, rlse) < 1e-5
        assert all(_rel(g, r) < 1e-5 for g, r in zip(grads, rgrads))


def _check_varlen(lens, h, h_kv, d, causal, lens_k=None, gen=None, tol=1e-5, dtype=torch.float32):
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
    lens_k = lens if lens_k is None else lens_k
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
    q = torch.randn(sum(lens), h, d, generator=gen).to(DEVICE, dtype).requires_grad_()
    k, v = (torch.randn(sum(lens_k), h_kv, d, generator=gen).to(DEVICE, dtype).requires_grad_() for _ in range(2))
    do = torch.randn(q.shape, generator=gen).to(DEVICE, dtype)
    with _poisoned_empty():
        o, lse = flash._varlen_fwd(q, k, v, cu, cu_k, max(lens), max(lens_k), causal)
        o.backward(do)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ro, rlse = flash.attention_varlen_reference(*ref, cu, causal, cu_k)
    ro.backward(do.double())
    errs = dict(o=_rel(o, ro), lse=_rel(lse, rlse), dq=_rel(q.grad, ref[0].grad), dk=_rel(k.grad, ref[1].grad),
                dv=_rel(v.grad, ref[2].grad))
    assert all(e < tol for e in errs.values()), (lens, h, h_kv, d, causal, errs)
    o2 = flash.flash_attn_varlen(q, k, v, cu, max(lens), causal, cu_k, max(lens_k))  # the public entry point
    assert torch.equal(o2, o)


def test_flash_varlen_many_short_documents_and_long_ones():
    gen = torch.Generator().manual_seed(4)
    for causal in (True, False):
        # many documents inside one 32-row tile, length 1 upward, then ones spanning several tiles
        _check_varlen([1, 2, 5, 1, 17, 3, 1, 9, 40, 1, 33, 70], 2, 2, 16, causal, gen=gen)
    _check_varlen([3, 50, 1, 18], 4, 2, 32, True, gen=gen)  # grouped-query heads


def test_flash_varlen_separate_key_lengths():
    gen = torch.Generator().manual_seed(5)
    _check_varlen([5, 30, 1, 12], 2, 1, 16, False, lens_k=[40, 3, 17, 1], gen=gen)
    _check_varlen([20, 33, 7], 2, 2, 16, True, lens_k=[20, 40, 3], gen=gen)


def test_flash_compiles_without_graph_breaks():
    # aot_eager traces through the fake kernels and the registered autograd formulas with fullgraph=True (a graph
    # break would raise), then runs the real kernels; no C++ compiler needed.
    gen = torch.Generator().manual_seed(6)
    b, s, h, d = 1, 24, 2, 16
    x = torch.randn(b, s, 3 * h * d, generator=gen).to(DEVICE).requires_grad_()
    cu = torch.tensor([0, 5, 24], dtype=torch.int32, device=DEVICE)

    def attend(x):
        q, k, v = (t.view(b, s, h, d).transpose(1, 2) for t in x.split(h * d, dim=-1))
        dense = flash.flash_attention(q, k, v, causal=True).transpose(1, 2).reshape(b, s, h * d)
        packed = flash.flash_attn_varlen(q.transpose(1, 2)[0], k.transpose(1, 2)[0], v.transpose(1, 2)[0], cu, 19)
        return dense + packed.reshape(b, s, h * d)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    x2 = x.detach().requires_grad_()
    out2 = attend(x2)
    (gx2,) = torch.autograd.grad(out2.square().sum(), x2)
    assert _rel(out, out2) < 1e-6 and _rel(gx, gx2) < 1e-6


def test_flash_rejects_bad_input():
    q = torch.randn(1, 3, 8, 16, device=DEVICE)
    k = torch.randn(1, 2, 8, 16, device=DEVICE)
    cases = [
        (lambda: flash.flash_attention(q, k, k), "divide"),
        (lambda: flash.flash_attention(q, q.double(), q), "dtype"),
        (lambda: flash.flash_attention(q[0], q[0], q[0]), "4-D"),
        (lambda: flash.flash_attn_varlen(q[0], q[0], q[0], torch.tensor([0, 3], device=DEVICE), 3), "int32"),
        (lambda: flash.flash_attention(*(torch.randn(1, 1, 4, 300, device=DEVICE),) * 3), "head dim"),
    ]
    for fn, word in cases:
        try:
            fn()
        except ValueError as e:
            assert word in str(e), (word, str(e))
        else:
            raise AssertionError(f"no error for bad input ({word})")


def test_flash_gpu_bf16_large_shapes():
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs CUDA")
    gen = torch.Generator().manual_seed(7)
    for causal in (True, False):
        for b, h, s, d in ((2, 4, 1000, 64), (1, 4, 2049, 128), (1, 2, 777, 256), (2, 3, 333, 32)):
            _check_dense(b, h, h, s, s, d, causal, dtype=torch.bfloat16, tol=2e-2, gen=gen)
        _check_dense(2, 8, 2, 1025, 1025, 128, causal, dtype=torch.bfloat16, tol=2e-2, layout="bshd", gen=gen)
        _check_dense(1, 2, 2, 500, 500, 64, causal, dtype=torch.float16, tol=5e-3, gen=gen)
        _check_dense(1, 2, 2, 300, 300, 64, causal, dtype=torch.float32, tol=2e-3, gen=gen)
        lens = [1, 7, 300, 2, 1500, 64, 129, 1, 900]
        _check_varlen(lens, 8, 8, 128, causal, gen=gen, tol=2e-2, dtype=torch.bfloat16)
        _check_varlen(lens, 8, 2, 64, causal, gen=gen, tol=2e-2, dtype=torch.bfloat16)
