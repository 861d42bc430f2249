import os, sys, torch  # noqa: E401

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path  # noqa: E402

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent if _HERE.name == "tests_wip" else _HERE))

import datetime  # noqa: E402
import socket  # noqa: E402
import unittest  # noqa: E402

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

import ddp  # noqa: E402
import model  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# ddp.py: every wrapper against single-process training on the full batch (SPEC §6). Each test spawns 2 (one
# test 4) processes: CPU + gloo, or one GPU each + NCCL where the machine has enough GPUs (so the same tests check
# the NCCL paths on a GPU host). Each process also trains the single-process reference itself, so the
# comparison happens inside the workers and a failed assert fails the spawn.
# ---------------------------------------------------------------------------------------------------------------

DEVICE = torch.device("cpu")  # set per worker process by _ddp_entry


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_entry(rank, world_size, port, worker, args):
    global DEVICE
    torch.set_num_threads(1)
    backend = "gloo"
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        backend, DEVICE = "nccl", torch.device("cuda", rank)
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=90))  # a hang becomes an error, not a stuck CI
    try:
        worker(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def _spawn(worker, *args, world_size=2):
    for attempt in range(3):
        try:
            mp.spawn(_ddp_entry, args=(world_size, _free_port(), worker, args), nprocs=world_size, join=True)
            return
        except mp.ProcessRaisedException as e:  # another process took the free port before rank 0 bound it
            if "address already in use" not in str(e).lower() or attempt == 2:
                raise


class _ToyLM(nn.Module):
    """A tiny LM from model.py's parts, with ragged sizes (vocab 29, rows not divisible by 2 or 4): optional tied
    embedding/lm_head, a frozen parameter, a never-used parameter and one used only when asked (`extra`)."""

    def __init__(self, tie=False, frozen=False, unused=False, extra=False, vocab_size=29, d_model=12, d_ff=19):
        super().__init__()
        self.emb = model.Embedding(vocab_size, d_model)
        self.norm1 = model.RMSNorm(d_model)
        self.ffn = model.SwiGLU(d_model, d_ff)
        self.norm2 = model.RMSNorm(d_model)
        self.proj = model.Linear(d_model, d_model)
        self.norm_f = model.RMSNorm(d_model)
        self.head = model.Linear(d_model, vocab_size)
        if tie:
            self.head.weight = self.emb.weight
        if frozen:
            self.norm2.weight.requires_grad_(False)
        self.unused = model.Linear(d_model, 5) if unused else None
        self.extra = model.Linear(d_model, vocab_size) if extra else None

    def forward(self, ids, use_extra=False):
        x = self.emb(ids)
        x = x + self.ffn(self.norm1(x))
        x = x + self.proj(self.norm2(x))
        logits = self.head(self.norm_f(x))
        if use_extra:
            logits = logits + self.extra(x)
        return logits


def _make_model(seed, **kw):
    torch.manual_seed(seed)
    return _ToyLM(**kw).to(DEVICE)


def _batches(steps, batch_size=4, seq=7, vocab_size=29, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab_size, (batch_size, seq), generator=g).to(DEVICE),
             torch.randint(0, vocab_size, (batch_size, seq), generator=g).to(DEVICE)) for _ in range(steps)]


def _adamw():
    """Our AdamW when train.py is importable (the default path), else torch's."""
    try:
        from train import AdamW
        return AdamW
    except ImportError:
        return torch.optim.AdamW


def _reference(steps, make, data, opt_cls, loss_fn=None, lr=1e-2):
    """Single-process training on the full batch: returns the parameter snapshots after every step."""
    ref = make()
    opt = opt_cls(ref.parameters(), lr=lr, weight_decay=0.1)
    loss_fn = loss_fn or (lambda m, x, y: model.cross_entropy(m(x), y))
    snaps = []
    for x, y in data[:steps]:
        opt.zero_grad(set_to_none=True)
        loss_fn(ref, x, y).backward()
        opt.step()
        snaps.append({k: v.detach().clone() for k, v in ref.state_dict().items()})
    return ref, snaps


