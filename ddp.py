"""Data parallelism from scratch. Sections:

    process group   init_distributed, cleanup_distributed, the averaging
                    collectives
    DDP             DDPNaive, DDPFlat (after backward), DDPIndividualParameters,
                    DDPBucketed (overlapped), DDP()
    ZeRO-1          ShardedOptimizer: each rank keeps and steps the optimizer
                    state of 1/N of the parameters
    FSDP (ZeRO-3)   FSDP, clip_grad_norm, gather_full_params / load_full_params
                    and the optimizer-state pair; orthogonalize_rows (Muon's
                    whole matrices from rows)
    one factory     wrap() -> Parallel, the one interface train.py and bench.py
                    use (IMPLS: its choices)

Launch one process per GPU with torchrun:

    rank, local_rank, world_size, device = init_distributed()
    w = wrap(TransformerLM(...).to(device), "bucketed")  # or naive, fsdp, ...
    optimizer = w.make_optimizer(AdamW, zero1=True, lr=3e-4)  # ZeRO-1 or not
    for micro in range(grad_accum):  # gradient accumulation
        last = micro == grad_accum - 1
        with contextlib.nullcontext() if last else w.no_sync():
            cross_entropy(w(x), y).backward()
    w.finish()  # gradients now averaged over ranks
    w.clip_grad_norm(1.0)
    optimizer.step()
    cleanup_distributed()

The classes also work alone; each starts every replica from rank 0's
parameters and buffers. Every rank must run the same model code: collectives
are issued in its order.
"""
import collections
import contextlib
import inspect
import os
import weakref

import torch
import torch.distributed as dist
# before any group: imported later (optimizers and torch.compile import it),
# its defaults hold the group past destroy_process_group, gloo's threads run
# on and can abort the interpreter's exit
import torch.distributed.nn  # noqa: F401
import torch.nn as nn

# newer torch renamed the single-tensor collectives (same signatures)
_all_gather = (getattr(dist, "all_gather_single", None)
               or dist.all_gather_into_tensor)
_reduce_scatter = (getattr(dist, "reduce_scatter_single", None)
                   or dist.reduce_scatter_tensor)


# ---- process group -----------------------------------------------------------

def init_distributed():
    """(rank, local_rank, world_size, device) from torchrun's environment: NCCL
    with a GPU per process on CUDA, gloo on CPU; without torchrun, one process
    and no process group. NCCL_* settings in the environment stay."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 0, 1, torch.device("cuda" if cuda else "cpu")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend, device, device_id = "gloo", torch.device("cpu"), None
    if cuda:
        backend = "nccl"
        device = device_id = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device_id)
    return rank, local_rank, world_size, device


def cleanup_distributed():
    """Barrier, then tear the process group down (if there is one)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _rank_and_world():
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: launch with "
                           "torchrun and call init_distributed()")
    return dist.get_rank(), dist.get_world_size()


def _avg_op():
    # NCCL averages inside the collective; gloo sums, _finish_average divides
    return dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM


def _finish_average(t):
    if dist.get_backend() != "nccl":
        t.div_(dist.get_world_size())


def _all_reduce_mean(t):
    dist.all_reduce(t, op=_avg_op())
    _finish_average(t)


def _all_reduce_flat(grads):  # one all-reduce per dtype, over a flat copy
    for dtype in dict.fromkeys(g.dtype for g in grads):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        _all_reduce_mean(flat)
        sizes = [g.numel() for g in same]
        for g, f in zip(same, flat.split(sizes)):
            g.copy_(f.view_as(g))


def _broadcast_from_rank0(module):
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src=0)


# ---- DDP, four ways ----------------------------------------------------------