def _assert_close(got, want, what, atol=1e-6, rtol=1e-5):
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for k in want:
        err = (got[k].double() - want[k].double()).abs().max().item()
        assert torch.allclose(got[k], want[k], atol=atol, rtol=rtol), f"{what}: {k} differs by {err:.3g}"


def _local(x, rank, world_size):
    n = x.shape[0] // world_size
    return x[rank * n:(rank + 1) * n]


# -- DDP ----------------------------------------------------------------------------------------------------------

def _worker_wrappers(rank, world_size):
    steps, data, opt_cls = 3, _batches(3), _adamw()
    kw = dict(tie=True, frozen=True)
    _, want = _reference(steps, lambda: _make_model(0, **kw), data, opt_cls)
    wrappers = [("naive", ddp.DDPNaive), ("flat", ddp.DDPFlat), ("overlap", ddp.DDP),
                ("bucketed-tiny", lambda m: ddp.DDPBucketed(m, 0.0005)),  # ~500 B: several buckets
                ("bucketed-one", lambda m: ddp.DDP(m, bucket_size_mb=1))]
    for name, wrap in wrappers:
        wrapped = wrap(_make_model(rank, **kw))  # rank r starts from seed r: the broadcast must fix that
        opt = opt_cls(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
        for step, (x, y) in enumerate(data):
            # alternate zero_grad styles: p.grad set to None, and p.grad kept (bucket views stay in place)
            opt.zero_grad(set_to_none=step % 2 == 0)
            model.cross_entropy(wrapped(_local(x, rank, world_size)), _local(y, rank, world_size)).backward()
            wrapped.finish_gradient_synchronization()
            opt.step()
            _assert_close(wrapped.module.state_dict(), want[step], f"{name} step {step}")
        assert wrapped.module.head.weight is wrapped.module.emb.weight


def test_ddp_wrappers_match_single_process_with_tied_and_frozen_params():
    """naive, flat, per-parameter overlap and bucketed DDP (several buckets and one) on a model with tied
    weights and a frozen parameter: after every step the parameters equal full-batch single-process training."""
    _spawn(_worker_wrappers)


def _worker_no_sync(rank, world_size):
    steps, accum, data, opt_cls = 2, 2, _batches(2, batch_size=8), _adamw()

    def pieces(x, y, r):  # rank r's micro-batches; the `extra` layer is used by the first micro-batch only
        x, y = _local(x, r, world_size), _local(y, r, world_size)
        return [(_local(x, m, accum), _local(y, m, accum), m == 0) for m in range(accum)]

    def big_batch(m, x, y):
        return sum(model.cross_entropy(m(xm, use_extra=e), ym)
                   for r in range(world_size) for xm, ym, e in pieces(x, y, r)) / (world_size * accum)

    _, want = _reference(steps, lambda: _make_model(0, extra=True), data, opt_cls, loss_fn=big_batch)
    for name, wrap in [("naive", ddp.DDPNaive), ("overlap", ddp.DDP),
                       ("bucketed", lambda m: ddp.DDPBucketed(m, 0.0005))]:
        wrapped = wrap(_make_model(0, extra=True))
        opt = opt_cls(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
        for step, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            for micro, (xm, ym, use_extra) in enumerate(pieces(x, y, rank)):
                if micro < accum - 1:
                    with wrapped.no_sync():
                        (model.cross_entropy(wrapped(xm, use_extra=use_extra), ym) / accum).backward()
                        wrapped.finish_gradient_synchronization()  # a no-op inside no_sync()
                else:
                    (model.cross_entropy(wrapped(xm, use_extra=use_extra), ym) / accum).backward()
            wrapped.finish_gradient_synchronization()
            opt.step()
            _assert_close(wrapped.module.state_dict(), want[step], f"{name} no_sync step {step}")


def test_ddp_no_sync_accumulation_equals_one_big_batch():
    """Two micro-batches per rank, the first under no_sync(), give the same step as one full batch, also for a
    layer that only the first (unsynchronized) micro-batch uses."""
    _spawn(_worker_no_sync)


def _worker_unused(rank, world_size):
    steps, data, opt_cls = 2, _batches(2), _adamw()
    _, want = _reference(steps, lambda: _make_model(0, unused=True), data, opt_cls)
    for name, wrap in [("naive", ddp.DDPNaive), ("flat", ddp.DDPFlat), ("overlap", ddp.DDP),
                       ("bucketed", lambda m: ddp.DDPBucketed(m, 0.0005))]:
        wrapped = wrap(_make_model(0, unused=True))
        opt = opt_cls(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
        for step, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            model.cross_entropy(wrapped(_local(x, rank, world_size)), _local(y, rank, world_size)).backward()
            wrapped.finish_gradient_synchronization()
            assert wrapped.module.unused.weight.grad is None, name
            opt.step()
            _assert_close(wrapped.module.state_dict(), want[step], f"{name} unused step {step}")

    # bucketed only: a parameter used by rank 1 alone (missing gradients count as zeros on the other ranks)
    half = lambda m, x, y: sum(model.cross_entropy(m(xh, use_extra=h == 1), yh)  # noqa: E731
                               for h, (xh, yh) in enumerate(zip(x.chunk(2), y.chunk(2)))) / 2
    _, want = _reference(steps, lambda: _make_model(0, extra=True), data, opt_cls, loss_fn=half)
    wrapped = ddp.DDPBucketed(_make_model(0, extra=True), 0.0005)
    opt = opt_cls(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        logits = wrapped(_local(x, rank, world_size), use_extra=rank == 1)
        model.cross_entropy(logits, _local(y, rank, world_size)).backward()
        wrapped.finish_gradient_synchronization()
        opt.step()
        _assert_close(wrapped.module.state_dict(), want[step], f"rank-dependent unused step {step}")


def test_ddp_unused_parameter_does_not_hang():
    """A parameter unused on every rank keeps grad None and nothing hangs (all wrappers); under bucketed DDP a
    parameter used on one rank only still matches single-process training."""
    _spawn(_worker_unused)


# -- ZeRO-1 -------------------------------------------------------------------------------------------------------

def _worker_zero1(rank, world_size, opt_names, bucketed):
    steps, data = 4, _batches(4, batch_size=4 * world_size // 2)
    for opt_name in opt_names:
        opt_cls = _adamw() if opt_name == "ours" else torch.optim.AdamW

        def run(wrap, make_opt, x_of, y_of):
            net = _make_model(0)
            wrapped = wrap(net)
            # proj.weight joins the optimizer as a new group after step 2 (until then it is not updated)
            opt = make_opt([p for n, p in net.named_parameters() if n != "proj.weight"])
            snaps = []
            for step, (x, y) in enumerate(data):
                if step == 2:
                    opt.add_param_group({"params": [net.proj.weight], "lr": 5e-3})
                opt.zero_grad(set_to_none=True)
                model.cross_entropy(wrapped(x_of(x)), y_of(y)).backward()
                if wrapped is not net:
                    wrapped.finish_gradient_synchronization()
                opt.step()
                snaps.append({k: v.detach().clone() for k, v in net.state_dict().items()})
            return net, opt, snaps

        ident = lambda t: t  # noqa: E731
        ref_net, ref_opt, want = run(lambda m: m, lambda ps: opt_cls(ps, lr=1e-2, weight_decay=0.1), ident, ident)
        wrap = (lambda m: ddp.DDPBucketed(m, 0.0005)) if bucketed else ddp.DDPNaive
        net, opt, got = run(wrap, lambda ps: ddp.ShardedOptimizer(ps, opt_cls, lr=1e-2, weight_decay=0.1),
                            lambda x: _local(x, rank, world_size), lambda y: _local(y, rank, world_size))
        for step in range(steps):
            _assert_close(got[step], want[step], f"zero1 {opt_name} step {step}")

        # optimizer state: about 1/N of the elements per rank, and the consolidated state equals the reference's
        owned = sum(p.numel() for p in opt.optimizer.state) if opt.optimizer is not None else 0
        counts = [0] * world_size
        dist.all_gather_object(counts, owned)
        total = sum(p.numel() for p in net.parameters())
        assert sum(counts) == total and max(counts) <= total / world_size + 12 * 29, counts
        full, ref_full = opt.state_dict(), ref_opt.state_dict()
        assert full["param_groups"] == ref_full["param_groups"]
        assert full["state"].keys() == ref_full["state"].keys()
        for i, s in ref_full["state"].items():
            for k, v in s.items():
                if torch.is_tensor(v):
                    assert torch.allclose(full["state"][i][k], v.cpu(), atol=1e-6, rtol=1e-5), (opt_name, i, k)
                else:
                    assert full["state"][i][k] == v, (opt_name, i, k)

        # a round trip through load_state_dict continues exactly like the reference
        fresh_net = _make_model(0)
        fresh_net.load_state_dict(net.state_dict())
        fresh = ddp.ShardedOptimizer([p for n, p in fresh_net.named_parameters() if n != "proj.weight"], opt_cls,
                                     lr=1e-2, weight_decay=0.1)
        fresh.add_param_group({"params": [fresh_net.proj.weight], "lr": 5e-3})
        fresh.load_state_dict(full)
        for o, n in ((opt, net), (fresh, fresh_net), (ref_opt, ref_net)):
            for p in n.parameters():
                p.grad = torch.full_like(p, 0.01)
            o.step()
        _assert_close(fresh_net.state_dict(), ref_net.state_dict(), f"zero1 {opt_name} reload")
        _assert_close(net.state_dict(), ref_net.state_dict(), f"zero1 {opt_name} extra step")


def test_zero1_matches_unsharded_optimizer_with_add_param_group():
    """ShardedOptimizer (our AdamW and torch's) under DDP equals the unsharded optimizer, including a parameter
    group added mid-training; state is split about evenly; the consolidated state dict equals the reference's
    and loads back."""
    _spawn(_worker_zero1, ("ours", "torch"), False)


def test_bucketed_ddp_with_zero1_on_four_processes():
    """The 4-rank path: bucketed DDP + ZeRO-1 with our AdamW equals single-process training."""
    _spawn(_worker_zero1, ("ours",), True, world_size=4)


# -- FSDP ---------------------------------------------------------------------------------------------------------

def _tiny_transformer(seed, tie=False):
    torch.manual_seed(seed)
    return model.TransformerLM(vocab_size=29, context_length=8, d_model=12, num_layers=2, num_heads=2, d_ff=19,
                               tie_embeddings=tie).to(DEVICE)


def _worker_fsdp(rank, world_size, models):
    steps, data, opt_cls = 3, _batches(3, seq=8), _adamw()
    makers = {"toy": lambda s: _make_model(s, tie=True, frozen=True), "TransformerLM": _tiny_transformer}
    for name in models:
        make = makers[name]
        ref, want = _reference(steps, lambda: make(0), data, opt_cls)
        sharded = ddp.FSDP(make(rank))
        n_local = sum(s.numel() for s in sharded.shards)
        n_full = sum(p.numel() for p in ref.parameters() if p.dim() == 2)
        assert n_local <= n_full / world_size + 4 * 29, (n_local, n_full)
        opt = opt_cls(sharded.parameters(), lr=1e-2, weight_decay=0.1)
        for step, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            model.cross_entropy(sharded(_local(x, rank, world_size)), _local(y, rank, world_size)).backward()
            sharded.finish_gradient_synchronization()
            for s in sharded.shards:
                assert s.grad is None or (s.grad.dtype == torch.float32 and s.grad.shape == s.shape)
            opt.step()
            _assert_close(ddp.gather_full_params(sharded), want[step], f"FSDP {name} step {step}", atol=2e-6)

        # clipping: the global norm over shards + replicated parameters equals the single-process one
        x, y = data[0]
        for m in (ref, sharded):
            for p in m.parameters():
                p.grad = None
        model.cross_entropy(ref(x), y).backward()
        model.cross_entropy(sharded(_local(x, rank, world_size)), _local(y, rank, world_size)).backward()
        sharded.finish_gradient_synchronization()
        ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()
                                                         if p.grad is not None]))
        norm = sharded.clip_grad_norm(0.5 * ref_norm.item())
        assert torch.allclose(norm, ref_norm, rtol=1e-5), (norm, ref_norm)
        shard_sq = sum(s.grad.norm() ** 2 for s in sharded.shards if s.grad is not None)
        dist.all_reduce(shard_sq)
        total = (shard_sq + sum(p.grad.norm() ** 2 for p in sharded.replicated if p.grad is not None)).sqrt()
        assert abs(total.item() - 0.5 * ref_norm.item()) < 1e-4 * ref_norm.item(), (total, ref_norm)

        # load_full_params puts a full state dict back into the shards
        ddp.load_full_params(sharded, ref.state_dict())
        _assert_close(ddp.gather_full_params(sharded), ref.state_dict(), f"FSDP {name} load_full_params")


def test_fsdp_matches_single_process_and_gathers_its_state_dict():
    """FSDP in fp32 on a model with tied weights, a frozen parameter and ragged shapes: after every step the
    gathered full state dict equals single-process training's; shard gradients are fp32 with the shard's shape;
    clip_grad_norm returns the global norm and clips to it; load_full_params round-trips."""
    _spawn(_worker_fsdp, ("toy",))


def _attention_calls_its_linears():
    """FSDP gathers a weight when its Linear is called; an attention that reads q/k/v weights itself bypasses it."""
    net, called = _tiny_transformer(0), []
    q_proj = net.layers[0].attn.q_proj
    q_proj.forward = lambda x, f=q_proj.forward: called.append(1) or f(x)
    net(torch.zeros(1, 4, dtype=torch.long))
    return bool(called)


def test_fsdp_on_transformer_lm_matches_single_process():
    """The same checks on a tiny TransformerLM (the model train.py wraps)."""
    assert _attention_calls_its_linears(), "CausalSelfAttention must call q_proj/k_proj/v_proj for FSDP to gather them"
    _spawn(_worker_fsdp, ("TransformerLM",))


def _worker_fsdp_compute_dtype(rank, world_size):
    steps, data, opt_cls = 3, _batches(3, seq=8), _adamw()
    make = lambda: _make_model(0, tie=True)  # noqa: E731
    _, want = _reference(steps, make, data, opt_cls)
    sharded = ddp.FSDP(make(), compute_dtype=torch.bfloat16)
    opt = opt_cls(sharded.parameters(), lr=1e-2, weight_decay=0.1)
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        logits = sharded(_local(x, rank, world_size))
        assert logits.dtype == torch.bfloat16
        model.cross_entropy(logits, _local(y, rank, world_size)).backward()
        sharded.finish_gradient_synchronization()
        assert all(s.grad.dtype == torch.float32 for s in sharded.shards)
        opt.step()
    got = ddp.gather_full_params(sharded)
    assert all(v.dtype == torch.float32 for v in got.values())
    _assert_close(got, want[-1], "FSDP bf16", atol=3e-2, rtol=0)  # lr 1e-2 steps: bf16 noise only
    # the same steps under bf16 autocast with fp32 all-gathers (compute_dtype=None) also stay close
    sharded = ddp.FSDP(make())
    opt = opt_cls(sharded.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            logits = sharded(_local(x, rank, world_size))
        model.cross_entropy(logits, _local(y, rank, world_size)).backward()
        sharded.finish_gradient_synchronization()
        opt.step()
    _assert_close(ddp.gather_full_params(sharded), want[-1], "FSDP autocast", atol=3e-2, rtol=0)


def test_fsdp_compute_dtype_bf16_runs_and_stays_close():
    """FSDP with compute_dtype=bf16 (tied weights): bf16 logits, fp32 shard gradients and master weights,
    parameters within bf16 noise of fp32 single-process training; likewise under bf16 autocast."""
    _spawn(_worker_fsdp_compute_dtype)


def test_init_distributed_without_torchrun_is_single_process():
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        rank, local_rank, world_size, device = ddp.init_distributed()
        assert (rank, local_rank, world_size) == (0, 0, 1) and not dist.is_initialized()
        assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        ddp.cleanup_distributed()  # nothing to clean: must not raise
    finally:
        os.environ.update(saved)


def test_wrappers_need_a_process_group():
    if dist.is_initialized():
        raise unittest.SkipTest("a process group is already initialized in this process")
    try:
        ddp.DDPNaive(_make_model(0))
    except RuntimeError as e:
        assert "torchrun" in str(e)
    else:
        raise AssertionError("DDPNaive without a process group should raise")