def weak_hook(method):
    """A gradient hook holding its wrapper weakly: tensor hooks live in C++,
    out of reach of the cycle collector, so a strong one (parameter -> hook ->
    wrapper -> module -> parameter) would leak a dropped wrapper."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        if (bound := ref()) is not None:
            bound(*args)
    return hook


class _DataParallel(nn.Module):
    """What the DDP wrappers share: .module, forward, the rank-0 broadcast at
    wrap time, no_sync(). Parameters come once from module.parameters(), so
    tied weights count once; frozen ones are skipped."""

    def __init__(self, module):
        super().__init__()
        self.rank, self.world_size = _rank_and_world()
        self.module = module
        self.require_sync = True  # False inside no_sync(): the hooks stay quiet
        _broadcast_from_rank0(module)
        self.params = [p for p in module.parameters() if p.requires_grad]

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside communicate nothing (finish is a no-op); the
        next synced one sends the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous


class DDPNaive(_DataParallel):
    """After backward: one all-reduce per parameter gradient."""

    def finish_gradient_synchronization(self):
        if self.require_sync:
            for p in self.params:
                if p.grad is not None:
                    _all_reduce_mean(p.grad)


class DDPFlat(_DataParallel):
    """After backward: the gradients flattened into one buffer per dtype, one
    all-reduce each, copied back."""

    def finish_gradient_synchronization(self):
        if self.require_sync:
            _all_reduce_flat([p.grad for p in self.params if p.grad is not None])


class DDPIndividualParameters(_DataParallel):
    """Overlap per parameter: once autograd has accumulated a gradient (a tied
    weight's after both uses), a hook starts its async all-reduce while
    backward goes on. A parameter without gradient fires no hook, which must
    hold on every rank; one accumulated under no_sync() only is all-reduced in
    finish."""

    def __init__(self, module):
        super().__init__(module)
        self.pending = {}  # parameter -> its all-reduce in flight, in order
        for p in self.params:
            p.register_post_accumulate_grad_hook(weak_hook(self._hook))

    def _hook(self, p):
        if self.require_sync:
            self.pending[p] = dist.all_reduce(p.grad, op=_avg_op(),
                                              async_op=True)

    def finish_gradient_synchronization(self):
        if not self.require_sync:
            return
        for p, work in self.pending.items():
            work.wait()
            _finish_average(p.grad)
        for p in self.params:
            if p.grad is not None and p not in self.pending:
                _all_reduce_mean(p.grad)
        self.pending.clear()


class _Bucket:
    """Parameters sharing one flat gradient buffer (p.grad a view into it),
    then a "had a gradient" flag per parameter."""

    def __init__(self, params):
        self.params = params
        sizes = [p.numel() for p in params]
        self.buffer = torch.zeros(sum(sizes) + len(params),
                                  dtype=params[0].dtype, device=params[0].device)
        *chunks, self.flags = self.buffer.split(sizes + [len(params)])
        self.views = [c.view_as(p) for c, p in zip(chunks, params)]
        self.ready, self.work = [False] * len(params), None

    def grad_into_view(self, j):
        """A fresh gradient is copied in; one kept by zero_grad() is the view
        already."""
        p, view = self.params[j], self.views[j]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view

    def launch(self):  # flag j: 1 where parameter j had a gradient on this rank
        self.flags.fill_(1.0)
        for j in [j for j, ready in enumerate(self.ready) if not ready]:
            self.flags[j] = 0.0
        self.work = dist.all_reduce(self.buffer, op=_avg_op(), async_op=True)


class DDPBucketed(_DataParallel):
    """Overlap per bucket: buckets of at most bucket_size_mb MiB in reverse
    registration order (about backward's), each one's async all-reduce started
    in bucket order once its gradients are ready, the rest in finish, so every
    rank issues the same collectives even where a parameter is unused on
    some."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module)
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb={bucket_size_mb} must be > 0")
        limit = bucket_size_mb * 2**20
        groups, size, kind = [], 0, None
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if not groups or size + nbytes > limit or (p.dtype, p.device) != kind:
                groups.append([])
                size, kind = 0, (p.dtype, p.device)
            groups[-1].append(p)
            size += nbytes
        self.buckets = [_Bucket(g) for g in groups]
        self.next_bucket = 0  # the first bucket not launched yet in this step
        hook = weak_hook(self._hook)
        for b, bucket in enumerate(self.buckets):
            for j, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(lambda p, b=b, j=j: hook(b, j))

    def _hook(self, b, j):
        if not self.require_sync:
            return
        bucket = self.buckets[b]
        if bucket.ready[j]:
            raise RuntimeError("a gradient became ready twice before "
                               "finish_gradient_synchronization(): run all but "
                               "the last backward of an accumulation inside "
                               "no_sync()")
        bucket.grad_into_view(j)
        bucket.ready[j] = True
        while self.next_bucket < len(self.buckets):
            first_waiting = self.buckets[self.next_bucket]
            if not all(first_waiting.ready):
                break
            first_waiting.launch()
            self.next_bucket += 1

    def finish_gradient_synchronization(self):
        if not self.require_sync:
            return
        # incomplete on this rank: a missing gradient counts as zeros
        for bucket in self.buckets[self.next_bucket:]:
            for j, p in enumerate(bucket.params):
                if not bucket.ready[j]:
                    # accumulated under no_sync(), unused in this backward
                    bucket.ready[j] = p.grad is not None
                    bucket.grad_into_view(j)
            bucket.launch()
        for bucket in self.buckets:
            bucket.work.wait()
            _finish_average(bucket.buffer)
            if not all(bucket.ready):  # one host read: which were used anywhere
                used = bucket.flags.tolist()
                for p, view, flag in zip(bucket.params, bucket.views, used):
                    p.grad = view if flag > 0 else None
            bucket.ready, bucket.work = [False] * len(bucket.params), None
        self.next_bucket = 0


def DDP(module, bucket_size_mb=None):
    """The public entry: per-parameter overlap when bucket_size_mb is None,
    else bucketed overlap."""
    if bucket_size_mb is None:
        return DDPIndividualParameters(module)
    return DDPBucketed(module, bucket_size_mb)


# ---- ZeRO-1: optimizer-state sharding ----------------------------------------

class ShardedOptimizer(torch.optim.Optimizer):
    """Each rank owns about 1/N of the parameter elements (largest first, to
    the rank with the fewest so far) and keeps and steps their state with an
    inner optimizer_cls; gradients come averaged (by a DDP wrapper). A group's
    parameters become views into a flat buffer per dtype of N equal segments
    (rank r's parameters in segment r), so one in-place all-gather per buffer
    after the inner step brings every rank's updates everywhere."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world_size = _rank_and_world()
        self.optimizer_cls, self.inner_kwargs = optimizer_cls, kwargs
        self.optimizer = None  # its group k: this rank's part of our group k
        self.owner = {}  # parameter -> its owning rank
        self.owned_numel = [0] * self.world_size
        self.flat_buffers = []  # (buffer, segment length), gathered after step
        params = list(params)
        first = params[0]
        if isinstance(first, dict):
            first = first["params"][0]
        # the inner class's defaults (betas, eps, ...): ours look unsharded
        probe = torch.zeros(1, 1, dtype=first.dtype, device=first.device,
                            requires_grad=True)
        defaults = optimizer_cls([probe], **kwargs).defaults
        super().__init__(params, defaults)  # calls add_param_group per group

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        sizes = [p.numel() for p in group["params"]]
        owners = balanced_owners(sizes, self.owned_numel)
        self.owner.update(zip(group["params"], owners))
        self._flatten(group["params"])
        mine = [p for p in group["params"] if self.owner[p] == self.rank]
        owned = {**group, "params": mine}  # maybe no parameters
        if self.optimizer is None:
            self.optimizer = self.optimizer_cls([owned], **self.inner_kwargs)
        else:
            self.optimizer.add_param_group(owned)

    def _flatten(self, params):
        for dtype, device in dict.fromkeys((p.dtype, p.device) for p in params):
            same = [p for p in params if (p.dtype, p.device) == (dtype, device)]
            by_rank = [[p for p in same if self.owner[p] == r]
                       for r in range(self.world_size)]
            seg_len = max(sum(p.numel() for p in owned) for owned in by_rank)
            buffer = torch.zeros(self.world_size * seg_len, dtype=dtype,
                                 device=device)
            for r, owned in enumerate(by_rank):
                segment = buffer[r * seg_len:(r + 1) * seg_len]
                sizes = [p.numel() for p in owned]
                views = segment.split(sizes + [seg_len - sum(sizes)])
                for p, view in zip(owned, views):
                    view.copy_(p.data.reshape(-1))
                    p.data = view.view_as(p)
            self.flat_buffers.append((buffer, seg_len))

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the schedule writes our groups
        for group, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in group.items() if k != "params"})
        self.optimizer.step(**kwargs)
        for buffer, seg_len in self.flat_buffers:
            own = buffer[self.rank * seg_len:(self.rank + 1) * seg_len]
            _all_gather(buffer, own)
        return loss

    def state_dict(self):
        """The consolidated state in torch.optim's format on every rank,
        tensors on CPU (collective: the owners send)."""
        full = super().state_dict()  # the groups; the state comes next
        params = [p for group in self.param_groups for p in group["params"]]
        index = {p: i for i, p in enumerate(params)}
        local = self.optimizer.state
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = self.flat_buffers[0][0].device
        # every rank's state, tensors as shape-only "meta" ones
        shapes = {index[p]: _map_tensors(s, lambda v: v.to("meta"))
                  for p, s in local.items()}
        owned = [None] * self.world_size
        dist.all_gather_object(owned, shapes)
        for r, entries in enumerate(owned):  # then each owner broadcasts
            for i, entry in sorted(entries.items()):
                full["state"][i] = entry
                for k, v in [(k, v) for k, v in entry.items() if torch.is_tensor(v)]:
                    if r == self.rank:
                        t = local[params[i]][k].to(device)
                    else:
                        t = torch.empty_like(v, device=device)
                    dist.broadcast(t, src=r)
                    entry[k] = t.to("cpu", copy=True)  # never the live tensor
        return full

    def load_state_dict(self, state_dict):
        """Load a consolidated state (state_dict()'s or a checkpoint's); each
        rank keeps its own parameters'."""
        saved_groups = state_dict["param_groups"]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        if saved_sizes != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("state dict and optimizer disagree on the "
                             "parameter groups or their sizes")
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        params = [p for group in self.param_groups for p in group["params"]]
        inner_groups = self.optimizer.param_groups
        inner_params = [p for g in inner_groups for p in g["params"]]
        position = {p: j for j, p in enumerate(inner_params)}
        loaded_groups = [{**inner, **group,  # inner's extra keys stay
                          "params": [position[p] for p in inner["params"]]}
                         for group, inner in zip(self.param_groups, inner_groups)]
        state = {position[params[int(i)]]: s
                 for i, s in state_dict["state"].items()
                 if params[int(i)] in position}
        self.optimizer.load_state_dict({"param_groups": loaded_groups,
                                        "state": state})


def _map_tensors(state, fn):  # one parameter's optimizer state
    return {k: fn(v) if torch.is_tensor(v) else v for k, v in state.items()}


# ---- FSDP / ZeRO-3 -----------------------------------------------------------

# A weight under FSDP: `rows` rows padded to `padded_shape`, rank r keeping row
# block r as `shard` (2-D for decay)
_ShardedLayer = collections.namedtuple(
    "_ShardedLayer", "shard rows padded_shape is_embedding")


class _FSDPLinear(torch.autograd.Function):
    """y = x W^T with W all-gathered for this call only (again in backward);
    saves x, never W. The products are model.Linear's (mm(x2, W^T), mm(g2, W),
    model.weight_grad), so a sharded step computes what one process does."""

    @staticmethod
    def forward(ctx, x, shard, fsdp, i):
        import model
        w = fsdp._before_forward(i)
        # autocast's dtype when it is on, else w's or fp32 promoted with x
        dtype = model.autocast_dtype(x)
        if dtype is None and fsdp.compute_dtype:
            dtype = w.dtype
        elif dtype is None:
            dtype = torch.promote_types(x.dtype, w.dtype)
        x2 = x.to(dtype).reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            y = x2.mm(w.to(dtype).t())
        ctx.save_for_backward(x2)
        ctx.fsdp, ctx.i, ctx.x_dtype, ctx.x_shape = fsdp, i, x.dtype, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        import model
        (x2,), fsdp, i = ctx.saved_tensors, ctx.fsdp, ctx.i
        fsdp._before_backward(i)
        g2 = grad_y.to(x2.dtype).reshape(-1, grad_y.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = fsdp._full_weight(i).to(x2.dtype)
            grad_x = g2.mm(w).to(ctx.x_dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = model.weight_grad(g2, x2, fsdp.layers[i].shard.dtype)
            fsdp._reduce_scatter(i, grad_w)
        return grad_x, None, None, None


class _FSDPLinearCrossEntropy(torch.autograd.Function):
    """The fused LM head (model.fused_head, both gradients made in forward) on
    W all-gathered for this call only."""

    @staticmethod
    def forward(ctx, x, targets, shard, fsdp, i, ignore_index, need_grad):
        import model
        w = fsdp._before_forward(i)
        dtype = model.head_dtype(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        flat_targets = targets.reshape(-1).contiguous()
        chunk = model.head_chunk(w.shape[0])
        with torch.autocast(x.device.type, enabled=False):
            loss, dx, dw = model.fused_head(
                x2.to(dtype), w.to(dtype), flat_targets, ignore_index, chunk,
                need_grad)
        ctx.save_for_backward(dx, dw)
        ctx.fsdp, ctx.i, ctx.x_dtype, ctx.x_shape = fsdp, i, x.dtype, x.shape
        return loss

    @staticmethod
    def backward(ctx, grad):
        dx, dw = ctx.saved_tensors
        ctx.fsdp._before_backward(ctx.i)
        if ctx.needs_input_grad[2]:
            ctx.fsdp._reduce_scatter(ctx.i, dw * grad)
        grad_x = (dx * grad).to(ctx.x_dtype).view(ctx.x_shape)
        return grad_x, None, None, None, None, None, None


class _FSDPEmbedding(torch.autograd.Function):
    """out = W[ids] with W all-gathered for this call only. Backward needs no
    W: the gradient rows are summed into a dense fp32 buffer as autograd does
    for `weight[ids]` (index_put_ with accumulate), then reduce-scattered."""

    @staticmethod
    def forward(ctx, ids, shard, fsdp, i):
        w = fsdp._before_forward(i)
        ctx.save_for_backward(ids)
        ctx.fsdp, ctx.i = fsdp, i
        return w[ids]

    @staticmethod
    def backward(ctx, grad_out):
        (ids,), fsdp, i = ctx.saved_tensors, ctx.fsdp, ctx.i
        fsdp._before_backward(i)
        if ctx.needs_input_grad[1]:
            layer = fsdp.layers[i]
            grad_w = grad_out.new_zeros(layer.padded_shape, dtype=layer.shard.dtype)
            rows = grad_out.to(grad_w.dtype)  # bf16 rows summed in fp32
            grad_w.index_put_((ids,), rows, accumulate=True)
            fsdp._reduce_scatter(i, grad_w)
        return None, None, None, None


class FSDP(nn.Module):
    """ZeRO-3 for any model built from model.py's Linear and Embedding: their
    weights become fp32 shards (tied ones once), all-gathered in compute_dtype
    for each use; the rest is replicated, its gradients averaged in finish.
    Build a plain optimizer over module.parameters() after wrapping. The first
    forward records the layer order; then each layer's compute overlaps the
    next one's gather, and backward mirrors it with async reduce-scatters into
    fp32 shard gradients (two of either in flight at most). Backward passes
    add up the shard gradients: accumulation needs no no_sync()."""

    def __init__(self, module, compute_dtype=None):
        super().__init__()
        import model
        self.rank, self.world_size = _rank_and_world()
        self.module, self.compute_dtype = module, compute_dtype
        _broadcast_from_rank0(module)
        self.layers = []
        shards = {}  # original weight -> its shard (a tied weight sharded once)
        kinds = (model.Linear, model.Embedding)
        for m in [m for m in module.modules() if isinstance(m, kinds)]:
            w = m.weight
            if w not in shards:  # this rank's rows, fp32 (fp64 stays fp64)
                rows = -(-w.shape[0] // self.world_size)
                own = _own_rows(model.upcast(w.detach()), (rows, w.shape[1]))
                shards[w] = nn.Parameter(own, requires_grad=w.requires_grad)
                # marks a shard for gather_full_params / load_full_params
                shards[w]._fsdp_full_shape = tuple(w.shape)
            self._wrap_layer(m, shards[w])
        self.shards = list(shards.values())
        self.replicated = [p for p in module.parameters()
                           if not hasattr(p, "_fsdp_full_shape")]
        # layer index -> (full weight, all-gather work), in flight or done
        self._gathered = {}
        # (reduce-scatter work, shard gradient, shard) not yet accumulated
        self._pending = []
        # layer indices in forward order, recorded once
        self._order, self._order_recorded = [], False
        self._fwd_pos, self._bwd_pos, self._in_backward = 0, -1, False

    def _wrap_layer(self, m, shard):  # m computes on W gathered from shard
        import model
        i, rows = len(self.layers), m.weight.shape[0]
        is_embedding = isinstance(m, model.Embedding)
        padded_shape = (self.world_size * shard.shape[0], m.weight.shape[1])
        m.weight = shard
        self.layers.append(_ShardedLayer(shard, rows, padded_shape, is_embedding))
        fn = _FSDPEmbedding if is_embedding else _FSDPLinear
        m.forward = lambda x: fn.apply(x, self.layers[i].shard, self, i)
        if is_embedding:
            return

        def cross_entropy(x, targets, ignore_index=-100):  # the fused LM head
            return _FSDPLinearCrossEntropy.apply(
                x, targets, self.layers[i].shard, self, i, ignore_index,
                torch.is_grad_enabled())
        m.cross_entropy = cross_entropy

    def forward(self, *inputs, **kwargs):
        self._drop_gathered()  # gathered before an optimizer step: stale
        self._fwd_pos, self._bwd_pos, self._in_backward = 0, -1, False
        if self._order_recorded and self._order:
            self._gather(self._order[0])
        out = self.module(*inputs, **kwargs)
        self._order_recorded = True
        ran_every_layer = self._order and self._fwd_pos == len(self._order)
        if torch.is_grad_enabled() and ran_every_layer:
            self._bwd_pos = len(self._order) - 1
            self._prefetch_for_backward(self._bwd_pos)
        return out

    def _gather(self, i):
        """Start the async all-gather of layer i's full weight (in
        compute_dtype) unless it is already underway."""
        if i in self._gathered:
            return
        layer = self.layers[i]
        shard = layer.shard.detach().to(self.compute_dtype or layer.shard.dtype)
        full = shard.new_empty(layer.padded_shape)
        self._gathered[i] = (full, _all_gather(full, shard, async_op=True))

    def _full_weight(self, i):
        """Layer i's full weight; forgotten here, so freed once the caller is
        done."""
        self._gather(i)
        full, work = self._gathered.pop(i)
        work.wait()
        return full[:self.layers[i].rows]

    def _drop_gathered(self):
        for full, work in self._gathered.values():
            work.wait()
        self._gathered.clear()

    def _before_forward(self, i):
        if not self._in_backward:
            pos, self._fwd_pos = self._fwd_pos, self._fwd_pos + 1
            if not self._order_recorded:
                self._order.append(i)
            elif pos + 1 < len(self._order) and self._order[pos] == i:
                # queued before this layer's compute: they overlap
                self._gather(self._order[pos + 1])
        return self._full_weight(i)

    def _before_backward(self, i):
        self._in_backward = True
        pos, self._bwd_pos = self._bwd_pos, self._bwd_pos - 1
        if 0 < pos < len(self._order) and self._order[pos] == i:
            self._prefetch_for_backward(pos - 1)

    def _prefetch_for_backward(self, pos):
        # an Embedding's backward needs no weight
        if not self.layers[self._order[pos]].is_embedding:
            self._gather(self._order[pos])

    def _reduce_scatter(self, i, grad_w):
        """Reduce-scatter layer i's full weight gradient, in fp32 and
        zero-padded, into this rank's shard gradient."""
        layer = self.layers[i]
        if grad_w.shape != layer.padded_shape:
            missing_rows = layer.padded_shape[0] - layer.rows
            padding = grad_w.new_zeros(missing_rows, grad_w.shape[1])
            grad_w = torch.cat([grad_w, padding])
        grad_w = grad_w.to(layer.shard.dtype)  # in fp32, like the master weights
        shard_grad = torch.empty_like(layer.shard)
        work = _reduce_scatter(shard_grad, grad_w, op=_avg_op(), async_op=True)
        self._pending.append((work, shard_grad, layer.shard))
        self._settle(keep=2)

    def _settle(self, keep=0):
        """Add all but the last `keep` reduce-scatters to the shard gradients."""
        while len(self._pending) > keep:
            work, shard_grad, shard = self._pending.pop(0)
            work.wait()
            _finish_average(shard_grad)
            if shard.grad is None:
                shard.grad = shard_grad
            else:
                shard.grad.add_(shard_grad)

    def finish_gradient_synchronization(self):
        """Wait for the reduce-scatters (fp32 shard gradients), average the
        replicated gradients, free the gathered weights."""
        self._settle()
        _all_reduce_flat([p.grad for p in self.replicated if p.grad is not None])
        self._drop_gathered()
        self._in_backward = False

    def clip_grad_norm(self, max_l2_norm):
        """Clip all gradients as one vector to the global norm (see
        clip_grad_norm) and return that norm."""
        return clip_grad_norm(self.replicated, max_l2_norm, sharded=self.shards)


def _squared_norm(grads, device):  # of all grads as one vector, in fp32
    if not grads:
        return torch.zeros((), device=device)
    norms = [n.to(device) for n in torch._foreach_norm(grads)]
    return torch.stack(norms).float().square().sum()


@torch.no_grad()
def clip_grad_norm(parameters, max_l2_norm, sharded=()):
    """Scale every gradient by clamp(max_l2_norm / (norm + 1e-6), max=1)
    (exactly 1 when not clipping: no host sync) and return the global L2 norm
    as a 0-dim fp32 tensor, over `parameters` (replicated) and `sharded`
    (disjoint parts on each rank: their squares are summed over ranks)."""
    sharded = list(sharded)
    grads = [p.grad for p in parameters if p.grad is not None]
    shard_grads = [p.grad for p in sharded if p.grad is not None]
    if not grads and not sharded:
        return torch.zeros(())
    device = (grads or sharded)[0].device
    squares = _squared_norm(grads, device)
    shard_squares = _squared_norm(shard_grads, device)
    if sharded:  # every rank takes part, also one whose shards got no gradient
        dist.all_reduce(shard_squares)
    norm = (squares + shard_squares).sqrt()
    scale = (max_l2_norm / (norm + 1e-6)).clamp(max=1.0)
    every = grads + shard_grads
    for key in dict.fromkeys((g.device, g.dtype) for g in every):
        same = [g for g in every if (g.device, g.dtype) == key]
        torch._foreach_mul_(same, scale.to(*key))
    return norm


def _own_rows(full, shape):
    """This rank's row block of `full`, zero-padded to `shape` (a shard's)."""
    start = _rank_and_world()[0] * shape[0]
    return _pad_rows(full[start:start + shape[0]], shape[0])


def _full(t, p):
    """Tensor t shaped like parameter p (p itself, or its optimizer state)
    made full on every rank: rows gathered under FSDP, the full tensor of a
    torch_fsdp DTensor; t as it is where p is not sharded."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
    if not hasattr(p, "_fsdp_full_shape") or t.shape != p.shape:
        return t
    world_size = _rank_and_world()[1]
    # every rank's row block, padded
    full = t.new_empty((world_size * t.shape[0], *t.shape[1:]))
    _all_gather(full, t.detach().contiguous())
    return full[:p._fsdp_full_shape[0]]


def _shard(t, p):
    """The reverse of _full: this rank's part of the full tensor t, sharded
    like parameter p."""
    same_shape = tuple(t.shape) == tuple(p.shape)
    if hasattr(p, "device_mesh") and same_shape:  # a torch_fsdp DTensor
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(t.to(p.device), p.device_mesh, p.placements)
    if tuple(t.shape) == getattr(p, "_fsdp_full_shape", None):  # under FSDP
        return _own_rows(t, p.shape)
    return t


def _unwrapped(model):
    return model.module if isinstance(model, FSDP) else model


def gather_full_params(model):
    """The unwrapped model's state dict (on CPU) from a model under FSDP (or
    its .module) or torch_fsdp (collective)."""
    state = _unwrapped(model).state_dict(keep_vars=True)
    unique = {id(t): t for t in state.values()}  # a tied weight is gathered once
    full = {k: _full(t, t).detach().to("cpu", copy=True)
            for k, t in unique.items()}
    return {name: full[id(t)] for name, t in state.items()}


def load_full_params(model, state_dict):
    """Load a full state dict into a model under FSDP or torch_fsdp: each rank
    keeps its own part of each tensor."""
    own = _unwrapped(model).state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing {missing}, "
                         f"unexpected {unexpected}")
    with torch.no_grad():
        for name, t in own.items():
            shape = getattr(t, "_fsdp_full_shape", tuple(t.shape))
            given = tuple(state_dict[name].shape)
            if given != shape:
                raise ValueError(f"{name}: shape {given}, expected {shape}")
            t.copy_(_shard(state_dict[name], t))


def gather_full_optimizer_state(model, optimizer):
    """An optimizer's state dict over a model under FSDP or torch_fsdp:
    sharded tensors full, on CPU (collective)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = optimizer.state_dict()
    state = {}
    for i, s in sorted(saved["state"].items()):  # the same order on every rank
        state[i] = _map_tensors(
            s, lambda v: _full(v, params[i]).to("cpu", copy=True))
    return {"state": state, "param_groups": saved["param_groups"]}


def load_full_optimizer_state(model, optimizer, state_dict):
    """Load a full optimizer state into an optimizer over a model under FSDP
    or torch_fsdp (each rank its part)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_count = sum(len(g["params"]) for g in state_dict["param_groups"])
    if len(params) != saved_count:
        raise ValueError("optimizer state and optimizer disagree on the number "
                         "of parameters")
    state = {i: _map_tensors(s, lambda v: _shard(v, params[int(i)]))
             for i, s in state_dict["state"].items()}
    optimizer.load_state_dict({"state": state,
                               "param_groups": state_dict["param_groups"]})


def row_sharded(p):
    """Whether p's rows are spread over the ranks: our FSDP's shards,
    torch_fsdp's DTensors."""
    return hasattr(p, "_fsdp_full_shape") or hasattr(p, "device_mesh")


def _local(t):  # this rank's rows (a DTensor's local tensor, live)
    if hasattr(t, "to_local"):
        return t.to_local()
    return t


def _like(rows, t):  # rows as this rank's part of a tensor like t
    if not hasattr(t, "device_mesh"):
        return rows
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(rows, t.device_mesh, t.placements,
                              run_check=False, shape=t.shape,
                              stride=t.stride())


def _pad_rows(t, rows):
    padding = t.new_zeros(rows - t.shape[0], *t.shape[1:])
    return torch.cat([t, padding])


def balanced_owners(sizes, load):
    """The rank owning each item: largest first, each to the rank with
    the least in `load` so far (ties: the lower rank); adds to load."""
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owners[i] = load.index(min(load))
        load[owners[i]] += sizes[i]
    return owners


def orthogonalize_rows(params, directions, orthogonalize):
    """Muon's updates of matrices sharded by rows (FSDP, torch_fsdp):
    each matrix's rows gathered on the rank that owns it (balanced_owners
    by size), orthogonalize(its share of whole matrices) run there, each
    update's rows scattered back. directions hold this rank's rows, like
    params; so do the updates returned (collective)."""
    rank, world_size = _rank_and_world()
    shapes = [getattr(p, "_fsdp_full_shape", tuple(p.shape))
              for p in params]
    sizes = [r * c for r, c in shapes]
    owners = balanced_owners(sizes, [0] * world_size)
    blocks = [-(-r // world_size) for r, _ in shapes]  # rows per rank
    parts, works = {}, []
    for i, d in enumerate(directions):
        mine = _pad_rows(_local(d), blocks[i])
        if owners[i] == rank:
            parts[i] = [torch.empty_like(mine) for _ in range(world_size)]
        works.append(dist.gather(mine, parts.get(i), dst=owners[i],
                                 async_op=True))
    for work in works:
        work.wait()
    whole = [torch.cat(parts[i])[:shapes[i][0]] for i in parts]
    done = dict(zip(parts, orthogonalize(whole)))
    updates, works = [], []
    for i, d in enumerate(directions):
        rows = _local(d)
        out = rows.new_empty(blocks[i], *rows.shape[1:])
        chunks = None
        if i in done:
            padded = _pad_rows(done[i], blocks[i] * world_size)
            chunks = list(padded.split(blocks[i]))
        works.append(dist.scatter(out, chunks, src=owners[i],
                                  async_op=True))
        updates.append(_like(out[:rows.shape[0]], d))
    for work in works:
        work.wait()
    return updates


# ---- one factory for every data-parallel setup (train.py and bench.py) -------

IMPLS = ("none", "naive", "flat", "overlap", "bucketed", "fsdp", "torch",
         "torch_fsdp")


def _torch_ddp(module):
    device = next(module.parameters()).device
    ddp_cls = nn.parallel.DistributedDataParallel
    # no buffer broadcast before every forward (the RoPE tables are equal
    # everywhere); newer torch renamed the flag
    no_resync = "broadcast_buffers"
    if "forward_sync_buffers" in inspect.signature(ddp_cls).parameters:
        no_resync = "forward_sync_buffers"
    device_ids = [device.index] if device.type == "cuda" else None
    return ddp_cls(module, device_ids=device_ids, **{no_resync: False})


def _torch_fsdp(model, compute_dtype):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # fully_shard keeps each rank's own values: start them all from rank 0's
    _broadcast_from_rank0(model)
    # the model's device, not fully_shard's default (the GPU whenever there is
    # one, even for a gloo run on CPU)
    device_type = next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype,
                                  reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


class Parallel:
    """wrap(model, impl, ...): `model` (on its device) under one data-parallel
    impl, with the operations a training loop needs. impl:
        none                 one process, the plain model
        naive, flat, overlap, bucketed
                             DDPNaive, DDPFlat, DDPIndividualParameters,
                             DDPBucketed
        fsdp                 FSDP, weights gathered in compute_dtype (None: fp32)
        torch                DistributedDataParallel
        torch_fsdp           FSDP2 on each block of model.layers and the model
    compile=True: torch.compile(**compile_kwargs) inside the DDP wrappers
    (hooks stay eager), around the FSDP ones. .module is the unwrapped model,
    .model what is called. state_dict(), optimizer_state_dict() and their
    load_ twins move full states (collectives under FSDP and ZeRO-1), so a
    checkpoint of one impl and world size loads into any other."""

    def __init__(self, model, impl, bucket_size_mb=25.0, compute_dtype=None,
                 compile=False, compile_kwargs=None):
        if impl not in IMPLS:
            raise ValueError(f"unknown data-parallel impl {impl!r}; expected "
                             f"one of {IMPLS}")
        self.impl, self.module = impl, model
        self.sharded = impl in ("fsdp", "torch_fsdp")
        self.rank, self.world_size = 0, 1
        if impl != "none":
            self.rank, self.world_size = _rank_and_world()
        build = {"none": lambda m: m,
                 "naive": DDPNaive,
                 "flat": DDPFlat,
                 "overlap": DDPIndividualParameters,
                 "bucketed": lambda m: DDPBucketed(m, bucket_size_mb),
                 "torch": _torch_ddp,
                 "fsdp": lambda m: FSDP(m, compute_dtype),
                 "torch_fsdp": lambda m: _torch_fsdp(m, compute_dtype)}[impl]

        def compiled(m):
            if not compile:
                return m
            return torch.compile(m, **(compile_kwargs or {}))
        if self.sharded:
            self.model = compiled(build(model))
        else:
            self.model = build(compiled(model))
        # our wrapper (DDP* or FSDP), also when compiled
        self._ours = getattr(self.model, "_orig_mod", self.model)

    def __call__(self, *inputs, **kwargs):
        return self.model(*inputs, **kwargs)

    def train(self, mode=True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def named_parameters(self):
        """The trainable parameters under their unwrapped names (the shards
        under the FSDP variants)."""
        return [(n, p) for n, p in self.module.named_parameters()
                if p.requires_grad]

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def make_optimizer(self, optimizer_cls, param_groups=None, zero1=False,
                       **kwargs):
        """optimizer_cls(param_groups(named_parameters) or all parameters,
        **kwargs); zero1=True shards its state (ShardedOptimizer; plain under
        impl none; the FSDP variants shard it already and refuse)."""
        if param_groups is None:
            groups = self.parameters()
        else:
            groups = param_groups(self.named_parameters())
        if zero1 and self.sharded:
            raise ValueError(f"zero1 shards optimizer state on top of "
                             f"replicated DDP; impl {self.impl!r} shards it "
                             f"already")
        if zero1 and self.impl != "none":
            return ShardedOptimizer(groups, optimizer_cls, **kwargs)
        return optimizer_cls(groups, **kwargs)

    def no_sync(self):
        """Backward passes inside accumulate gradients locally (a null context
        where gradients are sharded)."""
        if self.sharded or self.impl == "none":
            return contextlib.nullcontext()
        return self.model.no_sync()

    def finish(self):
        """Finish the gradient synchronization of the last backward (torch's
        impls finish inside backward)."""
        if self.impl in ("naive", "flat", "overlap", "bucketed", "fsdp"):
            self._ours.finish_gradient_synchronization()

    def clip_grad_norm(self, max_norm):
        """Clip to the global gradient norm (max_norm = inf: only measure) and
        return it, without a host sync."""
        if self.impl == "fsdp":
            return self._ours.clip_grad_norm(max_norm)
        if self.impl == "torch_fsdp":  # DTensor gradients: torch reduces it
            return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        return clip_grad_norm(self.parameters(), max_norm)

    def state_dict(self):
        if self.sharded:
            return gather_full_params(self.module)
        return self.module.state_dict()

    def load_state_dict(self, state_dict):
        if self.sharded:
            return load_full_params(self.module, state_dict)
        return self.module.load_state_dict(state_dict)

    def optimizer_state_dict(self, optimizer):
        if self.sharded:
            return gather_full_optimizer_state(self.module, optimizer)
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer, state_dict):
        if self.sharded:
            return load_full_optimizer_state(self.module, optimizer, state_dict)
        return optimizer.load_state_dict(state_dict)


wrap = Parallel
